"""How the engine's effects are written into a log: the subject, the envelope and the bytes of each.

The daemon, the `Recorder` and every replay encode effects here, so all of them agree on what a record's effects
are, including a record whose effects cannot be encoded at all (it is revoked and rejected, everywhere alike).
"""

from __future__ import annotations

import orjson

from events import subjects
from events.codec import encode_envelope
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.outputs import Decision
from recovery.core.engine import Effect, Engine


def effect_envelope(effect: Effect) -> tuple[str, EnvelopeBase]:
    """The subject and envelope under which an effect is written back into the log."""
    if isinstance(effect, Decision):
        ident = f"dec:{effect.job}:{effect.cause_seq}:{effect.index}"
        return subjects.decision(effect.job), make_envelope("decision", effect, id=ident, job=effect.job,
                                                            source="recovery-engine")
    ident = f"rej:{effect.seq}"
    return subjects.dead_letter(effect.code), make_envelope("rejection", effect, id=ident,
                                                            source="recovery-engine")


Encoded = tuple[Effect, str, EnvelopeBase, bytes]
"""an effect, the subject and envelope it is written under, and the envelope's bytes"""


def apply_encoded(engine: Engine, record: Record | RawRecord) -> list[Encoded]:
    """Apply a record and encode its effects as they will be written. If one cannot be encoded, the record is
    revoked (the engine undoes it) and its only effect is that rejection: the daemon, the recorder and every replay
    go through here, so a record the daemon could not write is one every replay rejects too."""
    effects = engine.apply(record)
    if not effects:
        return []  # most records: heartbeats and steps
    try:
        return [_encoded(effect) for effect in effects]
    except (orjson.JSONEncodeError, TypeError, ValueError) as exc:
        return [_encoded(engine.revoke(f"its effects cannot be encoded: {exc}"))]


def _encoded(effect: Effect) -> Encoded:
    subject, envelope = effect_envelope(effect)
    return effect, subject, envelope, encode_envelope(envelope)

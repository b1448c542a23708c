"""The daemon's loop without the network: append an input, apply it, append the decisions it caused.

`Recorder` drives any synchronous log (memory or file) exactly as the daemon drives JetStream, so a
recorded log replays into the same decisions. `replay` re-derives decisions from a log's inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from events import subjects
from events.codec import encode_envelope
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.outputs import Decision, Rejection
from recovery.engine import Effect, Engine
from recovery.log import Appended


class SyncLog(Protocol):
    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended: ...


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


@dataclass
class Recorder:
    log: SyncLog
    engine: Engine = field(default_factory=Engine)

    def feed(self, subject: str, payload: EnvelopeBase | bytes) -> list[Effect]:
        """Append one input, apply the stored record, record its effects. Returns the effects."""
        appended = self.log.append_sync(subject, payload)
        if appended.duplicate or appended.record is None:
            return []  # the log dropped a repeated message id, as JetStream does
        record = appended.record
        encoded = apply_encoded(self.engine, record)
        for _, subject_out, envelope, data in encoded:
            self.log.append_sync(subject_out, envelope, encoded=data)
        return [effect for effect, _, _, _ in encoded]


@dataclass
class Replay:
    engine: Engine
    decisions: list[Decision]
    rejections: list[Rejection]
    recorded_decisions: list[Decision]
    recorded_rejections: list[Rejection]
    inputs: int


def replay(records: Iterable[Record | RawRecord], engine: Engine | None = None) -> Replay:
    """Apply every input record to a fresh engine; collect derived and recorded outputs separately."""
    engine = engine or Engine()
    decisions: list[Decision] = []
    rejections: list[Rejection] = []
    recorded: list[Decision] = []
    recorded_rej: list[Rejection] = []
    inputs = 0
    for record in records:
        if subjects.is_output(record.subject):
            # The subject says what a record is, never the envelope's type: a `decision` sent on an event subject is
            # hostile input (the engine dead-letters it), not one of ours.
            if isinstance(record, Record) and record.envelope.type == "decision":
                recorded.append(record.envelope.data)
            elif isinstance(record, Record) and record.envelope.type == "rejection":
                recorded_rej.append(record.envelope.data)
            continue
        inputs += 1
        for effect, _, _, _ in apply_encoded(engine, record):
            (decisions if isinstance(effect, Decision) else rejections).append(effect)  # type: ignore[arg-type]
    return Replay(engine, decisions, rejections, recorded, recorded_rej, inputs)

"""The daemon's loop without the network: append an input, apply it, append the decisions it caused.

`Recorder` drives any synchronous log (memory or file) exactly as the daemon drives JetStream, so a
recorded log replays into the same decisions. `replay` re-derives decisions from a log's inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from events import subjects
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.outputs import Decision, Rejection
from recovery.engine import Effect, Engine
from recovery.log import Appended


class SyncLog(Protocol):
    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
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
        effects = self.engine.apply(record)
        for effect in effects:
            subject_out, envelope = effect_envelope(effect)
            self.log.append_sync(subject_out, envelope)
        return effects


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
        if isinstance(record, Record) and record.envelope.type == "decision":
            recorded.append(record.envelope.data)
            continue
        if isinstance(record, Record) and record.envelope.type == "rejection":
            recorded_rej.append(record.envelope.data)
            continue
        if subjects.is_output(record.subject):
            continue
        inputs += 1
        for effect in engine.apply(record):
            (decisions if isinstance(effect, Decision) else rejections).append(effect)  # type: ignore[arg-type]
    return Replay(engine, decisions, rejections, recorded, recorded_rej, inputs)

"""The daemon's loop without the network: append an input, apply it, append the decisions it caused.

`Recorder` drives any synchronous log (memory or file) exactly as the daemon drives JetStream (both are an
`EffectRouter`), so a recorded log replays into the same decisions. `replay` re-derives decisions from a log's
inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from events import subjects
from events.envelope import EnvelopeBase, RawRecord, Record
from events.kinds import PolicyOverran as PolicyOverranFact
from events.outputs import Decision, Rejection
from recovery.core.effects import apply_encoded
from recovery.core.engine import Effect, Engine
from recovery.core.firings import sealed_from_in, unknown_nodes_in
from recovery.core.overruns import CallKey, OverranFact, fact_message, overruns_in
from recovery.core.router import EffectRouter
from recovery.core.timers import TimerTable
from recovery.log.base import SyncLog


class Recorder(EffectRouter):
    """The daemon's loop on a synchronous log: append an input, apply the stored record, append what it caused.

    An `EffectRouter` whose decisions and rejections are recorded in `log` after their input, so a driver built on
    it (`recovery.testing.Scenario`, the simulator) extends the hooks and calls these ones too."""

    def __init__(self, log: SyncLog, engine: Engine | None = None, timers: TimerTable | None = None) -> None:
        super().__init__(engine, timers)
        self.log = log
        self._facts: list[Record | RawRecord] = []  # facts written while an input was applied, to apply after it

    def feed(self, subject: str, payload: EnvelopeBase | bytes) -> list[Effect]:
        """Append one input, apply the stored record, record its effects. Returns the effects."""
        appended = self.log.append_sync(subject, payload)
        if appended.duplicate or appended.record is None:
            return []  # the log dropped a repeated message id, as JetStream does
        effects = [effect for effect, _, _, _ in self.apply(appended.record)]
        while self._facts:  # inputs too, after the one they are about, as the daemon reads them back
            self.apply(self._facts.pop(0))
        return effects

    def overran(self, job: str, fact: PolicyOverranFact) -> None:
        appended = self.log.append_sync(*fact_message(job, fact))
        if not appended.duplicate and appended.record is not None:
            self._facts.append(appended.record)

    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        self.log.append_sync(subject, envelope, encoded=data)

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        self.log.append_sync(subject, envelope, encoded=data)


@dataclass
class Replay:
    engine: Engine
    decisions: list[Decision]
    rejections: list[Rejection]
    recorded_decisions: list[Decision]
    recorded_rejections: list[Rejection]
    inputs: int


def decision_order(recorded: list[Decision], derived: list[Decision] | None = None) -> list[Decision]:
    """Recorded decisions in the order the engine made them.

    The log usually stores them in that order, but not always: the daemon publishes one batch's outputs pipelined,
    and when the connection drops mid-batch the messages written into the dead socket are sent again after the
    ones that were still buffered, so a batch's outputs can be stored permuted (never across batches: the next
    batch's are published only once all of these are stored). A decision's `(job, cause_seq, index)` names it; its
    place is its cause's seq, then, among the decisions of one cause (which may concern several jobs), the place
    the replay's `derived` decision of that name has (the engine's own order), then job and index for those the
    replay did not make. Stable: a log stored in order keeps it."""
    place = {(d.job, d.cause_seq, d.index): i for i, d in enumerate(derived or ())}
    last = len(place)

    def key(d: Decision) -> tuple[int, int, str, int]:
        return d.cause_seq, place.get((d.job, d.cause_seq, d.index), last), d.job, d.index

    return sorted(recorded, key=key)


def rejection_order(rejections: list[Rejection]) -> list[Rejection]:
    """Recorded dead letters in the order of the inputs they refused (see `decision_order`); stable within one."""
    return sorted(rejections, key=lambda r: r.seq)


def replay(records: Iterable[Record | RawRecord], engine: Engine | None = None,
           overruns: dict[CallKey, OverranFact] | None = None) -> Replay:
    """Apply every input record to a fresh engine; collect derived and recorded outputs separately. `overruns`: the
    abandoned policy calls the records hold (`overruns_in_file` reads them off an export first, so that the records
    stream); without it they are read from the records, which are then held in memory."""
    engine = engine or Engine()
    if overruns is None:
        records = records if isinstance(records, list | tuple) else list(records)
        if engine.sealed_from is None:  # where the daemon's seals began, as its dead letters say
            engine.sealed_from = sealed_from_in(records)
        engine.unknown_nodes_at = unknown_nodes_in(records)
        overruns = overruns_in(records, engine.sealed_from)
    if overruns:  # calls the run abandoned: answered by the built-in here too, however long they would take
        engine.overruns = overruns
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
    return Replay(engine, decisions, rejections, decision_order(recorded, decisions), rejection_order(recorded_rej),
                  inputs)

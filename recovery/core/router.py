"""The one driver loop step, written once: apply a record to the engine and send each of its effects where it goes.

Whatever drives the engine (the daemon's processor, the `Recorder` and through it `recovery.testing.Scenario` and
the simulator) is an `EffectRouter`: decisions go to be recorded or published, their commands to the executors,
their timer requests and cancellations into one `TimerTable`, rejections to the dead letters. A driver says what
"goes" means by overriding `decided`, `commanded` and `rejected`; the timers are kept here, the same for all.
Pure: no clock, no I/O; the driver decides when a timer is due and how its `timer.fired` event travels.
"""

from __future__ import annotations

from events.commands import Command
from events.envelope import EnvelopeBase, RawRecord, Record
from events.kinds import PolicyOverran as PolicyOverranFact
from events.outputs import Decision, Rejection
from recovery.core.effects import Encoded, apply_encoded
from recovery.core.engine import Engine
from recovery.core.overruns import PolicyOverran, key_of
from recovery.core.timers import TimerTable

TIMER_FIRED = "timer.fired"
SUMMARY = "progress.summary"
_MOVES_TIMERS = (TIMER_FIRED, SUMMARY)
"""records that may move a timer with no decision: a periodic one's firing, a summary that stands for a tick"""


class EffectRouter:
    """Applies input records to `engine` and routes their effects; keeps `timers` as the engine keeps its own.

    For each decision, in order: `commanded` for each of its commands, its cancelled timers out of the table, its
    requested timers into it, then `decided`. For a rejection, `rejected`. The hooks do nothing here."""

    def __init__(self, engine: Engine | None = None, timers: TimerTable | None = None) -> None:
        self.engine = engine if engine is not None else Engine()
        self.timers = timers if timers is not None else TimerTable()
        self.watches: dict[str, int] = {}
        """how many watch summaries of each job were applied: a tick held for one waits until the count moves"""

    def apply(self, record: Record | RawRecord) -> list[Encoded]:
        """Apply one input record and route its effects; they come back encoded as they are written into a log
        (a record whose effects cannot be encoded is revoked: `recovery.core.effects.apply_encoded`)."""
        engine = self.engine
        while True:
            try:
                encoded = apply_encoded(engine, record)
                break
            except PolicyOverran as overran:
                # The record is undone. The fact goes into the log, and the record is applied again knowing it: the
                # built-in answers that call, as it will in every replay. Older facts are no longer needed here.
                fact = overran.fact
                kept = {key: seen for key, seen in engine.overruns.items() if key[0] >= fact.seq}
                engine.overruns = {**kept, key_of(overran.job, fact): fact}
                self.overran(overran.job, fact)
        if encoded or (type(record) is Record and record.envelope.type in _MOVES_TIMERS):
            self.route(record, encoded)  # most records have no effects: heartbeats and steps
        return encoded

    def route(self, record: Record | RawRecord, encoded: list[Encoded]) -> None:
        """Route the effects the engine made of `record` (for a driver that applies records itself)."""
        if type(record) is Record and record.envelope.type == TIMER_FIRED:
            data = record.envelope.data
            if encoded and all(type(effect) is Rejection for effect, *_ in encoded):
                # The engine changed nothing, so the timer is still due there: fire it again later, not never. (A
                # rejection followed by decisions is a failed handling the engine contained: the timer was taken.)
                self.timers.refused(data.timer_id, record.envelope.job or "", data.due, record.ts)
            else:
                self.timers.fired(data.timer_id, record.envelope.job or "", data.due, record.ts)
        timers = self.timers
        for effect, subject, envelope, data in encoded:
            if type(effect) is Decision:
                for command in effect.commands:
                    self.commanded(command, effect)
                for timer_id in effect.cancelled_timers:
                    timers.cancel(timer_id)
                for timer in effect.timers:
                    timers.arm(timer.id, effect.job, timer.due, timer.every)
                self.decided(effect, subject, envelope, data)
            else:
                self.rejected(effect, subject, envelope, data)  # type: ignore[arg-type]
        if type(record) is Record and record.envelope.type == SUMMARY and record.envelope.data.watch:
            job = record.envelope.job or ""
            self._follow_watchdog(job)  # after its decisions, should they have armed it anew
            self.watches[job] = self.watches.get(job, 0) + 1

    def _follow_watchdog(self, job_id: str) -> None:
        """A progress summary that stands for its job's watchdog tick may have moved the watchdog's next tick, with no
        decision to say so (`Detection.watch`): the table follows the engine's."""
        job = self.engine.jobs.get(job_id)
        timer_id = job.watchdog if job is not None else None
        entry = self.engine.timers.get(timer_id) if timer_id is not None else None
        if entry is not None and self.timers.get(timer_id) != entry:  # type: ignore[arg-type]
            self.timers.arm(timer_id, *entry)  # type: ignore[arg-type]

    # -- where effects go: what a driver overrides -------------------------------------------------------
    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        """A decision, with the subject, envelope and bytes it is written under."""

    def commanded(self, command: Command, decision: Decision) -> None:
        """A command of `decision`, for the executors (before the decision itself is routed)."""

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        """A rejected input, for the dead letters."""

    def overran(self, job: str, fact: PolicyOverranFact) -> None:
        """A third-party policy's call was abandoned while applying the input `fact.seq`: write the fact into the
        log as an input (`recovery.core.overruns.fact_message`), before the input is applied again."""

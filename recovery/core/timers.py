"""Timers: the one place that says when a timer fires next.

The engine keeps its outstanding timers as part of its state; every driver (the daemon's timer service,
`recovery.testing.Scenario`, the simulator) fires them as `timer.fired` job events at their due time. A periodic
timer fires again `every` nanoseconds after each due time; when periods went by with nobody to fire them (the
daemon was down), the next due time is the first period after the firing, not a burst of every period missed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from events.names import TimerPurpose
from events.outputs import TimerRequest
from policies.base import NS
from recovery.core.record import RecordEffects, Rejected

if TYPE_CHECKING:
    from recovery.core.job import Job


def next_due(due: int, every: int, now: int) -> int:
    """The due time that follows a periodic timer's firing of `due`, handled at log time `now` (>= `due`)."""
    following = due + every
    if following <= now:
        following += ((now - following) // every + 1) * every
    return following


TimerEntry = tuple[str, int, int | None]
"""(job, due, every) of one outstanding timer"""


class TimerJournal(Protocol):
    """Where the record being applied notes the timers it changes, as they were before."""

    timers: dict[str, TimerEntry | None]
    timer_order: list[str] | None


class Timekeeper:
    """The engine's outstanding timers, in the order they were requested: what a record asks for (each id made
    from the job, the purpose and the record's sequence number), cancels, and what a firing moves on. Every change
    is noted in the journal of the record being applied, so that a rejected record leaves the table as it was."""

    __slots__ = ("journal", "table")

    def __init__(self) -> None:
        self.table: dict[str, TimerEntry] = {}
        self.journal: TimerJournal | None = None  # set by the engine while a record that changes things applies

    def request(self, out: RecordEffects, job: Job, purpose: str, after_ns: int,
                every: int | None = None) -> TimerRequest:
        timer_id = f"{job.id}/{purpose}/{out.seq}"
        if after_ns < 0 or (every is not None and every <= 0):
            raise Rejected("invalid_timer", f"timer {timer_id} would fire after {after_ns} ns every {every} ns")
        due = out.ts + after_ns
        self._note(timer_id)
        self.table[timer_id] = (job.id, due, every)
        return TimerRequest(id=timer_id, due=due, every=every)

    def cancel(self, *timer_ids: str | None) -> list[str]:
        gone = []
        table = self.table
        for timer_id in timer_ids:
            if timer_id is not None and timer_id in table:
                self._note(timer_id, removing=True)
                del table[timer_id]
                gone.append(timer_id)
        return gone

    def of_job(self, job: Job) -> list[str]:
        return [t for t, (owner, _, _) in self.table.items() if owner == job.id]

    def fired(self, out: RecordEffects, job: Job, timer_id: str, due: int) -> bool:
        """Take a `timer.fired` event off the table (a periodic timer moves to its next due time). False if the
        firing is stale: cancelled, another job's, or a repeated firing of a period already handled."""
        entry = self.table.get(timer_id)
        if entry is None or entry[0] != job.id:
            return False
        owner, was_due, every = entry
        if every is not None:
            if due != was_due:
                return False
            self._note(timer_id)
            self.table[timer_id] = (owner, next_due(was_due, every, out.ts), every)
        else:
            self._note(timer_id, removing=True)
            del self.table[timer_id]
        return True

    def arm_watchdog(self, out: RecordEffects, job: Job) -> list[TimerRequest]:
        """One periodic timer per running job: its firings are log events, its re-arming needs no decision."""
        interval = int(job.spec.watchdog_interval_s * NS)
        timer = self.request(out, job, TimerPurpose.WATCHDOG, interval, every=interval)
        job.watchdog = timer.id
        return [timer]

    def due_by(self, timer_id: str, due: int) -> bool:
        """Is `timer_id` outstanding and due at or before `due`?"""
        entry = self.table.get(timer_id)
        return entry is not None and entry[1] <= due

    def _note(self, timer_id: str, removing: bool = False) -> None:
        undo = self.journal
        if undo is None:
            return
        if timer_id not in undo.timers:
            undo.timers[timer_id] = self.table.get(timer_id)
        if removing and undo.timer_order is None:
            undo.timer_order = list(self.table)  # a removed timer comes back at its place, not at the end

    def restore(self, before: dict[str, TimerEntry | None], order: list[str] | None) -> None:
        """Put back what the journal noted: each timer as it was, in the order it was requested."""
        table = self.table
        for timer_id, entry in before.items():
            if entry is None:
                table.pop(timer_id, None)
            else:
                table[timer_id] = entry
        if order is not None:
            self.table = {timer_id: table[timer_id] for timer_id in order}

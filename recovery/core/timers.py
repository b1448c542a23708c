"""Timers: the one place that says when a timer fires next, the engine's timer table, and the table every driver
fires them from.

The engine keeps its outstanding timers as part of its state; every driver (the daemon's timer service,
`recovery.testing.Scenario`, the simulator) fires them as `timer.fired` job events at their due time. A periodic
timer fires again `every` nanoseconds after each due time; when periods went by with nobody to fire them (the
daemon was down), the next due time is the first period after the firing, not a burst of every period missed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

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

REFUSED_RETRY_NS = 60 * NS
"""a one-shot timer whose firing the engine rejected is fired again this long after (a periodic one at its next
period): the engine still holds it, and a timer nobody fires again would never end what it guards"""


def after_firing(entry: TimerEntry | None, job: str, due: int, now: int) -> tuple[bool, TimerEntry | None]:
    """What a `timer.fired` event of `job` for `due`, applied at log time `now`, does to its timer's outstanding
    `entry`: whether it fires it at all, and the entry after it (None: a one-shot timer is done; a periodic one
    moves to `next_due`). It fires nothing if the timer is cancelled or done, another job's, or if it names a period
    already handled. The engine's table and every driver's follow this one rule."""
    if entry is None or entry[0] != job:
        return False, entry
    owner, was_due, every = entry
    if every is None:
        return True, None
    if due != was_due:
        return False, entry
    return True, (owner, next_due(was_due, every, now), every)


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
        fires, after = after_firing(self.table.get(timer_id), job.id, due, out.ts)
        if not fires:
            return False
        self._note(timer_id, removing=after is None)
        if after is None:
            del self.table[timer_id]
        else:
            self.table[timer_id] = after
        return True

    def arm_watchdog(self, out: RecordEffects, job: Job) -> list[TimerRequest]:
        """One periodic timer per running job: its firings are log events, its re-arming needs no decision."""
        interval = int(job.spec.watchdog_interval_s * NS)
        timer = self.request(out, job, TimerPurpose.WATCHDOG, interval, every=interval)
        job.watchdog = timer.id
        return [timer]

    def move(self, timer_id: str, due: int, every: int | None) -> None:
        """Move an outstanding timer to `due`, keeping its id, and to `every` (None: once): its firings for an earlier
        due are stale. No decision says so: every driver follows the engine's table where a record moves a timer
        (`EffectRouter`)."""
        job = self.table[timer_id][0]
        self._note(timer_id)
        self.table[timer_id] = (job, due, every)

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
            # The order was taken at the record's first removal: a timer the record requested before that is in
            # it, and is gone again now.
            self.table = {timer_id: table[timer_id] for timer_id in order if timer_id in table}


class Firing(NamedTuple):
    """One timer to fire now: the `timer.fired` event a driver sends for it names the timer and its due time."""

    timer_id: str
    job: str
    due: int
    every: int | None = None
    refired_at: int | None = None
    """when a firing the engine refused is sent again (`TimerTable.refused`); None for one at its due time"""


class TimerTable:
    """The timers a driver fires: the ones the engine asked for and has not cancelled, each at its due time.

    `recovery.core.router.EffectRouter` keeps it: it arms the timers a decision requests, forgets the ones a
    decision cancels, and once the engine has applied a `timer.fired` event it does what the engine did with it
    (`fired`): a one-shot timer is gone, a periodic one moves to `next_due`. So the table holds what the engine's
    own table holds, and a driver only asks it what is due (`due`, or `peek` and `take` one at a time for a
    driver that interleaves timers with a scheduler of its own).

    A timer taken to be fired stays in the table until its firing is applied, but is not due again: a driver
    that could not deliver the event puts it back with `retry`; one whose firing the engine rejected (a policy
    that raised) comes back by itself (`refused`), still for the due time the engine holds. Timers due at the same
    time come out in the order they were armed; `order` numbers them (a simulator shares its scheduler's counter,
    so that its actions and its timers keep one order)."""

    __slots__ = ("_heap", "_late", "_order", "_timers")

    def __init__(self, order: Iterator[int] | None = None) -> None:
        self._timers: dict[str, TimerEntry] = {}  # id -> (job, due, every), as the engine's
        self._heap: list[tuple[int, int, str]] = []  # (fire at, order, id); entries of moved or cancelled timers stay
        self._late: dict[str, int] = {}  # id -> when a refused firing is sent again (its due stays the engine's)
        self._order = order if order is not None else itertools.count(1)

    def __len__(self) -> int:
        return len(self._timers)

    def __contains__(self, timer_id: object) -> bool:
        return timer_id in self._timers

    def get(self, timer_id: str) -> TimerEntry | None:
        """(job, due, every) of an armed timer."""
        return self._timers.get(timer_id)

    def arm(self, timer_id: str, job: str, due: int, every: int | None = None) -> None:
        self._timers[timer_id] = (job, due, every)
        self._late.pop(timer_id, None)
        heapq.heappush(self._heap, (due, next(self._order), timer_id))

    def cancel(self, timer_id: str) -> None:
        self._timers.pop(timer_id, None)
        self._late.pop(timer_id, None)
        if len(self._heap) > 2 * len(self._timers) + 4096:
            self._compact()  # cancelled deadlines may be due in years: do not keep their entries that long

    def _compact(self) -> None:
        timers, late = self._timers, self._late
        self._heap = [e for e in self._heap
                      if (entry := timers.get(e[2])) is not None and (entry[1] == e[0] or late.get(e[2]) == e[0])]
        heapq.heapify(self._heap)  # the entries keep their order numbers: ties still come out as armed

    def load(self, timers: Mapping[str, TimerEntry]) -> int:
        """Arm every timer of an engine's table (`Engine.timers`: id -> (job, due, every)), as after a restore."""
        for timer_id, (job, due, every) in timers.items():
            self.arm(timer_id, job, due, every)
        return len(timers)

    def fired(self, timer_id: str, job: str, due: int, ts: int) -> None:
        """The engine has applied a `timer.fired` event for `timer_id` and `due` at log time `ts`: do what it did
        with its own table (`after_firing`)."""
        fires, after = after_firing(self._timers.get(timer_id), job, due, ts)
        if not fires:
            return  # stale or cancelled: the engine ignored it
        if after is None:
            del self._timers[timer_id]
            self._late.pop(timer_id, None)
        else:
            self.arm(timer_id, *after)

    def refused(self, timer_id: str, job: str, due: int, ts: int) -> None:
        """The engine rejected the `timer.fired` event for `timer_id` and `due` at log time `ts`: its own table is
        unchanged, so the timer is still due there. Fire it again later, for the same due time: a periodic timer
        at its next period (the watchdog goes on), a one-shot one `REFUSED_RETRY_NS` after the refusal."""
        entry = self._timers.get(timer_id)
        if entry is None or entry[0] != job or entry[1] != due:
            return
        every = entry[2]
        # Never before its due time: a firing refused as early (`recovery.core.firings`: forged, or a server clock
        # behind the timer service's) must not bring a ten-minute deadline forward to a minute after it. `at` stays
        # distinct from one refusal to the next (it is in the next firing's id, which the log's duplicate window
        # would otherwise drop); an entry at the due time that was never taken fires first (`due` takes it once).
        self._again(timer_id, next_due(due, every, ts) if every is not None else max(ts + REFUSED_RETRY_NS, due))

    def _again(self, timer_id: str, at: int) -> None:
        """Take an armed timer again at `at`, for its due time: its firing then carries `at` in its id."""
        self._late[timer_id] = at
        heapq.heappush(self._heap, (at, next(self._order), timer_id))

    def peek(self) -> tuple[int, int, str] | None:
        """(due, order, timer id) of the next timer to take, or None; it may turn out cancelled or moved when
        taken."""
        return self._heap[0] if self._heap else None

    def take(self) -> Firing | None:
        """Take the next timer: the firing to send, or None if it was cancelled or has moved since it was armed."""
        at, _, timer_id = heapq.heappop(self._heap)
        entry = self._timers.get(timer_id)
        if entry is None:
            return None
        if entry[1] == at:
            return Firing(timer_id, entry[0], at, entry[2])
        if self._late.get(timer_id) != at:
            return None  # moved since this entry was pushed
        del self._late[timer_id]
        return Firing(timer_id, entry[0], entry[1], entry[2], refired_at=at)

    def due(self, now: int) -> list[Firing]:
        """Take every timer due at or before `now`, in due order."""
        out = []
        taken: set[str] = set()  # a timer refused as early may have two entries at its due time: it fires once
        heap = self._heap
        while heap and heap[0][0] <= now:
            firing = self.take()
            if firing is not None and firing.timer_id not in taken:
                taken.add(firing.timer_id)
                out.append(firing)
        return out

    def next_at(self) -> int | None:
        """The earliest time a timer is to be taken (perhaps of a timer since cancelled: taking it finds out)."""
        return self._heap[0][0] if self._heap else None

    def retry(self, firing: Firing) -> None:
        """Make a taken timer due again (its event was not delivered), unless it has been cancelled or moved."""
        entry = self._timers.get(firing.timer_id)
        if entry is not None and entry[1] == firing.due:
            at = firing.due if firing.refired_at is None else firing.refired_at
            if firing.refired_at is not None:
                self._late[firing.timer_id] = at
            heapq.heappush(self._heap, (at, next(self._order), firing.timer_id))

    def defer(self, firing: Firing, at: int) -> None:
        """Take a timer again at `at`, for the same due time, unless it has been moved or cancelled by then (its
        firing then goes under another id, as a refused one's does)."""
        entry = self._timers.get(firing.timer_id)
        if entry is not None and entry[1] == firing.due:
            self._again(firing.timer_id, at)

    def describe(self) -> dict[str, object]:
        return {"armed": len(self._timers), "heap": len(self._heap), "next_due": self.next_at()}

"""Timers: the one place that says when a timer fires next, and the table every driver fires them from.

The engine keeps its outstanding timers as part of its state; every driver (the daemon's timer service,
`recovery.testing.Scenario`, the simulator) fires them as `timer.fired` job events at their due time. A periodic
timer fires again `every` nanoseconds after each due time; when periods went by with nobody to fire them (the
daemon was down), the next due time is the first period after the firing, not a burst of every period missed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from typing import NamedTuple


def next_due(due: int, every: int, now: int) -> int:
    """The due time that follows a periodic timer's firing of `due`, handled at log time `now` (>= `due`)."""
    following = due + every
    if following <= now:
        following += ((now - following) // every + 1) * every
    return following


class Firing(NamedTuple):
    """One timer to fire now: the `timer.fired` event a driver sends for it names the timer and its due time."""

    timer_id: str
    job: str
    due: int
    every: int | None = None


class TimerTable:
    """The timers a driver fires: the ones the engine asked for and has not cancelled, each at its due time.

    `recovery.core.router.EffectRouter` keeps it: it arms the timers a decision requests, forgets the ones a
    decision cancels, and once the engine has applied a `timer.fired` event it does what the engine did with it
    (`fired`): a one-shot timer is gone, a periodic one moves to `next_due`. So the table holds what the engine's
    own table holds, and a driver only asks it what is due (`due`, or `peek` and `take` one at a time for a
    driver that interleaves timers with a scheduler of its own).

    A timer taken to be fired stays in the table until its firing is applied, but is not due again: a driver
    that could not deliver the event puts it back with `retry`. Timers due at the same time come out in the order
    they were armed; `order` numbers them (a simulator shares its scheduler's counter, so that its actions and
    its timers keep one order)."""

    __slots__ = ("_heap", "_order", "_timers")

    def __init__(self, order: Iterator[int] | None = None) -> None:
        self._timers: dict[str, tuple[str, int, int | None]] = {}  # id -> (job, due, every), as the engine's
        self._heap: list[tuple[int, int, str]] = []  # (due, order, id); entries of moved or cancelled timers stay
        self._order = order if order is not None else itertools.count(1)

    def __len__(self) -> int:
        return len(self._timers)

    def __contains__(self, timer_id: object) -> bool:
        return timer_id in self._timers

    def get(self, timer_id: str) -> tuple[str, int, int | None] | None:
        """(job, due, every) of an armed timer."""
        return self._timers.get(timer_id)

    def arm(self, timer_id: str, job: str, due: int, every: int | None = None) -> None:
        self._timers[timer_id] = (job, due, every)
        heapq.heappush(self._heap, (due, next(self._order), timer_id))

    def cancel(self, timer_id: str) -> None:
        self._timers.pop(timer_id, None)
        if len(self._heap) > 2 * len(self._timers) + 4096:
            self._compact()  # cancelled deadlines may be due in years: do not keep their entries that long

    def _compact(self) -> None:
        timers = self._timers
        self._heap = [e for e in self._heap if (entry := timers.get(e[2])) is not None and entry[1] == e[0]]
        heapq.heapify(self._heap)  # the entries keep their order numbers: ties still come out as armed

    def load(self, timers: Mapping[str, tuple[str, int, int | None]]) -> int:
        """Arm every timer of an engine's table (`Engine.timers`: id -> (job, due, every)), as after a restore."""
        for timer_id, (job, due, every) in timers.items():
            self.arm(timer_id, job, due, every)
        return len(timers)

    def fired(self, timer_id: str, job: str, due: int, ts: int) -> None:
        """The engine has applied a `timer.fired` event for `timer_id` and `due` at log time `ts`: do what it did
        with its own table (the same checks, the same `next_due`)."""
        entry = self._timers.get(timer_id)
        if entry is None or entry[0] != job:
            return  # stale or cancelled: the engine ignored it
        owner, armed_due, every = entry
        if every is None:
            del self._timers[timer_id]
        elif due == armed_due:
            self.arm(timer_id, owner, next_due(armed_due, every, ts), every)

    def peek(self) -> tuple[int, int, str] | None:
        """(due, order, timer id) of the next timer to take, or None; it may turn out cancelled or moved when
        taken."""
        return self._heap[0] if self._heap else None

    def take(self) -> Firing | None:
        """Take the next timer: the firing to send, or None if it was cancelled or has moved since it was armed."""
        due, _, timer_id = heapq.heappop(self._heap)
        entry = self._timers.get(timer_id)
        if entry is None or entry[1] != due:
            return None
        return Firing(timer_id, entry[0], due, entry[2])

    def due(self, now: int) -> list[Firing]:
        """Take every timer due at or before `now`, in due order."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            firing = self.take()
            if firing is not None:
                out.append(firing)
        return out

    def next_at(self) -> int | None:
        """The earliest due time still to take (perhaps of a timer since cancelled: taking it finds out)."""
        return self._heap[0][0] if self._heap else None

    def retry(self, firing: Firing) -> None:
        """Make a taken timer due again (its event was not delivered), unless it has been cancelled or moved."""
        entry = self._timers.get(firing.timer_id)
        if entry is not None and entry[1] == firing.due:
            heapq.heappush(self._heap, (firing.due, next(self._order), firing.timer_id))

    def describe(self) -> dict[str, object]:
        return {"armed": len(self._timers), "heap": len(self._heap), "next_due": self.next_at()}

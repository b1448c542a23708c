"""Timers: the one place that says when a timer fires next.

The engine keeps its outstanding timers as part of its state; every driver (the daemon's timer service,
`recovery.testing.Scenario`, the simulator) fires them as `timer.fired` job events at their due time. A periodic
timer fires again `every` nanoseconds after each due time; when periods went by with nobody to fire them (the
daemon was down), the next due time is the first period after the firing, not a burst of every period missed.
"""

from __future__ import annotations


def next_due(due: int, every: int, now: int) -> int:
    """The due time that follows a periodic timer's firing of `due`, handled at log time `now` (>= `due`)."""
    following = due + every
    if following <= now:
        following += ((now - following) // every + 1) * every
    return following

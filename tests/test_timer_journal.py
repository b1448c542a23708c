"""A rejected record leaves the engine's timers as they were, whatever it requested and cancelled on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from recovery.core.timers import Timekeeper, TimerEntry


@dataclass
class Journal:
    timers: dict[str, TimerEntry | None] = field(default_factory=dict)
    timer_order: list[str] | None = None


def record(seq: int) -> Any:
    return SimpleNamespace(seq=seq, ts=seq * 1_000)


def test_a_timer_requested_before_the_first_cancel_is_gone_after_the_rollback() -> None:
    """The order the rollback puts back is taken at the record's first removal, when a timer the same record asked
    for earlier is already in the table (a resume that plans, arms an attempt deadline, then ends the attempt and
    asks a policy that raises)."""
    keeper = Timekeeper()
    job = SimpleNamespace(id="j")
    first = keeper.request(record(1), job, "watchdog", 10, every=10)
    second = keeper.request(record(2), job, "wait", 50)
    before = dict(keeper.table)
    journal = Journal()
    keeper.journal = journal
    new = keeper.request(record(3), job, "attempt", 20)  # asked for first, then
    keeper.cancel(first.id)  # the first removal snapshots the order, with the new timer in it
    keeper.journal = None
    keeper.restore(journal.timers, journal.timer_order)
    assert keeper.table == before and list(keeper.table) == [first.id, second.id] and new.id not in keeper.table

"""The journal of the record being applied: what it changed, as it was before, so that a record whose handling
fails half way is undone exactly (`Engine.rollback`)."""

from __future__ import annotations

from typing import Any

from recovery.core.job import Job, Memento
from recovery.core.timers import TimerEntry


class Journal:
    """What the record being applied changed, as it was before: enough to undo it exactly."""

    __slots__ = ("created", "finished", "hungry", "jobs", "nodes", "seen", "submissions", "timer_order", "timers")

    def __init__(self, submissions: int) -> None:
        self.jobs: dict[str, tuple[Job, Memento]] = {}
        self.nodes: dict[str, Any] = {}
        self.timers: dict[str, TimerEntry | None] = {}
        self.timer_order: list[str] | None = None
        self.hungry: dict[str, None] | None = None
        self.finished: dict[str, None] | None = None
        self.created: str | None = None
        self.submissions = submissions
        self.seen: tuple[dict[str, None], str, str | None] | None = None

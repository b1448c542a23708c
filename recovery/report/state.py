"""What the report keeps while it reads a log: per job its shape, pace and step line, per incident its faults,
phases, attempts and the why of its decisions. Bounded by jobs and incidents, never by the log's length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recovery.report.stacks import StackGroups

NS = 1_000_000_000


def seconds(ns: int | float) -> float:
    """Nanoseconds of log time as seconds, to the millisecond (the report's unit)."""
    return round(ns / NS, 3)


@dataclass
class Phase:
    """One phase of an incident: from the decision that entered it to the one that left it (None: still in it)."""

    name: str
    start: int
    end: int | None = None


@dataclass
class Incident:
    """An incident as read so far."""

    id: str
    job: str
    opened: int
    opened_seq: int
    cause: str = "fault"
    first_signal: int | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    dying: dict[str, Any] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    decisions_omitted: int = 0
    fault_count: int = 0
    first_command: int | None = None
    closed: int | None = None
    outcome: str | None = None
    lost_steps: int | None = 0
    """None: unknown (a script that reports no steps)"""
    step_at_open: int = 0
    restart_loop: bool = False
    before_window: bool = False
    """opened before --since: its start is not in what was read"""
    stacks: StackGroups | None = None
    """the stacks the agents took before a hang was acted on, grouped"""


@dataclass
class JobFold:
    """A job as read so far: its shape and policies, its step line, its open and closed incidents."""

    id: str
    nodes: list[str] = field(default_factory=list)
    rpn: int = 1
    gpus: int = 0
    policies: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    started: int | None = None
    ended: int | None = None
    end_state: str | None = None
    end_reason: str = ""
    """why the job ended, as its final decision says (a crash loop, a budget run out)"""
    first_seen: int | None = None
    last_seen: int | None = None
    state: str = "submitted"
    step: int = 0
    step_points: list[tuple[int, int]] = field(default_factory=list)
    thin: int = 1
    """keep every `thin`-th step point: doubled each time the line reaches STEP_POINTS"""
    seen_points: int = 0
    step_ns: float | None = None
    last_step: tuple[int, int] | None = None
    suspected: dict[str, int] = field(default_factory=dict)
    """open suspicions: key -> log time of their signal"""
    incident: Incident | None = None
    incidents: list[Incident] = field(default_factory=list)
    incident_count: int = 0
    last_heard: dict[int, int] = field(default_factory=dict)
    """rank -> log time of its last heartbeat or step: when a rank found silent went silent"""
    dead_letters: dict[str, int] = field(default_factory=dict)
    """code -> how many of the job's inputs were dead-lettered (a policy error among them)"""
    first_dead_letters: list[dict[str, Any]] = field(default_factory=list)
    policy_failures: int = 0
    """`policy.failed` decisions: a plugin erred or looped, and the built-in answered"""
    first_policy_failures: list[dict[str, Any]] = field(default_factory=list)
    step_after_close: int | None = None
    """the step at which the last closed incident struck: the next one is a restart loop unless the job got past it"""
    decision_counts: dict[str, int] = field(default_factory=dict)
    loose: list[dict[str, Any]] = field(default_factory=list)
    loose_omitted: int = 0

    def node_of(self, rank: int) -> str | None:
        index = rank // self.rpn if self.rpn else -1
        return self.nodes[index] if 0 <= index < len(self.nodes) else None

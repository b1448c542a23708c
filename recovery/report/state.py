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
    generation: int | None = None
    """the generation the incident's latest restart started its processes in"""
    restarted: int = 0
    """the ranks that restart started"""
    starts: int = 0
    """of them, the processes reported started"""
    all_started: int | None = None
    """log time when every restarted process had started"""
    first_output: int | None = None
    """log time of the first output of a process of the restart (a stock script's first sign that it runs)"""
    first_step: int | None = None
    """log time of the first step a process of the restart reported (counted, for a script without the SDK)"""


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
    sdk: bool = False
    """a rank reported a heartbeat or a step"""
    caps: set[str] | None = None
    """what its ranks said they can do (`process.capabilities`); None: nothing said"""
    submitted: bool = False
    """its submission is among the records read (not before --since)"""
    refused: str | None = None
    """why the daemon refused the job's submission (it never ran)"""
    unserved: str | None = None
    """why it could not start: its nodes had no agent (the daemon's `job.unserved`)"""
    step_after_close: int | None = None
    """the step at which the last closed incident struck: the next one is a restart loop unless the job got past it"""
    decision_counts: dict[str, int] = field(default_factory=dict)
    loose: list[dict[str, Any]] = field(default_factory=list)
    loose_omitted: int = 0

    @property
    def counted(self) -> bool:
        """Only the step hook reported its steps: a script without the SDK, its optimizer steps counted from 1 in each
        process (`recovery.client.steps`)."""
        return self.caps is not None and "counts" in self.caps and "steps" not in self.caps

    @property
    def reports_checkpoints(self) -> bool:
        """Its ranks report the checkpoints they write (said `checkpoints`; before capabilities were said, any SDK
        job was taken to): a restart resumes from one the plan names, else from the script's own."""
        return self.speaks and (self.caps is None or "checkpoints" in self.caps)

    @property
    def speaks(self) -> bool:
        """A rank spoke through the SDK: the job's progress is measured, not only its processes."""
        return self.sdk and not self.counted

    @property
    def never_ran(self) -> bool:
        """Submitted in what was read, and never started (refused, unserved, cancelled first, or still waiting)."""
        return self.started is None and self.submitted and not self.incidents and self.incident is None

    def node_of(self, rank: int) -> str | None:
        index = rank // self.rpn if self.rpn else -1
        return self.nodes[index] if 0 <= index < len(self.nodes) else None

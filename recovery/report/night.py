"""What a recorded log holds for the what-if, once read (`recovery.report.recorded` reads it): the cluster and its
job, the faults being read (drafts: a fault's repair is known only when its hardware comes back), the night's
recovery decisions and measured answers, and the faults as the simulator's `Fault`s."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from recovery.sim.answers import RecordedAnswer
from recovery.sim.config import NS, Durations
from recovery.sim.faults import Collective, CollectiveFailure, Fault, LossReport
from recovery.sim.history import NodeRecord


@dataclass
class Draft:
    """A fault being read: its repair or outage is known only when the log says the hardware came back."""

    at: int
    signal: str
    scope: str
    source: str
    position: int | None = None
    node: str | None = None
    device: int = 0
    code: str | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    back: int | None = None
    exits: list[int] = field(default_factory=list)
    """further ranks stopped by the same SIGTERM"""
    dying: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """the SIGTERM handlers' dying checkpoints: ns after the exit (negative: before it), shards"""
    collective: Collective | None = None
    failed_collective: CollectiveFailure | None = None
    silent: bool = False
    pool: str | None = None
    command: tuple[str, tuple[tuple[str, Any], ...]] | None = None
    generation: int | None = None
    """the generation of the group whose collective failed"""
    slowdown: float = 1.0
    """a straggler: how many times slower the job trained while it was in the placement (as the log measured it)"""
    compute_slowdown: float | None = None
    """a straggler: its compute time over its peers' median, as the recorded engine measured it"""
    pace_measured: bool = False
    """a straggler's `slowdown` is measured: the log has the job's steps both with it in the placement and without"""
    losses: list[LossReport] = field(default_factory=list)
    """a bad step: the loss reports the recorded engine took as one, in order"""
    base_step: int = 0
    """a bad step: the job's newest step when its first report came (the reports' steps are counted from it)"""
    recent_losses: tuple[float, ...] = ()
    """a bad step found by a spike: the finite losses reported before it, which the engine judged it against"""


@dataclass(frozen=True)
class PastEvent:
    """A node event from before the job's submission: the cluster's history, which the engine counts (its frequency
    rule reads the fault times of every job's devices)."""

    ts: int
    node: str
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class RecoveryDecision:
    """One recorded recovery decision: its kind, the attempt's granularity, and when (s since the job started)."""

    kind: str
    at_s: float
    granularity: str | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} {self.granularity}" if self.granularity else self.kind


@dataclass
class Night:
    """What the recorded night did beyond its faults: the figures the simulator is set to, and what it cannot
    re-create."""

    command_s: dict[str, list[float]] = field(default_factory=dict)
    """command kind (`stop_ranks:kill`, `restart_ranks:reset`, ...) -> seconds from the decision to its done ack"""
    ack_s: list[float] = field(default_factory=list)
    """seconds from a decision to its command's accepted ack"""
    restore_s: dict[str, list[float]] = field(default_factory=dict)
    """the slowest tier of a restore -> seconds from `ranks.restoring` to the incident's close"""
    hang_detect_s: list[float] = field(default_factory=list)
    not_ready_s: list[float] = field(default_factory=list)
    """per host that went away: seconds from its ranks' last report (its assumed death) to its node.not_ready"""
    silences: int = 0
    """faults the recorded engine found by a silence, on its watchdog's tick: the simulated job reports and is
    watched as the recorded one was"""
    collective_timeout_s: list[float] = field(default_factory=list)
    failed_commands: list[str] = field(default_factory=list)
    """commands the recorded executors failed or never answered (the simulated ones never fail unless asked)"""
    answers: list[RecordedAnswer] = field(default_factory=list)
    """every command's answer (done, failed or none) by command kind and order: replayed for the simulated engine's
    commands"""
    operator: list[str] = field(default_factory=list)
    """operator commands and job ends the scheduler reported: decisions of people, not faults"""
    unmatched_signals: list[str] = field(default_factory=list)
    """records the recorded engine opened an incident on (or added to one) that no kept fault stands for"""
    decisions: list[RecoveryDecision] = field(default_factory=list)


@dataclass
class RecordedCluster:
    """What the recorded log says about the cluster, the job and its faults."""

    job: str
    spec: dict[str, Any]
    nodes: list[str]
    spares: list[str]
    start: int
    end: int
    step_times: list[float] = field(default_factory=list)
    step_ts: list[int] = field(default_factory=list)
    """when each of `step_times` ended: the steps a straggler slowed are told from the others by it"""
    compute_s: list[float] = field(default_factory=list)
    """the compute times per step the ranks reported (recent ones): their median is a step's compute"""
    ranks_reported: bool = False
    """any rank said anything (a step, a heartbeat, a progress report): else the script is a stock one, without the
    SDK, and the simulated one reports nothing either"""
    storage_steps: list[int] = field(default_factory=list)
    storage_saved_s: list[float] = field(default_factory=list)
    """per persistent checkpoint: seconds from the first report of its step to its `checkpoint.saved`"""
    storage_gap_s: list[float] = field(default_factory=list)
    """per persistent checkpoint: seconds from the first report of its step to the first of the next (a step and
    the checkpoint's stall)"""
    memory_steps: list[int] = field(default_factory=list)
    report_gaps_s: list[float] = field(default_factory=list)
    """seconds between a rank's consecutive reports (steps or heartbeats): the agents' report period"""
    drafts: list[Draft] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)
    resimulated: dict[str, int] = field(default_factory=dict)
    other_jobs: set[str] = field(default_factory=set)
    """jobs of the log the what-if leaves out: the simulator runs one job (their nodes are not in its cluster)"""
    night: Night = field(default_factory=Night)
    history: list[PastEvent] = field(default_factory=list)
    """the node events of the job's nodes and spares before its submission, oldest first"""
    history_left: dict[str, list[str]] = field(default_factory=dict)
    """node -> what the history left on it that its events alone do not re-create (a fault not yet back at the
    submission, a device another job's decision isolated): the simulated nodes join healthy"""
    started: bool = False
    """the job started (`job.started`): a job that never ran has no night to reproduce"""

    @property
    def rpn(self) -> int:
        return int(self.spec["ranks_per_node"])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def faults_of(cluster: RecordedCluster, durations: Durations) -> list[Fault]:
    """The kept faults as the simulator's, at their time since the job started, on the same position of the job
    (or the same spare); a repair the log does not show takes the cost model's mean."""
    spares = {name: len(cluster.nodes) + i for i, name in enumerate(cluster.spares)}
    faults = []
    for draft in sorted(cluster.drafts, key=lambda d: d.at):
        repair = (draft.back - draft.at) if draft.back is not None else {
            "device": durations.device_repair_mean_s, "network": durations.nic_repair_mean_s,
            "node": durations.node_repair_mean_s, "straggler": durations.straggler_mean_s,
        }.get(draft.signal, durations.node_repair_mean_s) * NS
        outage = (draft.back - draft.at) if draft.signal == "network" and draft.back is not None else 0
        node = f"n{spares[draft.node]:05d}" if draft.node in spares else None
        faults.append(Fault(index=len(faults), at_ns=max(0, draft.at - cluster.start), component=draft.source,
                            signal=draft.signal, scope=draft.scope, position=draft.position or 0, device=draft.device,
                            code=draft.code, exit_code=draft.exit_code, exit_signal=draft.exit_signal,
                            exits=tuple(draft.exits), dying=tuple(draft.dying), collective=draft.collective,
                            failed_collective=draft.failed_collective, silent=draft.silent,
                            pool=draft.pool, command=draft.command, slowdown=draft.slowdown,
                            compute_slowdown=draft.compute_slowdown, losses=tuple(draft.losses),
                            recent_losses=draft.recent_losses,
                            outage_ns=int(outage), repair_ns=int(max(repair, NS)), node=node))
    return faults


def history_of(cluster: RecordedCluster) -> tuple[NodeRecord, ...]:
    """The cluster's history as the simulator's, each event on the simulated node of the same position of the job (or
    the same spare), at its time before the job started."""
    names = {name: f"n{i:05d}" for i, name in enumerate(cluster.nodes + cluster.spares)}
    return tuple(NodeRecord(before_ns=max(0, cluster.start - past.ts), node=names[past.node], kind=past.kind,
                            data=tuple(sorted(past.data.items())))
                 for past in cluster.history if past.node in names)

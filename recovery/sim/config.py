"""Configuration of a simulated run: the cluster, the training job, the cost model, the agents' detection delays,
and the policy profile under test.

Every default names its source in README.md (recovery/sim), in the cost-model table. Values we could not find a
public figure for are marked as assumptions there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from events.values import PolicyRef, PolicySelection, Tier
from recovery.sim.answers import RecordedAnswer
from recovery.sim.history import NodeRecord

NS = 1_000_000_000
DAY_S = 86_400.0


@dataclass(frozen=True)
class Cluster:
    """Nodes with devices behind leaf switches, a job placement and a spare pool."""

    gpus: int = 16_384
    """the job's GPUs (one rank per GPU)"""
    gpus_per_node: int = 8
    nodes_per_switch: int = 32
    tp: int = 8
    pp: int = 16
    """Llama 3 405B at 16,384 GPUs: TP 8, PP 16, DP 128 (Llama 3 paper, Table 4)"""
    spare_nodes: int | None = None
    """None: 1/64 of the job's nodes, at least 4 (one leaf switch's worth at 16,384 GPUs)"""
    latent_after_repair: float = 0.0
    """the share of repaired nodes that rejoin with a latent bad device (a repair that did not hold): silent while the
    node is idle, it faults once ranks run on it (`recovery.sim.health`); 0: every repair holds"""
    latent_spares: float = 0.0
    """the share of the initial spares that join with a latent bad device; 0: none"""

    def __post_init__(self) -> None:
        per_replica = self.tp * self.pp
        if self.gpus % self.gpus_per_node or self.gpus % per_replica:
            raise ValueError(f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes and of "
                             f"tp*pp={per_replica} replicas")
        for name in ("latent_after_repair", "latent_spares"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Cluster.{name} is a share, in [0, 1]: {getattr(self, name)}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def shards(self) -> int:
        return self.tp * self.pp

    @property
    def spares(self) -> int:
        if self.spare_nodes is not None:
            return self.spare_nodes
        return max(4, math.ceil(self.nodes / 64))


@dataclass(frozen=True)
class Training:
    """The job's rhythm and its checkpoint cadence per tier."""

    step_time_s: float = 6.0
    """Llama 3 405B: 6 x 405e9 params x 16M tokens per step / (16,384 GPUs x 400 TFLOP/s) = 5.9 s"""
    memory_every_steps: int | None = 25
    """in-memory snapshot (MindIO ACP, Gemini) every k steps; None: no memory tier"""
    storage_every_s: float | None = 1800.0
    """persistent checkpoint every m seconds of training; None: none"""
    params: float = 405e9
    bytes_per_param: float = 14.0
    """checkpointed state: bf16 weights (2) + fp32 master weights, Adam m and v (12) (ZeRO paper's 16 bytes less
    the gradients, which are not saved)"""
    compute_s: float | None = None
    """the ranks' compute time per step (from a step's start to its first collective), where a recorded night's
    agents reported it (`recovery-replay whatif`); None: the whole step, so that a straggler's slowdown is the job's"""
    reports_steps: bool = True
    """the script reports its steps (the SDK); False: a stock script, which reports nothing (a recorded night's job
    that never did): the engine takes its restarted processes as recovered once they ran its grace"""

    def shard_bytes(self, cluster: Cluster) -> float:
        """State held by one rank: the model state split over tp x pp (every data-parallel replica holds it)."""
        return self.params * self.bytes_per_param / cluster.shards


@dataclass(frozen=True)
class Costs:
    """How long executors and checkpoint tiers take. README.md (recovery/sim) has the source of every value."""

    ack_latency_s: float = 0.05
    stop_kill_s: float = 2.0
    stop_graceful_s: float = 10.0
    retry_step_s: float = 10.0
    restart_in_place_s: float = 30.0
    device_reset_s: float = 60.0
    """a GPU reset before an in-place restart (nvidia-smi -r, or the driver's recovery), added to it"""
    migrate_s: float = 70.0
    restart_job_small_s: float = 70.0
    restart_job_large_s: float = 300.0
    large_job_nodes: int = 1000
    isolate_s: float = 1.0
    fail_job_s: float = 1.0
    # checkpoint tiers: per-rank bandwidth (a rank's share of its node's link), aggregate bandwidth, latency
    memory_rank_Bps: float = 50e9
    local_rank_Bps: float = 3e9
    storage_rank_Bps: float = 3.1e9
    storage_read_Bps: float = 2e12
    storage_write_Bps: float = 2e12
    peer_rank_Bps: float = 25e9
    memory_latency_s: float = 2.0
    peer_latency_s: float = 2.0
    local_latency_s: float = 2.0
    storage_latency_s: float = 5.0
    memory_save_stall_s: float = 0.2
    storage_save_stall_s: float = 1.8
    dying_save_s: float | None = None
    """a dying checkpoint's whole save, when measured (`recovery-replay whatif` sets it from the log); None: `save_s`"""
    storage_saved_s: float | None = None
    """a persistent checkpoint's time from its step to `checkpoint.saved` (its stall and its upload), when measured
    (`recovery-replay whatif` sets it from the log); None: the stall and `save_s` of every shard"""
    check_s: float = 0.5
    """one run of a node agent's health checks: 0.5 s for the CPU-only set (memory, disk); a set that can see a bad
    GPU (`gpu-state`, `gpu-compute`) takes ~10 s (an assumption). A faulted node's run starts at the fault, so a
    restart's ranks wait only for what outlasts detection, the stop and any reset (`recovery.sim.health`)"""
    # executors that misbehave
    fail_probability: float = 0.01
    timeout_probability: float = 0.005

    def restart_job_s(self, nodes: int) -> float:
        """A job-level restart recreates every pod: MindCluster's low end for a small job, JobSet KEP-467's
        "several minutes" at 1,000 nodes and above, linear in between."""
        share = min(1.0, nodes / self.large_job_nodes)
        return self.restart_job_small_s + (self.restart_job_large_s - self.restart_job_small_s) * share

    def load_s(self, tier: Tier, ranks: int, shard_bytes: float) -> float:
        """Time for `ranks` ranks to load their shard from `tier` at once: bounded by each rank's link and,
        for shared storage, by the storage system's aggregate read bandwidth."""
        if ranks <= 0:
            return 0.0
        if tier is Tier.MEMORY:
            return self.memory_latency_s + shard_bytes / self.memory_rank_Bps
        if tier is Tier.PEER:  # each restarted rank reads from its own replica: no shared bottleneck
            return self.peer_latency_s + shard_bytes / self.peer_rank_Bps
        if tier is Tier.LOCAL:
            return self.local_latency_s + shard_bytes / self.local_rank_Bps
        return self.storage_latency_s + max(shard_bytes / self.storage_rank_Bps,
                                            ranks * shard_bytes / self.storage_read_Bps)

    def save_s(self, ranks: int, shard_bytes: float) -> float:
        """Time for `ranks` ranks to write their shard to shared storage (a dying checkpoint)."""
        return self.storage_latency_s + max(shard_bytes / self.storage_rank_Bps,
                                            ranks * shard_bytes / self.storage_write_Bps)


@dataclass(frozen=True)
class Agents:
    """Detection delays of the sources that report faults (node agents, probes, the platform)."""

    hang_detect_s: float = 10.0
    """the node agent's local watchdog (ByteRobust detects in 10-30 s; TorchFT heartbeats time out at 5 s)"""
    collective_timeout_s: float = 600.0
    """PyTorch's NCCL default timeout (10 minutes)"""
    node_not_ready_s: float = 40.0
    """Kubernetes node-monitor-grace-period: a node that stops reporting is NotReady after 40 s"""
    link_health_check_s: float = 60.0
    """a link that stays down this long makes the platform's health check mark the node not ready"""
    exit_report_s: float = 0.5
    """a device fault kills the process using the device this long after the XID"""
    health_checks: bool = False
    """the node agents run health checks (`node.checked`): when a node joins, again at once after a device or network
    fault their probes report on it, and in the background on an idle spare; a restart's ranks wait for a run under
    way on their node, and the executor refuses the command when it fails; False: no agent checks (every run before
    issue 47)"""
    check_detects: float = 0.9
    """the chance that one run of the checks sees a given latent bad device (drawn per run); an assumption"""
    check_fresh_s: float = 300.0
    """how long a passing run answers for a node (the agent's `check_fresh_s`): an idle spare runs its checks again
    every half of it, so that a grant finds its pass fresh"""


@dataclass(frozen=True)
class Durations:
    """Outage and repair times of broken hardware (assumptions; see README.md). Repairs only decide when nodes
    return to the spare pool."""

    switch_outage_s: tuple[float, float] = (60.0, 300.0)
    """a leaf switch reboot or a cable flap: links down for a time uniform in this range"""
    device_repair_mean_s: float = 2 * 3600.0
    node_repair_mean_s: float = 24 * 3600.0
    nic_repair_mean_s: float = 12 * 3600.0
    node_return_s: float = 60.0
    """a healthy node the job left is back in the spare pool after the scheduler cleaned it up"""
    latent_work_s: tuple[float, float] = (30.0, 600.0)
    """a latent bad device faults (XID 79 or 48) after a time uniform in this range of the job's training on its node
    (an assumption: within minutes of load, as a burn-in finds such devices)"""
    straggler_mean_s: float = 24 * 3600.0
    """a straggler (a throttled GPU, a host short of CPU) stays slow this long on average unless drained: until
    someone notices the job's pace and has the node looked at (our assumption)"""



@dataclass(frozen=True)
class Profile:
    """A policy selection under test and the checkpoint tiers its job writes."""

    name: str
    selection: PolicySelection
    memory_tier: bool = True


PROFILES: dict[str, Profile] = {
    "default": Profile("default", PolicySelection(), memory_tier=False),
    "default-memory": Profile("default-memory", PolicySelection()),
    "torchelastic-like": Profile("torchelastic-like", PolicySelection(
        detection=PolicyRef(name="torchelastic-like-detection"),
        rescheduling=PolicyRef(name="torchelastic-like-rescheduling"),
        checkpoint=PolicyRef(name="torchelastic-like-checkpoint")), memory_tier=False),
    "mindcluster-like": Profile("mindcluster-like", PolicySelection(
        detection=PolicyRef(name="mindcluster-like-detection"),
        rescheduling=PolicyRef(name="mindcluster-like-rescheduling"),
        checkpoint=PolicyRef(name="mindcluster-like-checkpoint"))),
}
"""Profiles by name. `default` is the built-in selection as shipped, on a job that writes persistent checkpoints
only: restarted ranks take their state from live replicas (or a dying checkpoint), so in-memory snapshots would
pay off only for job-level restarts, and on the Llama 3 mix their stalls cost more than they save (see
recovery/sim/README.md, "Findings"). `default-memory` is the same with in-memory snapshots (MindIO ACP, Gemini), as
`mindcluster-like` has. A torchelastic-like job has no in-memory checkpoints: it resumes from storage."""


def profile(name_or_profile: str | Profile) -> Profile:
    if isinstance(name_or_profile, Profile):
        return name_or_profile
    try:
        return PROFILES[name_or_profile]
    except KeyError:
        raise ValueError(f"unknown profile {name_or_profile!r} (known: {', '.join(PROFILES)})") from None


@dataclass(frozen=True)
class SimConfig:
    """One simulated run."""

    cluster: Cluster = field(default_factory=Cluster)
    training: Training = field(default_factory=Training)
    costs: Costs = field(default_factory=Costs)
    agents: Agents = field(default_factory=Agents)
    durations: Durations = field(default_factory=Durations)
    profile: Profile = field(default_factory=lambda: PROFILES["default"])
    days: float = 54.0
    seed: int = 0
    mix_path: str | None = None
    """fault mix CSV; None: the Llama 3 mix"""
    rate_per_gpu_hour: float | None = None
    """None: the mix's own rate (419 / (16,384 x 54 x 24) for Llama 3)"""
    trace_path: str | None = None
    """a fault trace (recovery.sim.faults.read_trace) instead of the mix"""
    job: str = "llm"
    report_every_s: float | None = None
    """None: training is closed form and the job reports only what changes (the simulator); a period: every live
    rank reports its step (or, stopped, a heartbeat) that often, as a real job's SDK does (the demo)"""
    watchdog_interval_s: float | None = None
    """the job spec's heartbeat watchdog; None: longer than the run (the simulator has no per-rank heartbeats)"""
    elastic: tuple[int, int] | None = None
    """the job's elastic range (min_dp, max_dp), as a recorded job's spec says; None: the job's size is fixed"""
    spare_pool: str | None = None
    """the spare pool the job takes from, as a recorded job's spec says; None: the shared pool"""
    joining: tuple[str, ...] = ()
    """spares that are not in the pool at the start but join when a `join` fault says (a recorded night's nodes that
    joined later); empty: every spare joins at the start"""
    answers: tuple[RecordedAnswer, ...] = ()
    """executors' answers a recorded night shows (done after how long, failed, or none), replayed for the commands of
    the same kind and order (`recovery.sim.answers`); empty: every command is answered as the cost model says"""
    history: tuple[NodeRecord, ...] = ()
    """the node events a recorded cluster's nodes said before the job's submission, oldest first, which the engine
    hears before the job is submitted (`recovery.sim.history`); empty: the cluster has no past"""
    watch_s: float | None = None
    """the job's watchdog ticks this often, each just after every live rank's report of its step and compute time
    (the agents' folded reports, collapsed to one per node per tick): what the detection policy's straggler check
    reads. None: no watchdog and no such reports (the default: cheap at any scale, and a mix without stragglers
    needs neither)"""

    @property
    def horizon_ns(self) -> int:
        return int(self.days * DAY_S * NS)

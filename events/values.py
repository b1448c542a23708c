"""Small value types shared by events, commands and policies."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    StringConstraints,
    model_serializer,
    model_validator,
)

from events.subjects import CONTROL_CHARS, Token

# --- bounds of every number and string on the wire -----------------------------------------------------
# Each type below is defined once and used by events, commands, outputs and policy parameters alike, so a
# bound is stated (and exported to events/wire-schema.json) in one place. Numbers are strict: a JSON `true`
# is not 1, a string "5" or "inf" is not a number, 3.0 is not an integer; floats are finite.

MAX_SAFE_INT = 2**53 - 1
"""the largest integer every JSON reader holds exactly (a JavaScript or jq reader rounds beyond it)"""
MAX_RANKS = 1 << 20
"""ranks of one job (dp * tp * pp), about a million: well above the largest jobs run today (~10^5 accelerators),
and at ~600 B of engine state per rank a job at the bound still fits in memory; it also bounds every rank, shard
index and data-parallel size"""
MAX_DEVICES = 1024
"""accelerators, and ranks, on one node (nodes have 8 or 16 today)"""
MAX_LOG_TIME_NS = 2**62
"""log time (JetStream timestamps, nanoseconds since the epoch) is at most 2^62, the year 2116: log time plus
the longest duration below stays under 2^63, so every due time the engine derives fits a signed 64-bit integer"""
MAX_DUE_NS = 2**63 - 1
"""a due time (log time plus a duration) fits a signed 64-bit integer"""
MIN_INTERVAL_S = 0.001
"""the shortest positive duration: 1 ms, so that no duration rounds to a zero-nanosecond timer"""
MAX_SECONDS = 30 * 86_400.0
"""the longest duration, deadline or window: 30 days, longer than any training job waits for anything"""
MIN_WATCHDOG_S = 0.1
"""the shortest watchdog interval: every tick is a record in the log, so a job cannot flood it with ticks"""
MAX_WATCHDOG_S = 10 * 365 * 86_400.0
"""the longest watchdog interval, 10 years: an interval longer than the job runs turns the heartbeat watchdog off
(the simulator, whose ranks send no heartbeats, sets ten times its run)"""
MAX_ID_LENGTH = 512
"""envelope, command and timer ids: a timer id holds a job id, a node id and a link name (128 each) and the
timer.fired envelope's id wraps it with its due time"""
MAX_NAME_LENGTH = 256

NO_CONTROL_PATTERN = rf"^[^{CONTROL_CHARS}]*$"
"""no C0 control character (NUL included), DEL or C1 control character: ids end up in logs, terminals, NATS
headers and subjects, where a NUL truncates, an escape sequence rewrites the screen, a CR LF splits a header"""
TEXT_CONTROL_CHARS = r"\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f"
TEXT_PATTERN = rf"^[^{TEXT_CONTROL_CHARS}]*$"
"""free text (reasons, messages): as NO_CONTROL_PATTERN, but tab, line feed and carriage return are allowed"""

StrictInt = Annotated[int, Strict()]
"""an integer and nothing else: what outputs the engine computes carry (their bounds are the engine's to keep)"""
Count = Annotated[int, Strict(), Ge(0), Le(MAX_SAFE_INT)]
"""a number of things or events: 0 .. 2^53-1"""
PositiveCount = Annotated[int, Strict(), Ge(1), Le(MAX_SAFE_INT)]
"""a threshold, a number of tries: 1 .. 2^53-1"""
Step = Annotated[int, Strict(), Ge(0), Le(MAX_SAFE_INT)]
"""a training step: 0 .. 2^53-1"""
Attempt = Annotated[int, Strict(), Ge(0), Le(MAX_SAFE_INT)]
"""a job's restart generation: 0 .. 2^53-1"""
Seq = Annotated[int, Strict(), Ge(1), Le(MAX_SAFE_INT)]
"""a log sequence number: 1 .. 2^53-1"""
Rank = Annotated[int, Strict(), Ge(0), Le(MAX_RANKS - 1)]
"""a rank, or a shard index (a shard is a rank of the first replica): 0 .. MAX_RANKS-1"""
Size = Annotated[int, Strict(), Ge(1), Le(MAX_RANKS)]
"""a parallel degree or a number of data-parallel replicas: 1 .. MAX_RANKS"""
Device = Annotated[int, Strict(), Ge(0), Le(MAX_DEVICES - 1)]
"""a device's index on its node: 0 .. MAX_DEVICES-1"""
Devices = Annotated[int, Strict(), Ge(1), Le(MAX_DEVICES)]
"""devices (or ranks) on one node: 1 .. MAX_DEVICES"""
Pid = Annotated[int, Strict(), Ge(0), Le(2**32 - 1)]
"""a process id: an unsigned 32-bit integer holds every operating system's (Linux's are below 2^22)"""
ExitCode = Annotated[int, Strict(), Ge(-(2**31)), Le(2**32 - 1)]
"""a process's exit status: 0..255 on POSIX, -N for signal N (Python), a 32-bit status on Windows"""
SignalNumber = Annotated[int, Strict(), Ge(1), Le(127)]
"""a signal number: 1..64 on Linux; 127 is the largest a 128+N exit status can carry"""
LogTime = Annotated[int, Strict(), Ge(0), Le(MAX_LOG_TIME_NS)]
"""log time, nanoseconds since the epoch: 0 .. 2^62"""
DueTime = Annotated[int, Strict(), Ge(0), Le(MAX_DUE_NS)]
"""a due time, nanoseconds of log time: 0 .. 2^63-1"""
Seconds = Annotated[float, Strict(), AllowInfNan(False), Ge(0), Le(MAX_SECONDS)]
"""a duration that may be zero (no debounce, no grace): 0 .. 30 days"""
Capability = Literal["reform", "save", "checkpoints", "steps", "counts", "stops"]
"""what a rank's script wired up through the SDK: `reform` its process group is formed again in its process after a
peer's restart (`ProcessGroupRecovery`), `save` it writes a dying checkpoint when asked (`Client.on_save`),
`checkpoints` it reports the checkpoints it writes, `steps` it reports its steps, `counts` the step hook counts its
optimizer steps (`recovery.client.steps`: progress and time, from 1 again in each process, not the job's step),
`stops` it reads the agent's graceful stop (`Client.should_stop`), so a stop is asked through the SDK first"""
StopSignal = Literal["SIGTERM", "SIGINT"]
"""the signal a graceful stop sends first: SIGTERM (a scheduler's, a preemption's), SIGINT (Ctrl-C, as torchrun
passes it on)"""
Interval = Annotated[float, Strict(), AllowInfNan(False), Ge(MIN_INTERVAL_S), Le(MAX_SECONDS)]
"""a duration that must pass (a deadline, a window, a silence): 1 ms .. 30 days"""
WatchdogInterval = Annotated[float, Strict(), AllowInfNan(False), Ge(MIN_WATCHDOG_S), Le(MAX_WATCHDOG_S)]
"""the period of a job's heartbeat watchdog: 0.1 s .. 10 years"""
Factor = Annotated[float, Strict(), AllowInfNan(False), Gt(0), Le(1000.0)]
"""a multiple of the job's step time: above 0, at most 1000"""
Loss = Annotated[float, Strict(), AllowInfNan(False)] | Literal["nan", "inf", "-inf"]
"""a training loss: a finite number, or the non-finite value it took as a string (JSON has no NaN)"""
MAX_SKIP = 64
"""data names one bad step may carry (the samples or batches the script names to skip)"""
DataName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_CONTROL_PATTERN)]
"""a sample or batch the script names: 1..128 characters, no control character"""
Flag = Annotated[bool, Strict()]
"""true or false: never 1, 0 or a string"""
Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH, pattern=NO_CONTROL_PATTERN)]
"""an envelope, command or timer id: 1..512 characters, no control character"""
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NO_CONTROL_PATTERN)]
"""a link, collective group, policy or other name: 1..256 characters, no control character"""
LinkName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_CONTROL_PATTERN)]
"""a NIC or port: 1..128 characters (it is part of a debounce timer's id), no control character"""
Label = Annotated[str, StringConstraints(max_length=MAX_NAME_LENGTH, pattern=NO_CONTROL_PATTERN)]
"""a short optional label (a vendor code, a source, an operation): 0..256 characters, no control character"""
Text = Annotated[str, StringConstraints(pattern=TEXT_PATTERN)]
"""free text (a reason, a message): no control character but tab, line feed and carriage return"""


def drop_empty(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """`data` without those of `keys` whose value is empty or None: optional fields added to a wire model later, left
    out where unused so that what was written before them is written the same way."""
    for key in keys:
        if key in data and (data[key] is None or data[key] == []):
            del data[key]
    return data


class Frozen(BaseModel):
    """Base of every wire model: immutable, and unknown fields are an error rather than silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Tier(StrEnum):
    """Where a checkpoint shard lives. Declaration order is the cost order: cheapest to load first."""

    MEMORY = "memory"  # in host memory of a holder node (MindIO ACP, a healthy replica's state)
    PEER = "peer"  # a live data-parallel replica's state, sent over the fabric (TorchFT's live recovery)
    LOCAL = "local"  # on the holder node's local disk
    DYING = "dying"  # written at the fault from a healthy replica (MindIO TTP, ModelArts on SIGTERM)
    STORAGE = "storage"  # persistent shared storage


TIER_COST = {tier: cost for cost, tier in enumerate(Tier)}
STORAGE_HOLDER = "storage"
"""The holder name of a shard on shared storage: reachable whatever nodes are lost."""


class Granularity(StrEnum):
    """How much of a job a recovery attempt restarts, smallest first."""

    RETRY = "retry"  # re-run the failed step; no process restarts
    IN_PLACE = "in_place"  # restart the faulty processes on their own nodes
    MIGRATE = "migrate"  # move the faulty node's ranks to a spare node (pod level)
    RESTART_JOB = "restart_job"  # stop and restart every rank (job level)
    SCALE_IN = "scale_in"  # drop data-parallel replicas and continue smaller (elastic)
    SCALE_OUT = "scale_out"  # add data-parallel replicas when nodes return (elastic; never a ladder rung)
    DUMP = "dump"  # save what can be saved and stop: the job waits for an operator
    FAIL = "fail"  # give up


class FaultClass(StrEnum):
    DEVICE = "device"
    PROCESS = "process"
    NETWORK = "network"
    NODE = "node"
    HANG = "hang"
    PREEMPTION = "preemption"  # the platform asked the job to stop (SIGTERM, drain): not a failure of it
    BAD_STEP = "bad_step"  # a NaN/inf or spiking loss (a bad batch, silent data corruption): the state is poisoned


class Layout(Frozen):
    """Parallel layout. Rank order is tensor-parallel fastest, then pipeline, then data parallel."""

    dp: Size = Field(description="data-parallel replicas, or with `fsdp` data-parallel ranks that shard the state")
    tp: Size = Field(1, description="tensor-parallel degree")
    pp: Size = Field(1, description="pipeline-parallel degree")
    fsdp: bool = Field(False, description="the data-parallel ranks shard the model state among them (FSDP on a 1-D "
                                          "mesh, ZeRO-3) instead of each holding a replica: every rank holds a "
                                          "shard of its own, and a scale of `dp` reshards the state onto the new "
                                          "ranks")

    @model_serializer(mode="wrap")
    def _without_default_fsdp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A layout without `fsdp` is written as before the field existed: old logs replay to the same bytes.
        data = handler(self)
        if not data.get("fsdp"):
            data.pop("fsdp", None)
        return data

    @model_validator(mode="after")
    def _bounded(self) -> Layout:
        # Each degree is bounded, their product must be too: the engine keeps state for every rank.
        if self.world > MAX_RANKS:
            raise ValueError(f"layout dp*tp*pp = {self.world} ranks exceeds {MAX_RANKS}")
        return self

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shards(self) -> int:
        """Distinct model-state shards: one per (pipeline, tensor) coordinate, or one per rank with `fsdp`."""
        return self.world if self.fsdp else self.tp * self.pp

    @property
    def per_replica(self) -> int:
        """Ranks of one data-parallel coordinate (tp x pp): what a scale of `dp` adds or takes away at a time."""
        return self.tp * self.pp

    def scaled(self, dp: int) -> Layout:
        """The same layout at `dp` data-parallel coordinates (an elastic scale)."""
        return Layout(dp=dp, tp=self.tp, pp=self.pp, fsdp=self.fsdp)

    def shard_of(self, rank: int) -> int:
        return rank % self.shards

    def replica_of(self, rank: int) -> int:
        return rank // self.shards


def shards_at(shard_counts: tuple[tuple[int, int], ...], step: int, layout: Layout) -> int:
    """The shards a checkpoint of `step` is whole in: for a job a scale resharded (`shard_counts`, the first step
    and the shards of each world it trained in, oldest first), those of the world that trained the step; else the
    layout's."""
    for first, shards in reversed(shard_counts):
        if step >= first:
            return shards
    return layout.shards


class Elastic(Frozen):
    min_dp: Size
    max_dp: Size

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_dp > self.max_dp:
            raise ValueError(f"elastic min_dp {self.min_dp} is above max_dp {self.max_dp}")
        return self


class PolicyRef(Frozen):
    """A policy chosen by its entry-point name, with its parameters (validated by the policy)."""

    name: Name
    params: dict[str, Any] = Field(default_factory=dict)


class PolicySelection(Frozen):
    detection: PolicyRef = PolicyRef(name="default")
    rescheduling: PolicyRef = PolicyRef(name="ladder")
    checkpoint: PolicyRef = PolicyRef(name="newest-complete")


MAX_ARGS = 1024
"""arguments of an entrypoint, and variables of its environment"""
MAX_ARG_LENGTH = 4096
"""one argument, path or environment value: PATH_MAX on Linux"""
Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_LENGTH, pattern=NO_CONTROL_PATTERN)]
"""a command-line argument, a path or an environment value: 0..4096 characters, no control character"""
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH,
                                           pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""an environment variable's name, as POSIX shells accept it"""


class Entrypoint(Frozen):
    """What a node agent runs for each rank placed on its node, with torchrun's environment added."""

    command: Annotated[Arg, StringConstraints(min_length=1)] = Field(
        description="the program, a path or a name looked up in the agent's PATH")
    args: list[Arg] = Field(default_factory=list, max_length=MAX_ARGS)
    cwd: Arg | None = Field(None, description="working directory; null: the agent's own")
    env: dict[EnvName, Arg] = Field(default_factory=dict, max_length=MAX_ARGS,
                                    description="added to the agent's environment, beneath the variables the "
                                                "agent sets for the rank")
    rendezvous: Literal["agent", "external"] = Field(
        "agent", description="who serves the job's rendezvous store at MASTER_ADDR:MASTER_PORT: 'agent', the agent "
                             "of the job's first node (lost with that node); 'external', a store the platform runs "
                             "off the training nodes (`python -m recovery.agent.rendezvous --serve`), which outlives "
                             "the loss of any node")

    @model_serializer(mode="wrap")
    def _without_default_rendezvous(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An entrypoint with the default store is written as before the field existed, so logs stay byte for byte.
        data: dict[str, Any] = handler(self)
        if data.get("rendezvous") == "agent":
            del data["rendezvous"]
        return data


class SchedulerJob(Frozen):
    """The scheduler's own job that a recovery job runs in: what an executor of that scheduler acts on when the
    engine's answer is the scheduler's to carry out (a Slurm allocation requeued when it lost a node that no spare
    replaces). The engine never reads it."""

    scheduler: Literal["slurm"]
    id: Token = Field(description="the scheduler's job id (Slurm: SLURM_JOB_ID)")
    restarts: Count = Field(0, description="how often the scheduler had restarted that job when this recovery job "
                                           "was submitted (Slurm: SLURM_RESTART_COUNT): an executor acts on the run "
                                           "it names, never on a later one")


class JobSpec(Frozen):
    nodes: list[Token] = Field(min_length=1, description="placement: rank r runs on nodes[r // ranks_per_node]")
    ranks_per_node: Devices
    layout: Layout
    spares: int | None = Field(None, ge=0, le=MAX_RANKS, strict=True,
                               description="spare nodes from the shared pool this job may hold at once beyond its own "
                                           "placement (a quota, so that one job cannot take every spare while "
                                           "another waits); null: as many as are free")
    spare_pool: Token | None = Field(None, description="the pool of spares this job may take (nodes whose agent "
                                                       "joined with that `pool`): a pool kept for some jobs, such as "
                                                       "the nodes an elastic job grows onto; null: the shared pool")
    elastic: Elastic | None = None
    policies: PolicySelection = PolicySelection()
    max_restarts: Count | None = Field(None, description="restart budget over the job's life, any rung")
    watchdog_interval_s: WatchdogInterval = Field(
        2.0, description=f"how often the engine checks heartbeats: {MIN_WATCHDOG_S:g} s .. {MAX_WATCHDOG_S:g} s "
                         "(10 years; an interval longer than the job runs turns the watchdog off)")
    entrypoint: Entrypoint | None = Field(None, description="what node agents launch for each rank; null: the "
                                                            "ranks are started by something else (a scheduler)")
    scheduler_job: SchedulerJob | None = Field(None, description="the scheduler's job this one runs in (a Slurm "
                                                                 "allocation); null: none")

    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A spec without an entrypoint or a scheduler job is written as before those fields existed, so logs stay
        # byte for byte.
        data: dict[str, Any] = handler(self)
        if data.get("entrypoint", ...) is None:
            del data["entrypoint"]
        if data.get("scheduler_job", ...) is None:
            del data["scheduler_job"]
        if data.get("spare_pool", ...) is None:
            del data["spare_pool"]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        slots = len(self.nodes) * self.ranks_per_node
        if slots != self.layout.world:
            raise ValueError(
                f"layout dp*tp*pp = {self.layout.world} ranks but {len(self.nodes)} nodes x "
                f"{self.ranks_per_node} ranks per node = {slots}"
            )
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("a node appears twice in the placement")
        if self.elastic is not None and not self.elastic.min_dp <= self.layout.dp <= self.elastic.max_dp:
            raise ValueError(f"layout dp {self.layout.dp} is outside elastic [{self.elastic.min_dp}, "
                             f"{self.elastic.max_dp}]")
        if self.elastic is not None and self.elastic.max_dp * self.layout.per_replica > MAX_RANKS:
            # Scaling out to max_dp must give a layout the wire accepts, or the scale-out itself would fail.
            raise ValueError(f"elastic max_dp {self.elastic.max_dp} x tp*pp {self.layout.per_replica} ranks exceeds "
                             f"{MAX_RANKS}")
        return self


class RankSource(Frozen):
    rank: Rank
    tier: Tier
    holder: str


class ShardSource(Frozen):
    """Where one shard of the model state is read from: a tier and the holders that have it."""

    shard: Rank
    tier: Tier
    holders: list[str] = Field(min_length=1, description="reachable holders, sorted")


class ResumePlan(Frozen):
    """Where a restarted job resumes: the checkpoint step and, for every shard, where its state comes from.

    Kept per shard, not per rank, so that a plan for 16,384 ranks stays a few kilobytes: every data-parallel
    replica of a shard reads the same source, from the holder on its own node when there is one."""

    checkpoint_step: Step | None = Field(description="None: no usable checkpoint, start from the beginning")
    next_step: Step
    shards: list[ShardSource] = Field(default_factory=list)
    skip_steps: list[Step] = Field(default_factory=list, max_length=4096,
                                   description="steps whose data the script skips: bad steps rolled back, whose "
                                               "script named no data of its own")
    skip_data: list[DataName] = Field(default_factory=list, max_length=4096,
                                      description="samples or batches the script named for its bad steps: skip them")

    @model_serializer(mode="wrap")
    def _without_empty_skips(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Most plans skip nothing: they stay as they were on the wire, so the logs written before bad steps were
        # rolled back replay to the same commands.
        return drop_empty(handler(self), "skip_steps", "skip_data")

    def source_of(self, rank: int, node: str) -> RankSource | None:
        """The source of `rank`, placed on `node` (rank r holds shard r mod the number of shards)."""
        if not self.shards:
            return None
        shard = self.shards[rank % len(self.shards)]
        holder = node if node in shard.holders else shard.holders[0]
        return RankSource(rank=rank, tier=shard.tier, holder=holder)

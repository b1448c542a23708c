"""Every kind of input event, by the `type` that names it on the wire.

Job-scoped events arrive on `recovery.ev.job.<job>.<type>`, node-scoped ones (a device or link probe
does not know which job uses the node) on `recovery.ev.node.<node>.<type>`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from events.subjects import Token
from events.values import Frozen, Granularity, JobSpec, Tier

Rank = int


# --- device (node-scoped) ---------------------------------------------------------------------------
class DeviceFault(Frozen):
    """A device reported an error: an NVIDIA XID, an Ascend fault code, or ECC counters."""

    device: int = Field(ge=0, description="local device index on the node")
    vendor: Literal["nvidia", "ascend", "other"]
    code: str = Field(description="vendor code: XID number ('79') or Ascend fault code ('0x80E01801')")
    ecc_sbe: int = Field(0, ge=0, description="single-bit ECC errors since the last report")
    ecc_dbe: int = Field(0, ge=0, description="double-bit ECC errors since the last report")
    severity: Literal["info", "warning", "error", "critical"] | None = None
    message: str = ""


class DeviceRecovered(Frozen):
    device: int = Field(ge=0)


# --- process (job-scoped) ---------------------------------------------------------------------------
class ProcessStarted(Frozen):
    rank: Rank = Field(ge=0)
    pid: int = Field(ge=0)
    attempt: int = Field(0, ge=0, description="the job's restart generation the process belongs to")


class ProcessExited(Frozen):
    rank: Rank = Field(ge=0)
    exit_code: int | None = None
    signal: int | None = Field(None, ge=1, description="the signal that ended the process, if any")
    attempt: int = Field(0, ge=0)


class Heartbeat(Frozen):
    rank: Rank = Field(ge=0)
    step: int | None = Field(None, ge=0, description="last completed step, if the process knows it")
    attempt: int = Field(0, ge=0)


class HangReport(Frozen):
    """The node agent's own watchdog saw no progress from a local process."""

    rank: Rank = Field(ge=0)
    seconds_without_progress: float = Field(ge=0)
    attempt: int = Field(0, ge=0)


class StepReported(Frozen):
    rank: Rank = Field(ge=0)
    step: int = Field(ge=0)
    attempt: int = Field(0, ge=0)


# --- network ----------------------------------------------------------------------------------------
class LinkDown(Frozen):
    link: str = Field(description="NIC or port, for example 'mlx5_0' or 'hccs3'")
    switch: str | None = None


class LinkUp(Frozen):
    link: str


class NicErrors(Frozen):
    link: str
    errors: int = Field(ge=1)


class CollectiveTimeout(Frozen):
    """A collective did not finish: `reporters` timed out waiting on the other `members` of `group`."""

    group: str
    members: list[Rank] = Field(min_length=1)
    reporters: list[Rank] = Field(min_length=1)
    operation: str = "allreduce"
    timeout_s: float = Field(0, ge=0)
    attempt: int = Field(0, ge=0, description="the reporters' restart generation")


# --- node (node-scoped) -----------------------------------------------------------------------------
class NodeNotReady(Frozen):
    reason: str = ""


class NodeReady(Frozen):
    pass


class NodeDrained(Frozen):
    """The platform takes the node away (maintenance, preemption): its ranks must leave it."""

    reason: str = ""


class NodeJoined(Frozen):
    spare: bool = True
    devices: int = Field(8, ge=1)


# --- job lifecycle ----------------------------------------------------------------------------------
class JobSubmitted(Frozen):
    spec: JobSpec


class JobStarted(Frozen):
    pass


class JobCompleted(Frozen):
    pass


class JobCancelled(Frozen):
    reason: str = ""


# --- checkpoints ------------------------------------------------------------------------------------
class CheckpointSaved(Frozen):
    """Shards of the model state at `step` are available in `tier` on `holder` (a node, or 'storage')."""

    step: int = Field(ge=0)
    tier: Tier
    shards: list[int] = Field(min_length=1, description="shard indices (pipeline x tensor coordinate)")
    holder: Token

    @field_validator("tier")
    @classmethod
    def _saved_tier(cls, tier: Tier) -> Tier:
        if tier is Tier.PEER:
            raise ValueError("'peer' names live replicas in a resume plan, not a tier a checkpoint is saved in")
        return tier


class CheckpointFailed(Frozen):
    step: int = Field(ge=0)
    tier: Tier
    reason: str = ""


# --- executors, timers, operators -------------------------------------------------------------------
class CommandAck(Frozen):
    command_id: str
    status: Literal["accepted", "done", "failed"]
    reason: str = ""
    result: dict[str, Any] = Field(default_factory=dict)


class TimerFired(Frozen):
    timer_id: str
    due: int = Field(description="the due time the timer was asked for, nanoseconds of log time")


class OperatorScale(Frozen):
    dp: int = Field(ge=1)


class OperatorPause(Frozen):
    reason: str = ""


class OperatorResume(Frozen):
    pass


class OperatorCancel(Frozen):
    reason: str = ""


class OperatorForce(Frozen):
    """Start a recovery attempt of this granularity now, ending the one under way."""

    granularity: Granularity
    reason: str = ""


JOB_EVENTS: dict[str, type[Frozen]] = {
    "process.started": ProcessStarted,
    "process.exited": ProcessExited,
    "process.heartbeat": Heartbeat,
    "process.hang": HangReport,
    "progress.step": StepReported,
    "network.collective_timeout": CollectiveTimeout,
    "job.submitted": JobSubmitted,
    "job.started": JobStarted,
    "job.completed": JobCompleted,
    "job.cancelled": JobCancelled,
    "checkpoint.saved": CheckpointSaved,
    "checkpoint.failed": CheckpointFailed,
    "command.ack": CommandAck,
    "timer.fired": TimerFired,
    "operator.scale": OperatorScale,
    "operator.pause": OperatorPause,
    "operator.resume": OperatorResume,
    "operator.cancel": OperatorCancel,
    "operator.force": OperatorForce,
}
"""Event types that concern one job: the envelope carries `job`."""

NODE_EVENTS: dict[str, type[Frozen]] = {
    "device.fault": DeviceFault,
    "device.recovered": DeviceRecovered,
    "network.link_down": LinkDown,
    "network.link_up": LinkUp,
    "network.nic_errors": NicErrors,
    "node.not_ready": NodeNotReady,
    "node.ready": NodeReady,
    "node.drained": NodeDrained,
    "node.joined": NodeJoined,
}
"""Event types that concern one node: the envelope carries `node`."""

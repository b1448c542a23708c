"""Commands the engine sends to executors (node agents, scheduler adapters).

A command's id is deterministic, `<job>:<causing seq>:<index>`, and is sent as `Nats-Msg-Id`, so a
daemon that reprocesses a record after a crash republishes the same ids and JetStream drops them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from events.subjects import Token
from events.values import Frozen, ResumePlan


class CommandBase(Frozen):
    id: str
    job: Token
    attempt: int = Field(description="the job's restart generation this command belongs to")
    deadline_s: float = Field(description="ack with status done within this many seconds or the engine escalates")


class StopRanks(CommandBase):
    kind: Literal["stop_ranks"] = "stop_ranks"
    ranks: list[int]
    mode: Literal["graceful", "kill"] = "graceful"
    grace_s: float = 30.0


class SaveCheckpoint(CommandBase):
    """Save a dying checkpoint: each listed rank writes the shard it holds, at its current step."""

    kind: Literal["save_checkpoint"] = "save_checkpoint"
    ranks: list[int]
    step: int


class RetryStep(CommandBase):
    kind: Literal["retry_step"] = "retry_step"
    step: int


class RestartRanks(CommandBase):
    """Restart these ranks' processes on their own nodes; every rank rolls back to the plan's step."""

    kind: Literal["restart_ranks"] = "restart_ranks"
    ranks: list[int]
    plan: ResumePlan


class MigrateRanks(CommandBase):
    """Move the ranks of `from_node` to `to_node` (pod-level rescheduling); other nodes keep running."""

    kind: Literal["migrate_ranks"] = "migrate_ranks"
    ranks: list[int]
    from_node: Token
    to_node: Token
    plan: ResumePlan


class RestartJob(CommandBase):
    kind: Literal["restart_job"] = "restart_job"
    nodes: list[Token]
    plan: ResumePlan


class ScaleJob(CommandBase):
    kind: Literal["scale_job"] = "scale_job"
    dp: int
    nodes: list[Token]
    plan: ResumePlan


class IsolateNode(CommandBase):
    kind: Literal["isolate_node"] = "isolate_node"
    node: Token
    reason: str


class IsolateDevice(CommandBase):
    kind: Literal["isolate_device"] = "isolate_device"
    node: Token
    device: int
    reason: str


class FailJob(CommandBase):
    kind: Literal["fail_job"] = "fail_job"
    reason: str


Command = Annotated[
    StopRanks | SaveCheckpoint | RetryStep | RestartRanks | MigrateRanks | RestartJob | ScaleJob
    | IsolateNode | IsolateDevice | FailJob,
    Field(discriminator="kind"),
]

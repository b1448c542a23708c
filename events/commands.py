"""Commands the engine sends to executors (node agents, scheduler adapters).

A command's id is deterministic, `<job>:<causing seq>:<index>`, and is sent as `Nats-Msg-Id`, so a
daemon that reprocesses a record after a crash republishes the same ids and JetStream drops them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from events.subjects import Token
from events.values import (
    Attempt,
    Device,
    Frozen,
    Id,
    Interval,
    Rank,
    ResumePlan,
    Seconds,
    Size,
    Step,
    StopSignal,
)


class CommandBase(Frozen):
    id: Id
    job: Token
    attempt: Attempt = Field(description="the job's restart generation this command belongs to")
    deadline_s: Interval = Field(description="ack with status done within this many seconds or the engine "
                                             "escalates: 1 ms .. 30 days")


class StopRanks(CommandBase):
    kind: Literal["stop_ranks"] = "stop_ranks"
    ranks: list[Rank]
    mode: Literal["graceful", "kill"] = "graceful"
    grace_s: Seconds = Field(30.0, description="how long a graceful stop may take before the kill: 0 .. 30 days")
    signal: StopSignal = Field("SIGTERM", description="what a graceful stop sends a rank first (after the SDK's stop "
                                                      "where the rank has one): SIGTERM, or SIGINT as Ctrl-C does")
    stuck: Literal["wait", "kill"] = Field("wait", description="what a graceful stop does with a rank that cannot run "
                                                            "a signal handler (stopped, or waiting in a collective, "
                                                            "as its stack shows): `kill` it at once (a stop after a "
                                                            "fault: its collective waits on a rank the fault took), "
                                                            "or `wait` the grace for it")

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A stop that sends SIGTERM and waits for every rank is written as before either could be chosen, so logs
        # stay byte for byte.
        data: dict[str, Any] = handler(self)
        if data.get("signal") == "SIGTERM":
            del data["signal"]
        if data.get("stuck") == "wait":
            del data["stuck"]
        return data


class SaveCheckpoint(CommandBase):
    """Save a dying checkpoint: each listed rank writes the shard it holds, at its current step."""

    kind: Literal["save_checkpoint"] = "save_checkpoint"
    ranks: list[Rank]
    step: Step


class RetryStep(CommandBase):
    kind: Literal["retry_step"] = "retry_step"
    step: Step


class RestartRanks(CommandBase):
    """Restart these ranks' processes on their own nodes; every rank rolls back to the plan's step."""

    kind: Literal["restart_ranks"] = "restart_ranks"
    ranks: list[Rank]
    plan: ResumePlan
    reset_devices: dict[Token, list[Device]] = Field(default_factory=dict)
    """devices to reset before the restart, by node: what a double-bit ECC error (XID 48) needs when no spare
    node came to move the ranks to"""


class MigrateRanks(CommandBase):
    """Move the ranks of `from_node` to `to_node` (pod-level rescheduling); other nodes keep running."""

    kind: Literal["migrate_ranks"] = "migrate_ranks"
    ranks: list[Rank]
    from_node: Token
    to_node: Token
    plan: ResumePlan


class RestartJob(CommandBase):
    kind: Literal["restart_job"] = "restart_job"
    nodes: list[Token]
    plan: ResumePlan


class ScaleJob(CommandBase):
    """Run the job at data-parallel size `dp` on `nodes` (rank r on nodes[r // ranks_per_node]). The ranks in `kept`
    are processes that live on: the survivor on the same node with the same local rank re-forms its process group in
    this generation as that rank (the SDK reads the new world from the job store); every other rank of the new
    placement starts anew, and the processes of the job on a node outside it end."""

    kind: Literal["scale_job"] = "scale_job"
    dp: Size
    nodes: list[Token]
    plan: ResumePlan
    kept: list[Rank] = Field(default_factory=list,
                             description="ranks of the new placement whose processes live on (survivors re-forming "
                                         "in-process); empty: all start anew")

    @model_serializer(mode="wrap")
    def _without_empty_kept(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A scale that keeps no process is written as before survivors were kept, so logs stay byte for byte.
        data: dict[str, Any] = handler(self)
        if not data.get("kept", True):
            del data["kept"]
        return data


class IsolateNode(CommandBase):
    kind: Literal["isolate_node"] = "isolate_node"
    node: Token
    reason: str


class IsolateDevice(CommandBase):
    kind: Literal["isolate_device"] = "isolate_device"
    node: Token
    device: Device
    reason: str


class FailJob(CommandBase):
    kind: Literal["fail_job"] = "fail_job"
    reason: str


class DumpStacks(CommandBase):
    """Capture the Python stack of each of the job's processes on the node (all of them: a hang is found by
    comparing them) and report them as `process.stacks`, before anything kills them. Sent with the decision that
    confirms a hang; the engine waits for no ack (the stop that follows is the agent's to hold back meanwhile)."""

    kind: Literal["dump_stacks"] = "dump_stacks"
    reason: str


Command = Annotated[
    StopRanks | SaveCheckpoint | RetryStep | RestartRanks | MigrateRanks | RestartJob | ScaleJob
    | IsolateNode | IsolateDevice | FailJob | DumpStacks,
    Field(discriminator="kind"),
]

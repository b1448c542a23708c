"""Every kind of input event, by the `type` that names it on the wire.

Job-scoped events arrive on `recovery.ev.job.<job>.<type>`, node-scoped ones (a device or link probe
does not know which job uses the node) on `recovery.ev.node.<node>.<type>`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from events.health import NodeChecked
from events.subjects import Token
from events.values import (
    MAX_SKIP,
    Attempt,
    Capability,
    Count,
    DataName,
    Device,
    Devices,
    DueTime,
    ExitCode,
    Flag,
    Frozen,
    Granularity,
    Id,
    JobSpec,
    Label,
    LinkName,
    Loss,
    Name,
    Pid,
    PositiveCount,
    Rank,
    Seconds,
    Seq,
    SignalNumber,
    Size,
    Step,
    StopSignal,
    Text,
    Tier,
    drop_empty,
)


# --- device (node-scoped) ---------------------------------------------------------------------------
class DeviceFault(Frozen):
    """A device reported an error: an NVIDIA XID, an Ascend fault code, or ECC counters."""

    device: Device = Field(description="local device index on the node")
    vendor: Literal["nvidia", "ascend", "other"]
    code: Label = Field(description="vendor code: XID number ('79') or Ascend fault code ('0x80E01801')")
    ecc_sbe: Count = Field(0, description="single-bit ECC errors since the last report")
    ecc_dbe: Count = Field(0, description="double-bit ECC errors since the last report")
    severity: Literal["info", "warning", "error", "critical"] | None = None
    message: Text = ""


class DeviceRecovered(Frozen):
    device: Device


# --- process (job-scoped) ---------------------------------------------------------------------------
class ProcessStarted(Frozen):
    rank: Rank
    pid: Pid
    attempt: Attempt = Field(0, description="the job's restart generation the process belongs to")
    announces: Flag = Field(False, description="its agent relays what the process's SDK says it can do "
                                               "(`process.capabilities`): none until it says; false (an older "
                                               "agent): a rank that reports through the SDK is taken to do all")


class ProcessCapabilities(Frozen):
    """What a rank's script wired up through the SDK (`Capability`), as the SDK announces it when it connects and
    again whenever it grows (a `ProcessGroupRecovery` made, a save handler registered, a first step reported). The
    engine restarts a rank alone (its survivors re-forming in process) only of a job whose ranks said `reform`, and
    asks a dying checkpoint only of one whose ranks said `save`; step reports alone change how a fault is found and
    timed, never how much restarts."""

    rank: Rank
    attempt: Attempt = Field(0, description="the job's restart generation the process belongs to")
    caps: list[Capability] = Field(default_factory=list, max_length=8)


class ProcessOutput(Frozen):
    """A rank's process wrote its first output (a line of its standard output or error), as its agent saw the file
    grow: for a script that reports nothing to the control plane (no SDK), the first sign after a start that it runs
    its own code. Sent once per process, and only while the rank has not connected through the SDK (whose steps say
    more). The engine decides nothing from it: the postmortem measures a stock script's restart with it."""

    rank: Rank
    attempt: Attempt = Field(0, description="the job's restart generation the process belongs to")


MAX_ERROR_MESSAGE = 1024
"""characters of a script's error message an exit carries: enough for the line a user needs, not a whole traceback"""


class ScriptError(Frozen):
    """Why a rank's script failed, as it said so itself: the exception its `@record` wrote to its error file
    (`TORCHELASTIC_ERROR_FILE`, torchrun's contract), else the last error line of its output."""

    type: Label = Field("", description="the exception's type, `ValueError` (empty: its output named none)")
    message: Text = Field("", max_length=MAX_ERROR_MESSAGE, description="the exception's message, or the line")
    place: Label = Field("", description="where it was raised: `train.py:42 in main` (empty: not known)")
    source: Literal["error_file", "output"] = Field("error_file", description="where the agent read it")

    def summary(self) -> str:
        """One line for a decision, a report, `recovery-run`: `ValueError: bad lr (train.py:42 in main)`."""
        what = f"{self.type}: {self.message}" if self.type else self.message
        return f"{what} ({self.place})" if self.place else what


class ProcessExited(Frozen):
    rank: Rank
    exit_code: ExitCode | None = None
    signal: SignalNumber | None = Field(None, description="the signal that ended the process, if any")
    attempt: Attempt = 0
    error: ScriptError | None = Field(None, description="the script's own error, if it left one (a failed exit)")

    @model_serializer(mode="wrap")
    def _omit_no_error(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Added later: an exit without one is written as before, so that older logs keep their bytes.
        return drop_empty(handler(self), "error")


class Heartbeat(Frozen):
    rank: Rank
    step: Step | None = Field(None, description="last completed step, if the process knows it")
    attempt: Attempt = 0


class HangReport(Frozen):
    """The node agent's own watchdog saw no progress from a local process."""

    rank: Rank
    seconds_without_progress: Seconds = Field(description="0 .. 30 days")
    attempt: Attempt = 0
    cause: Text = Field("", max_length=1024, description="what the agent saw: the SDK's silence (empty), a stopped "
                                                         "process, a still one")

    @model_serializer(mode="wrap")
    def _omit_no_cause(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not data.get("cause"):
            data.pop("cause", None)  # added later: a report without one is written as before
        return data


class _OmitsUnmeasured(Frozen):
    """Leaves a compute time out of its wire form when none was measured: most scripts measure none, and a step
    report is the commonest event, so the field costs them nothing (and older logs keep their bytes)."""

    @model_serializer(mode="wrap")
    def _omit_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unmeasured(handler(self))


def _without_unmeasured(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("compute_s", 0) is None:
        del data["compute_s"]
        data.pop("compute_steps", None)
    return data


class StepReported(_OmitsUnmeasured):
    rank: Rank
    step: Step
    attempt: Attempt = 0
    compute_s: Seconds | None = Field(None, description="the step's compute time as the SDK measured it: from the "
                                                        "step's start to its first collective, 0 .. 30 days")
    loss: Loss | None = Field(None, description="the step's training loss, if the script reported it")
    skip: list[DataName] = Field(default_factory=list, max_length=MAX_SKIP,
                                 description="the samples or batches the script names for the step: what a "
                                             "roll-back skips should the step be bad (none: the step's own batch)")

    @model_serializer(mode="wrap")
    def _omit_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_empty(_without_unmeasured(handler(self)), "loss", "skip")


class CollectiveFailed(Frozen):
    """A rank's collective timed out while the rank lives (the SDK's report, relayed by its agent): the process group
    of generation `attempt` is unusable, and the rank waits in its own process for the next generation. A dead peer
    is not reported this way (its exit is the fault): only a timeout, where nothing tells which peer is to blame."""

    rank: Rank
    step: Step = Field(description="the step the collective belonged to: the step trained when it failed")
    attempt: Attempt = Field(0, description="the generation of the process group whose collective failed")
    operation: Label = "allreduce"
    timeout_s: Seconds = Field(0, description="the group's timeout, 0 .. 30 days (0: not reported)")
    error: Text = Field("", max_length=1024, description="the collective's error, as the backend raised it")


MAX_STACK_CHARS = 16_384
"""of one process's stack in `process.stacks`: the innermost frames are kept, the rest cut (a deep recursion's
stack would otherwise fill the log and go past NATS's message size with a node's 8 ranks)"""


class RankStack(Frozen):
    """One process's stack as a dump tool printed it (py-spy: its threads, innermost frame first), or why none."""

    rank: Rank
    pid: Pid | None = None
    stack: Text = Field("", max_length=MAX_STACK_CHARS)
    error: Text = Field("", max_length=1024, description="why no stack was taken: the tool missing, refused, slow")


class ProcessStacks(Frozen):
    """The stacks of a job's processes on one node, taken before a suspected hang is acted on (`dump_stacks`)."""

    ranks: list[RankStack] = Field(max_length=4096)
    command_id: Id | None = None
    tool: Label = ""


MAX_REPORTED_RANKS = 4096
"""ranks one progress report may cover: a node's (a few to a few hundred), with room"""


class RankProgress(_OmitsUnmeasured):
    """One rank in a `progress.report`: it lives, at `step` if it reported one, in generation `attempt`."""

    rank: Rank
    step: Step | None = Field(None, description="the newest step it completed in the period, if any")
    attempt: Attempt = 0
    compute_s: Seconds | None = Field(None, description="mean compute time of its `compute_steps` steps in the "
                                                        "period (from a step's start to its first collective: in "
                                                        "synchronous data parallelism the wall step time is every "
                                                        "rank's alike), 0 .. 30 days")
    compute_steps: Count = Field(0, description="the steps `compute_s` is the mean of")
    loss: Loss | None = Field(None, description="the worst loss it reported in the period (a non-finite one first, "
                                                "else the highest), if any")
    loss_step: Step | None = Field(None, description="the step of `loss`")
    skip: list[DataName] = Field(default_factory=list, max_length=MAX_SKIP,
                                 description="the samples or batches the script named for `loss_step`")

    @model_serializer(mode="wrap")
    def _omit_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_empty(_without_unmeasured(handler(self)), "loss", "loss_step", "skip")


class ProgressReport(Frozen):
    """A node agent's ranks of one job over one period, folded into one event: each rank that spoke (a heartbeat, a
    step) with the newest it said, in the order the agent heard them. Applied as each rank's heartbeat and step
    would be; a rank absent from it said nothing in the period. Changes (a start, an exit, a checkpoint) still
    travel on their own, after the report that precedes them."""

    ranks: list[RankProgress] = Field(min_length=1, max_length=MAX_REPORTED_RANKS)



class SummarizedRank(RankProgress):
    """One rank in a `progress.summary`: its newest word that the daemon heard in the summary's period, and how long
    before the record it heard it."""

    heard_s: Seconds = Field(0.0, description="how long before the record the daemon last heard the rank (its "
                                              "node's report), by the daemon's clock: the engine takes the rank as "
                                              "seen then, not at the record")


MAX_SUMMARIZED_RANKS = 16384
"""ranks one progress summary may cover: a job's, in several records where it has more (each under NATS's payload
limit)"""


class ProgressSummary(Frozen):
    """What the daemon heard of one job's ranks over one period of `progress_summary_s`, from the agents' reports that
    went over core NATS (`progress = "summary"`): each rank's newest word, applied as a `progress.report`'s entry
    would be, seen `heard_s` before the record. Never refused for its content: an entry older than what the engine
    holds of its rank (a report the agent sent to the log since), of a rank or generation the job no longer has, or a
    step below the rank's, is left out, as the summary of a past moment."""

    ranks: list[SummarizedRank] = Field(min_length=1, max_length=MAX_SUMMARIZED_RANKS)
    period_s: Seconds = Field(description="the period the summary covers")
    watch: bool = Field(False, description="the job's watchdog ticks at this record: the engine checks the job here, "
                                           "as at a tick, and moves its watchdog's next tick to an interval past "
                                           "when the check could first find anything, or to a period and an "
                                           "interval on, where a tick means the summaries stopped; set on the last "
                                           "record of a period's summary")

# --- network ----------------------------------------------------------------------------------------
class LinkDown(Frozen):
    link: LinkName = Field(description="NIC or port, for example 'mlx5_0' or 'hccs3'")
    switch: Name | None = None


class LinkUp(Frozen):
    link: LinkName


class NicErrors(Frozen):
    link: LinkName
    errors: PositiveCount


class CollectiveTimeout(Frozen):
    """A collective did not finish: `reporters` timed out waiting on the other `members` of `group`."""

    group: Name
    members: list[Rank] = Field(min_length=1)
    reporters: list[Rank] = Field(min_length=1)
    operation: Label = "allreduce"
    timeout_s: Seconds = Field(0, description="the collective's timeout, 0 .. 30 days (0: not reported)")
    attempt: Attempt = Field(0, description="the reporters' restart generation")


# --- node (node-scoped) -----------------------------------------------------------------------------
class NodeNotReady(Frozen):
    reason: Text = ""


LAST_EXIT_DESCRIPTION = ("why this node's agent last stopped, said by the agent that starts after it (its runtime "
                         "directory keeps it): an exception with its place, the signal that stopped it, or that it "
                         "ended without a word (killed, its host down); null: a first start")


CHECKS_DESCRIPTION = ("its agent runs health checks and logs `node.checked` next: the node takes no new ranks until "
                      "they pass (false: an agent without checks, taken at its word)")


def _without_last_exit(data: dict[str, Any]) -> dict[str, Any]:
    # An agent's first start is written as before agents said why they last stopped, so logs stay byte for byte;
    # and one without health checks as before they existed.
    if data.get("last_exit", ...) is None:
        del data["last_exit"]
    if data.get("checks", ...) is False:
        del data["checks"]
    return data


class NodeReady(Frozen):
    last_exit: Text | None = Field(None, max_length=1024, description=LAST_EXIT_DESCRIPTION)
    checks: Flag = Field(False, description=CHECKS_DESCRIPTION)

    @model_serializer(mode="wrap")
    def _first_start_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_last_exit(handler(self))


class NodeDrained(Frozen):
    """The platform takes the node away (maintenance, preemption): its ranks must leave it."""

    reason: Text = ""


class NodeJoined(Frozen):
    spare: Flag = True
    devices: Devices = 8
    pool: Token | None = Field(None, description="the spare pool the node joins: only jobs whose `spare_pool` names it "
                                                 "take it; null: the shared pool")

    last_exit: Text | None = Field(None, max_length=1024, description=LAST_EXIT_DESCRIPTION)
    checks: Flag = Field(False, description=CHECKS_DESCRIPTION)

    @model_serializer(mode="wrap")
    def _without_shared_pool(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A node of the shared pool is written as before pools existed, so logs stay byte for byte.
        data: dict[str, Any] = handler(self)
        if data.get("pool", ...) is None:
            del data["pool"]
        return _without_last_exit(data)


class NodeHeartbeat(Frozen):
    """The node's agent is alive and can reach the control plane: sent every `interval_s`, so that its absence
    tells a dead agent or host from processes that merely stopped reporting."""

    interval_s: Seconds = Field(1.0, description="how often the agent sends it, 0 .. 30 days")
    live_s: Seconds | None = Field(None, description="the agent's liveness is off the log: it beats every `live_s` on "
                                                     "core NATS (`recovery.live.<node>`), the daemon's liveness "
                                                     "monitor watches the beats and logs `node.silent` and "
                                                     "`node.heard`, and this record states the mode (sent once, not "
                                                     "every period); null: every heartbeat is logged, as before")

    @model_serializer(mode="wrap")
    def _without_live(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A heartbeat of the logged kind is written as before the live mode existed, so logs stay byte for byte.
        data: dict[str, Any] = handler(self)
        if data.get("live_s", ...) is None:
            del data["live_s"]
        return data


class NodeSilent(Frozen):
    """The daemon's liveness monitor heard no live beat of the node for `silent_s` (its own monotonic clock, only
    while it was connected and held the partition): the engine takes the node as its watchdog takes an agent whose
    heartbeats stopped that long ago. Only the daemon sends it, sealed (`recovery.core.firings`)."""

    silent_s: Seconds = Field(description="how long the monitor heard nothing of the node, up to this record")
    bound_s: Seconds = Field(description="the silence the monitor waited for (the job's `agent_silence_s`)")


class NodeHeard(Frozen):
    """A node the engine holds silent or gone is heard again by the daemon's liveness monitor (a live beat): a sign
    of life, as any event of the node. Only the daemon sends it, sealed."""

    silent_s: Seconds | None = Field(None, description="how long the monitor heard nothing of it before this beat, "
                                                       "when it knows")


class NodeUnreachable(Frozen):
    """The daemon asked the node's agent whether it lives (a request on `recovery.probe.<node>`, core NATS) and NATS
    answered that nothing listens there, three times over `confirm_s`: the agent's connection is gone, and with it every
    report of its ranks. Asked because something suggested a loss (`cause`): a survivor's process group lost a peer's
    connection, or an incident of a job on the node began. The engine's detection policy may take it as the agent's
    silence past any bound (the default does: `DefaultDetectionParams.unreachable_is_lost`). A probe that merely went
    unanswered is not this record: a slow agent is no lost one, and the silence bound decides. Only the daemon sends
    it, sealed (`recovery.core.firings`)."""

    cause: Text = Field("", max_length=256, description="what made the daemon ask: the survivor's report or the "
                                                        "incident")
    confirm_s: Seconds = Field(0, description="the time from the first to the last of the probes nothing answered")


# --- job lifecycle ----------------------------------------------------------------------------------
class JobSubmitted(Frozen):
    spec: JobSpec


class JobStarted(Frozen):
    pass


class JobCompleted(Frozen):
    pass


class JobCancelled(Frozen):
    reason: Text = ""


class JobUnserved(Frozen):
    """The daemon found no agent serving these nodes of a job that has not started yet (none heard from, or declared
    gone) for `waited_s`: the job's ranks there cannot start, and its decision says so."""

    nodes: list[Token] = Field(min_length=1, max_length=4096, description="the nodes no agent serves, at most 4096 "
                                                                          "named")
    waited_s: Seconds = Field(description="how long the daemon saw them unserved")


class ControlOutage(Frozen):
    """The daemon was cut off from NATS for `away_s` up to this record (its own connection lost, so neither the
    job's events nor its timers could be logged): time the control plane was away is not the job's silence. The
    daemon publishes one per job it watches before any timer that fell due meanwhile, and the engine counts no
    node's or rank's silence within the outage when `away_s` is at most `bound_s`."""

    away_s: Seconds = Field(description="how long the daemon was away, measured on its own clock, up to this record")
    bound_s: Seconds = Field(description="the longest outage whose silence is not counted (the daemon's "
                                         "outage_bound_s); a longer one's silence counts as any other")


# --- checkpoints ------------------------------------------------------------------------------------
class CheckpointSaved(Frozen):
    """Shards of the model state at `step` are available in `tier` on `holder` (a node, or 'storage')."""

    step: Step
    tier: Tier
    shards: list[Rank] = Field(min_length=1, description="shard indices (pipeline x tensor coordinate)")
    holder: Token

    @field_validator("tier")
    @classmethod
    def _saved_tier(cls, tier: Tier) -> Tier:
        if tier is Tier.PEER:
            raise ValueError("'peer' names live replicas in a resume plan, not a tier a checkpoint is saved in")
        return tier


class CheckpointFailed(Frozen):
    step: Step
    tier: Tier
    reason: Text = ""


# --- executors, timers, operators -------------------------------------------------------------------
class CommandAck(Frozen):
    command_id: Id
    status: Literal["accepted", "done", "failed"]
    reason: Text = ""
    result: dict[str, Any] = Field(default_factory=dict)


class TimerFired(Frozen):
    timer_id: Id
    due: DueTime = Field(description="the due time the timer was asked for, nanoseconds of log time (< 2^63)")


class PolicyOverran(Frozen):
    """A fact the daemon (or the simulator, or `Scenario`) records when a third-party policy's call did not answer
    within its budget and was abandoned: the engine answers that call with its family's built-in, at the input
    `seq`, in every replay alike, so that no replay depends on how long the call took there."""

    seq: Seq = Field(description="the input whose handling made the call")
    family: Literal["detection", "rescheduling", "checkpoint"]
    method: Literal["classify", "check", "decide", "plan"]
    call: Count = Field(description="which call of that policy's method within the input's handling, from 0")
    policy: Label = Field(description="the policy abandoned, name@version")
    budget_s: Seconds = Field(description="how long the call was given")


class OperatorScale(Frozen):
    dp: Size


class OperatorPause(Frozen):
    reason: Text = ""


class OperatorResume(Frozen):
    pass


class OperatorCancel(Frozen):
    """End the job: its ranks get `signal` and up to `grace_s` to end by themselves (a script's handlers save on the
    way out, as Lightning's on an interrupt), then SIGKILL; `grace_s` 0 kills them at once."""

    reason: Text = ""
    grace_s: Seconds = 0.0
    signal: StopSignal = "SIGTERM"


class OperatorForce(Frozen):
    """Start a recovery attempt of this granularity now, ending the one under way."""

    granularity: Granularity
    reason: Text = ""


class OperatorRelease(Frozen):
    """End the isolation of a node (or of one of its devices) now: an operator checked it, or replaced it."""

    node: Token
    device: Device | None = None
    reason: Text = ""


JOB_EVENTS: dict[str, type[Frozen]] = {
    "process.started": ProcessStarted,
    "process.capabilities": ProcessCapabilities,
    "process.exited": ProcessExited,
    "process.output": ProcessOutput,
    "process.heartbeat": Heartbeat,
    "process.hang": HangReport,
    "process.collective_failed": CollectiveFailed,
    "progress.step": StepReported,
    "progress.report": ProgressReport,
    "progress.summary": ProgressSummary,
    "process.stacks": ProcessStacks,
    "network.collective_timeout": CollectiveTimeout,
    "job.submitted": JobSubmitted,
    "job.started": JobStarted,
    "job.completed": JobCompleted,
    "job.cancelled": JobCancelled,
    "job.unserved": JobUnserved,
    "control.outage": ControlOutage,
    "checkpoint.saved": CheckpointSaved,
    "checkpoint.failed": CheckpointFailed,
    "command.ack": CommandAck,
    "timer.fired": TimerFired,
    "policy.overran": PolicyOverran,
    "operator.scale": OperatorScale,
    "operator.pause": OperatorPause,
    "operator.resume": OperatorResume,
    "operator.cancel": OperatorCancel,
    "operator.force": OperatorForce,
    "operator.release": OperatorRelease,
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
    "node.heartbeat": NodeHeartbeat,
    "node.silent": NodeSilent,
    "node.heard": NodeHeard,
    "node.unreachable": NodeUnreachable,
    "node.checked": NodeChecked,
}
"""Event types that concern one node: the envelope carries `node`."""

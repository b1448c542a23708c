"""The policy contract: three families, each a Protocol the engine calls and a base class an author subclasses,
and the small value types they exchange with the engine.

Policies are pure and deterministic: they see only what the engine hands them (values derived from the log) and
return values; no clock, no I/O, no randomness. Each has a `family`, a `name` and a `version`, and every decision
records `name@version` so a replay can tell a changed policy from a bug.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from events.names import AttemptOutcome
from events.values import FaultClass, Granularity, Layout, ResumePlan, Tier, shards_at
from policies.views import RankActivity as RankActivity  # the watchdog view: part of the contract
from policies.views import RankColumns as RankColumns
from policies.views import WatchdogView as WatchdogView

NS = 1_000_000_000
Scope = Literal["rank", "device", "node", "link", "job"]
Family = Literal["detection", "rescheduling", "checkpoint"]
FAMILIES: tuple[Family, ...] = ("detection", "rescheduling", "checkpoint")


class Params(BaseModel):
    """Base of every policy's parameters: unknown keys are an error, so a typo is never ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --- detection ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Signal:
    """One input event as the detection policy sees it, with the facts the engine derived for it."""

    type: str
    data: Any
    ts: int
    node: str | None
    ranks: tuple[int, ...]
    """the job's ranks this signal concerns (for a node event: the ranks placed on that node/device)"""
    device_fault_times: tuple[int, ...] = ()
    """log times of this device's faults within the cluster's history, this one included, oldest first"""
    node_fault_times: tuple[int, ...] = ()
    step_time_ns: int | None = None
    world: int = 0
    """the job's number of ranks"""
    node_ranks: tuple[int, ...] = ()
    """for a node event: every rank of the job on that node (`ranks` holds only those on the device, if any)"""
    spares_available: int | None = None
    """for a device fault: the free spare nodes the job may take now (None: not known), so that a policy isolates a
    lemon only when something can replace it"""
    can_shrink: bool = False
    """for a device fault: the job is elastic and could go on at a smaller data-parallel size without that node"""
    losses: tuple[float, ...] = ()
    """for a loss (`progress.loss`, data a `LossSample`): the job's recent finite losses, oldest first (at most
    `LOSS_HISTORY`; one per report, the median of its ranks', from the reports none of whose losses was bad): what a
    spike is measured against"""
    dead: tuple[int, ...] = ()
    """for a collective failure: the job's ranks whose process the engine knows is gone (a failed collective with a
    dead peer is that peer's fault, whose exit says so; with every rank alive the group itself failed)"""


LOSS_HISTORY = 256
"""the recent losses the engine keeps per job for the detection policy (`Signal.losses`)"""


@dataclass(frozen=True, slots=True)
class LossSample:
    """A loss a rank reported for a step (`Signal.data` of a `progress.loss` signal): `loss` is a float, maybe NaN or
    infinite."""

    rank: int
    step: int
    loss: float


# What a signal means for the job: one of five small variants (`Verdict` is their union).
@dataclass(frozen=True, slots=True)
class Ignore:
    """Nothing to do (the decision says why, unless the signal is good news such as a link coming up)."""

    reason: str
    code: str | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """A confirmed fault: act now."""

    reason: str
    fault_class: FaultClass | None = None
    scope: Scope = "rank"
    ranks: tuple[int, ...] = ()
    node: str | None = None
    device: int | None = None
    lost: bool = True
    """the ranks' processes are gone (or must be killed): they cannot take part in saving"""
    needs_move: bool = False
    """the hardware under the ranks is unusable: they must leave their node"""
    isolate: Literal["device", "node"] | None = None
    code: str | None = None
    reset_clears: bool = False
    """a reset of `device` clears what makes it unusable (XID 48): when no spare comes, the ranks may restart on
    their node after a reset instead of waiting for a repair"""
    isolate_for_ns: int | None = None
    """with `isolate`: the isolation expires after this long unless a repair or a replacement ended it first (None:
    until then)"""
    bad_step: int | None = None
    """the job's state is poisoned from this step on (a NaN or spiking loss): every rank rolls back to the newest
    checkpoint before it, and the data of that step is skipped"""


@dataclass(frozen=True, slots=True)
class Suspect:
    """`fault`, unless a `Clear` with the same `key` comes within `confirm_after_ns` (a link flap, a node that is
    not ready for a moment): the engine confirms it when the time is up."""

    fault: Fault
    key: str
    confirm_after_ns: int

    @property
    def reason(self) -> str:
        return self.fault.reason


@dataclass(frozen=True, slots=True)
class Clear:
    """The suspicion under `key` is over: drop it."""

    reason: str
    key: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Sub-health: the hardware still works; move the ranks off `node` at the job's next complete checkpoint."""

    reason: str
    node: str
    device: int | None = None
    code: str | None = None
    evidence: tuple[tuple[str, int | float], ...] = ()
    """what the policy measured, for the decision's detail (a straggler: its rank, its compute time, the peers'
    median), as (name, value) pairs in the order to show them"""


Verdict = Ignore | Suspect | Clear | Fault | Drain
"""What a detection policy answers for one signal (and, as a list, for one watchdog check)."""


@runtime_checkable
class DetectionPolicy(Protocol):
    """Detection escalation: signal -> ignore, suspect, clear or fault."""

    family: ClassVar[str]
    name: ClassVar[str]
    version: ClassVar[str]

    def classify(self, signal: Signal) -> Verdict: ...

    def check(self, view: WatchdogView) -> list[Verdict]:
        """Called on every watchdog tick while the job runs: hangs from silence or from no progress."""
        ...


# --- rescheduling -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AttemptSummary:
    granularity: Granularity
    outcome: AttemptOutcome
    """failed, timed_out or superseded: the attempts of an incident that ended without recovering it"""
    rung: int

    def __post_init__(self) -> None:
        # The engine may hand the outcome over as its wire string: policies always see the member.
        if type(self.outcome) is not AttemptOutcome:
            object.__setattr__(self, "outcome", AttemptOutcome(self.outcome))


@dataclass(frozen=True, slots=True)
class PastIncident:
    """One of the job's closed incidents, for a policy that looks for a pattern across recoveries (a crash loop)."""

    fault_class: FaultClass | None
    fault_step: int
    """the job's step when the incident opened (0 for a script that reports none)"""
    resume_step: int | None
    """the step its last attempt resumed from (None: no restart)"""
    opened_ns: int
    closed_ns: int
    outcome: str
    """recovered, failed, cancelled, ..."""
    ranks: tuple[int, ...]
    """the ranks its faults named"""
    nodes: tuple[str, ...] = ()
    """the nodes its faults struck, sorted: where those ranks ran when each fault came, and a node a fault named"""


@dataclass(frozen=True, slots=True)
class FailedExits:
    """The open incident's processes of one generation that failed one way (not a stop's SIGTERM or SIGKILL, not a
    clean end), counted: what tells a script that fails the same way wherever it runs (a deterministic error) from a
    fault of the infrastructure."""

    generation: int
    error: str
    """the script's error as it said it (`ValueError: bad lr (train.py:42 in main)`), else `exit code N`/`signal N`"""
    ranks: int
    """how many ranks of the generation failed this way"""
    said: bool
    """the script said why (its error file or its output), not only an exit status"""
    early: bool
    """every one of them failed before the job's first step in that generation"""
    first_ns: int
    """log time of the first of them"""


@dataclass(frozen=True, slots=True)
class RescheduleContext:
    fault_class: FaultClass
    scope: Scope
    needs_move: bool
    any_lost: bool
    """some rank's process is gone: a step retry cannot help"""
    previous: tuple[AttemptSummary, ...]
    """attempts of the open incident so far, oldest first"""
    used: Mapping[str, int]
    """attempts made in the open incident, by '<fault class>/<granularity>' and by granularity"""
    restarts_used: int
    max_restarts: int | None
    nodes_to_replace: int
    """unusable nodes the job must leave: what a job-level restart has to replace"""
    nodes_to_migrate: int
    """nodes a pod-level migration would vacate: the unusable ones, or else those of the faulty ranks"""
    spares_available: int
    dp: int
    scale_in_dp: int | None
    """the data-parallel size the job could shrink to without the lost nodes; None if not elastic or below min"""
    forced: Granularity | None = None
    step_time_ns: int | None = None
    """the job's measured time per step, if known"""
    widened: bool = False
    """a fault outside the attempt under way superseded it, and no settle window has passed since"""
    wait_expired: bool = False
    """the job has waited for nodes until the deadline of the policy's `Wait` (or the engine's own, for a rung it
    could not place), and they did not come: fall back instead of waiting again"""
    waited_ns: int = 0
    """how long the open incident has been waiting for nodes so far (0: it is not waiting)"""
    reset_clears: bool = False
    """every node the job must leave is unusable only for devices a reset clears (XID 48 and its kind): a restart in
    place that resets them first (`StartRung(..., reset_devices=True)`) can run without a spare"""
    nodes_after_reset: int = 0
    """the nodes the job must still leave once the devices a reset clears are reset: a pod-level move of only
    these, resetting the others (`StartRung(MIGRATE, ..., reset_devices=True)`), needs this many spares"""
    sdk: bool = True
    """the job's script reports through the SDK (heartbeats, steps): its silence means something, and its steps
    measure it. False: a stock script that knows nothing of recovery"""
    reform: bool = True
    """the job's ranks said they form their process group again in their process (`ProcessGroupRecovery`): its
    surviving processes can rejoin a partial restart (in place, migrate, retry). False (a stock script, or one that
    only reports steps): only a job-level restart (every process anew, from the script's checkpoint) recovers it"""
    now_ns: int = 0
    """log time of the record being applied"""
    fault_step: int = 0
    """the job's step when the open incident began"""
    fault_ranks: tuple[int, ...] = ()
    """the ranks the open incident's faults named, sorted"""
    recent: tuple[PastIncident, ...] = ()
    """the job's latest closed incidents, oldest first (at most 8)"""
    restart_times: tuple[int, ...] = ()
    """log times at which the job's restarts began (any granularity starting processes), oldest first: the last 256
    at least"""
    exits: tuple[FailedExits, ...] = ()
    """the failed exits of the open incident's last two generations that had any, oldest first"""
    world: int = 0
    """the job's number of ranks (0: not told)"""


# The rescheduling decision: one of four small variants (`Reschedule` is their union).
@dataclass(frozen=True, slots=True)
class StartRung:
    """Start an attempt of `granularity` (rung `rung` of the policy's ladder), to show progress within
    `deadline_ns`."""

    granularity: Granularity
    reason: str
    deadline_ns: int = 300 * NS
    rung: int = 0
    reset_devices: bool = False
    """reset first the devices a reset clears on the nodes the job would leave, and restart those ranks there: an
    in-place restart (when `RescheduleContext.reset_clears`), or a pod-level move of only the other nodes (needs
    `RescheduleContext.nodes_after_reset` spares)"""
    grace_ns: int = 30 * NS
    """for a script that reports no steps (`RescheduleContext.sdk` false): the attempt has recovered the job once its
    restarted processes have all run this long without exiting (at least 1 s)"""


@dataclass(frozen=True, slots=True)
class Wait:
    """Start nothing: wait for nodes to come back. The engine asks again whenever capacity returns or a fault
    joins, and once more when `deadline_ns` has passed since the wait began (with `wait_expired`): a wait always
    has an exit. None leaves the deadline to the engine's `MAX_WAIT`."""

    reason: str
    deadline_ns: int | None = None


@dataclass(frozen=True, slots=True)
class Settle:
    """Start nothing yet: collect further faults of the incident for `settle_ns`, then decide again."""

    reason: str
    settle_ns: int


@dataclass(frozen=True, slots=True)
class Fail:
    """No rung can recover this: fail the job."""

    reason: str


Reschedule = StartRung | Wait | Settle | Fail
"""What a rescheduling policy answers."""


@runtime_checkable
class ReschedulingPolicy(Protocol):
    """The escalation ladder: a confirmed fault (and the incident's attempts so far) -> what to restart, or wait."""

    family: ClassVar[str]
    name: ClassVar[str]
    version: ClassVar[str]

    def decide(self, ctx: RescheduleContext) -> Reschedule: ...


# --- checkpoint source --------------------------------------------------------------------------------
Catalog = Mapping[int, Mapping[Tier, Mapping[int, tuple[str, ...]]]]
"""step -> tier -> shard -> holders (sorted), steps newest first"""


@dataclass(frozen=True, slots=True)
class CheckpointContext:
    layout: Layout
    catalog: Catalog
    placement: tuple[str, ...]
    """node of every rank, by rank"""
    unreachable: frozenset[str]
    """nodes whose memory and disks cannot be read (lost, not ready, isolated)"""
    alive: tuple[bool, ...]
    """by rank: the process still holds its training state"""
    steps: tuple[int, ...]
    """by rank: last completed step"""
    dying_allowed: bool
    """the attempt may ask healthy replicas to save a dying checkpoint first"""
    peer_allowed: bool = False
    """the restarted ranks may take their state straight from live replicas (no attempt of the incident did)"""
    restarting: frozenset[int] = frozenset()
    """ranks whose processes the attempt restarts or moves: their state is not there to send"""
    exiting: frozenset[int] = frozenset()
    """ranks the platform stopped with SIGTERM in this incident: their handlers may be writing a dying checkpoint
    at their last step on the way out (ModelArts' graceful exit), which lands shortly after the exit is reported"""
    ended: frozenset[int] = frozenset()
    """ranks whose process's end was seen in this incident (of `exiting`, the rest may still run: one node taken)"""
    shard_counts: tuple[tuple[int, int], ...] = ()
    """an `fsdp` job resharded by a scale: (first step, shards) for each world it trained in, oldest first; a step
    at or past `first` was saved in that many shards (a checkpoint of the old world is still whole in its old shards,
    which the SDK reshards on load). Empty: every step in `layout.shards`"""

    def shards_at(self, step: int) -> int:
        """The shards a checkpoint of `step` is whole in."""
        return shards_at(self.shard_counts, step, self.layout)


@dataclass(frozen=True, slots=True)
class SaveRequest:
    step: int
    ranks: tuple[int, ...]
    """one rank per shard to save (a healthy replica, or the rank that holds it), lowest shard first"""


# The checkpoint source: one of three small variants (`CheckpointPlan` is their union).
@dataclass(frozen=True, slots=True)
class Resume:
    """Restart from `plan`: the step to load and every shard's source."""

    plan: ResumePlan
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SaveDying:
    """First ask healthy replicas for a dying checkpoint (MindIO TTP), then plan again."""

    save: SaveRequest
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AwaitDying:
    """A dying checkpoint at `step` is on its way from ranks the platform stopped with SIGTERM (and `save`'s ranks,
    asked for the shards no exited rank holds): hold the restart until every shard of it is saved, or `wait_ns` has
    passed, then plan again; `fallback` is the plan should it never come."""

    step: int
    wait_ns: int
    fallback: ResumePlan
    reason: str = ""
    save: SaveRequest | None = None


CheckpointPlan = Resume | SaveDying | AwaitDying
"""What a checkpoint-source policy answers."""


@runtime_checkable
class CheckpointPolicy(Protocol):
    """The checkpoint source: where every shard's state comes from, and whether to save a dying checkpoint first."""

    family: ClassVar[str]
    name: ClassVar[str]
    version: ClassVar[str]

    def plan(self, ctx: CheckpointContext) -> CheckpointPlan: ...


@dataclass(frozen=True, slots=True)
class PolicySet:
    detection: DetectionPolicy
    rescheduling: ReschedulingPolicy
    checkpoint: CheckpointPolicy
    labels: Mapping[str, str] = field(default_factory=dict)


def label(policy: DetectionPolicy | ReschedulingPolicy | CheckpointPolicy) -> str:
    """`name@version`: how every decision, snapshot and replay names a policy."""
    return f"{policy.name}@{policy.version}"


# --- the bases an author subclasses ---------------------------------------------------------------------
class PolicyBase(ABC):
    """What every policy class is: a family, a name, a version, and parameters validated when it is made.

    Subclass the base of your policy's family (`DetectionPolicyBase`, `ReschedulingPolicyBase`, `CheckpointPolicyBase`),
    not this one. Set `name`, and `version`, which you change whenever a decision could change: every decision records
    `name@version`, and a replay tells a changed policy from a bug by it. Set `parameters` to your `Params` model: a
    job's `params` are validated against it, and an unknown key is an error. Implement the family's methods as pure
    functions of their argument and `self.params`: no clock, no I/O, no randomness, no order taken from iterating a
    set (`recovery.testing.policy_contract` checks that)."""

    family: ClassVar[Family]
    name: ClassVar[str]
    version: ClassVar[str]
    parameters: ClassVar[type[Params]] = Params
    """the model a job's parameters for this policy are validated against (`Params` itself takes none)"""
    params: Params
    """the validated parameters (redeclare it with your model's type to read its fields typed)"""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = self.parameters.model_validate(dict(params or {}))


class DetectionPolicyBase(PolicyBase):
    """Base of a detection policy: classify each signal, and check the job's ranks on every watchdog tick."""

    family: ClassVar[Family] = "detection"

    @abstractmethod
    def classify(self, signal: Signal) -> Verdict:
        """What one input event means for the job: ignore, suspect, clear, fault or drain."""

    @abstractmethod
    def check(self, view: WatchdogView) -> list[Verdict]:
        """Called on every watchdog tick while the job runs: hangs from silence or from no progress (return [] to
        leave hangs to the collective timeouts)."""


class ReschedulingPolicyBase(PolicyBase):
    """Base of a rescheduling policy: for an incident, the granularity of the next attempt, or wait, settle or fail."""

    family: ClassVar[Family] = "rescheduling"

    @abstractmethod
    def decide(self, ctx: RescheduleContext) -> Reschedule:
        """The next attempt of the open incident. The engine checks the answer against the cluster: a restart it
        cannot place makes the job wait for nodes."""


class CheckpointPolicyBase(PolicyBase):
    """Base of a checkpoint-source policy: where every shard's state comes from when ranks restart."""

    family: ClassVar[Family] = "checkpoint"

    @abstractmethod
    def plan(self, ctx: CheckpointContext) -> CheckpointPlan:
        """The resume plan, and optionally a dying checkpoint to save first or one on its way to wait for."""


FAMILY_BASES: dict[Family, type[PolicyBase]] = {"detection": DetectionPolicyBase,
                                                "rescheduling": ReschedulingPolicyBase,
                                                "checkpoint": CheckpointPolicyBase}
"""the base of each family: its abstract methods are what a policy of the family must have"""

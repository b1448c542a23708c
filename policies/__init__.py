"""Policies: the contract a policy author writes against, and the built-ins (loaded through the `recovery.policies`
entry points like any plugin).

An author imports everything from here. A policy is a class of one family that subclasses the family's base,
names itself, declares its parameters and implements the family's method::

    from policies import NS, Granularity, Params, RescheduleContext, Reschedule, ReschedulingPolicyBase, StartRung

    class InPlaceFirstParams(Params):
        deadline_s: float = 120.0

    class InPlaceFirst(ReschedulingPolicyBase):
        name = "in-place-first"
        version = "1"  # change it whenever a decision could change
        parameters = InPlaceFirstParams
        params: InPlaceFirstParams

        def decide(self, ctx: RescheduleContext) -> Reschedule:
            return StartRung(Granularity.IN_PLACE, "restart where they are", int(self.params.deadline_s * NS))

and registers it in its distribution's `pyproject.toml` under `[project.entry-points."recovery.policies"]`.
`recovery.testing.policy_contract` has the test cases that check it is pure and deterministic.

The families, and the small typed answers each gives:

- detection (`DetectionPolicyBase`): `classify` a `Signal`, `check` a `WatchdogView`; a `Verdict` is one of
  `Ignore`, `Suspect` (a `Fault` to confirm unless cleared in time), `Clear`, `Fault` or `Drain`;
- rescheduling (`ReschedulingPolicyBase`): `decide` on a `RescheduleContext`; a `Reschedule` is one of
  `StartRung`, `Wait`, `Settle` or `Fail`;
- checkpoint source (`CheckpointPolicyBase`): `plan` on a `CheckpointContext`; a `CheckpointPlan` is one of
  `Resume`, `SaveDying` (ask healthy replicas for a dying checkpoint first) or `AwaitDying` (one is on its way).
"""

from events import kinds
from events.names import AttemptOutcome
from events.values import (
    MAX_SECONDS,
    STORAGE_HOLDER,
    TIER_COST,
    Count,
    Factor,
    FaultClass,
    Flag,
    Granularity,
    Interval,
    Layout,
    PolicyRef,
    PolicySelection,
    PositiveCount,
    Rank,
    RankSource,
    ResumePlan,
    Seconds,
    ShardSource,
    Size,
    Step,
    Tier,
)
from policies import codes
from policies.base import (
    FAMILIES,
    FAMILY_BASES,
    LOSS_HISTORY,
    NS,
    AttemptSummary,
    AwaitDying,
    Catalog,
    CheckpointContext,
    CheckpointPlan,
    CheckpointPolicy,
    CheckpointPolicyBase,
    Clear,
    DetectionPolicy,
    DetectionPolicyBase,
    Drain,
    Fail,
    Family,
    Fault,
    Ignore,
    LossSample,
    Params,
    PastIncident,
    PolicyBase,
    PolicySet,
    RankActivity,
    RankColumns,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicy,
    ReschedulingPolicyBase,
    Resume,
    SaveDying,
    SaveRequest,
    Scope,
    Settle,
    Signal,
    StartRung,
    Suspect,
    Verdict,
    Wait,
    WatchdogView,
    label,
)
from policies.codes import Action as CodeAction
from policies.codes import CodeMeaning, ascend_fault, exit_status, nvidia_xid
from policies.registry import GROUP, PolicyError, available, broken, load, load_set

__all__ = [
    "FAMILIES",
    "FAMILY_BASES",
    "GROUP",
    "LOSS_HISTORY",
    "MAX_SECONDS",
    "NS",
    "STORAGE_HOLDER",
    "TIER_COST",
    "AttemptOutcome",
    "AttemptSummary",
    "AwaitDying",
    "Catalog",
    "CheckpointContext",
    "CheckpointPlan",
    "CheckpointPolicy",
    "CheckpointPolicyBase",
    "Clear",
    "CodeAction",
    "CodeMeaning",
    "Count",
    "DetectionPolicy",
    "DetectionPolicyBase",
    "Drain",
    "Factor",
    "Fail",
    "Family",
    "Fault",
    "FaultClass",
    "Flag",
    "Granularity",
    "Ignore",
    "Interval",
    "Layout",
    "LossSample",
    "Params",
    "PastIncident",
    "PolicyBase",
    "PolicyError",
    "PolicyRef",
    "PolicySelection",
    "PolicySet",
    "PositiveCount",
    "Rank",
    "RankActivity",
    "RankColumns",
    "RankSource",
    "Reschedule",
    "RescheduleContext",
    "ReschedulingPolicy",
    "ReschedulingPolicyBase",
    "Resume",
    "ResumePlan",
    "SaveDying",
    "SaveRequest",
    "Scope",
    "Seconds",
    "Settle",
    "ShardSource",
    "Signal",
    "Size",
    "StartRung",
    "Step",
    "Suspect",
    "Tier",
    "Verdict",
    "Wait",
    "WatchdogView",
    "ascend_fault",
    "available",
    "broken",
    "codes",
    "exit_status",
    "kinds",
    "label",
    "load",
    "load_set",
    "nvidia_xid",
]

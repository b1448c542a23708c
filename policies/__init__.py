"""Policies: the contract a policy author writes against, and the built-ins (loaded through the `recovery.policies`
entry points like any plugin).

An author imports everything from here. A policy is a class of one family that subclasses the family's base,
names itself, declares its parameters and implements the family's method::

    from policies import NS, Action, Granularity, Params, RescheduleContext, ReschedulingPolicyBase

    class InPlaceFirstParams(Params):
        deadline_s: float = 120.0

    class InPlaceFirst(ReschedulingPolicyBase):
        name = "in-place-first"
        version = "1"  # change it whenever a decision could change
        parameters = InPlaceFirstParams
        params: InPlaceFirstParams

        def decide(self, ctx: RescheduleContext) -> Action:
            return Action(Granularity.IN_PLACE, "restart where they are", int(self.params.deadline_s * NS))

and registers it in its distribution's `pyproject.toml` under `[project.entry-points."recovery.policies"]`.
`recovery.testing.policy_contract` has the test cases that check it is pure and deterministic.

The families: detection (`DetectionPolicyBase`: `classify` a `Signal`, `check` a `WatchdogView`, each giving
`Verdict`s), rescheduling (`ReschedulingPolicyBase`: `decide` on a `RescheduleContext`, giving an `Action`) and
checkpoint source (`CheckpointPolicyBase`: `plan` on a `CheckpointContext`, giving a `CheckpointPlan`).
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
    NS,
    Action,
    AttemptSummary,
    Catalog,
    CheckpointContext,
    CheckpointPlan,
    CheckpointPolicy,
    CheckpointPolicyBase,
    DetectionPolicy,
    DetectionPolicyBase,
    Family,
    Params,
    PolicyBase,
    PolicySet,
    RankActivity,
    RescheduleContext,
    ReschedulingPolicy,
    ReschedulingPolicyBase,
    SaveRequest,
    Scope,
    Signal,
    Verdict,
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
    "MAX_SECONDS",
    "NS",
    "STORAGE_HOLDER",
    "TIER_COST",
    "Action",
    "AttemptOutcome",
    "AttemptSummary",
    "Catalog",
    "CheckpointContext",
    "CheckpointPlan",
    "CheckpointPolicy",
    "CheckpointPolicyBase",
    "CodeAction",
    "CodeMeaning",
    "Count",
    "DetectionPolicy",
    "DetectionPolicyBase",
    "Factor",
    "Family",
    "FaultClass",
    "Flag",
    "Granularity",
    "Interval",
    "Layout",
    "Params",
    "PolicyBase",
    "PolicyError",
    "PolicyRef",
    "PolicySelection",
    "PolicySet",
    "PositiveCount",
    "Rank",
    "RankActivity",
    "RankSource",
    "RescheduleContext",
    "ReschedulingPolicy",
    "ReschedulingPolicyBase",
    "ResumePlan",
    "SaveRequest",
    "Scope",
    "Seconds",
    "ShardSource",
    "Signal",
    "Size",
    "Step",
    "Tier",
    "Verdict",
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

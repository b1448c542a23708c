"""An example third-party rescheduling policy for `recovery`.

A policy subclasses its family's base from `policies` (here `ReschedulingPolicyBase`), names itself, declares its
parameters and implements the family's method (`decide`); its distribution registers it under the entry-point group
`recovery.policies` in pyproject.toml. Its tests (tests/) run the contract of `recovery.testing` on it.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies import NS, Granularity, Params, Reschedule, RescheduleContext, ReschedulingPolicyBase, StartRung, Wait


class InPlaceFirstParams(Params):
    deadline_s: float = Field(120.0, gt=0, description="deadline of each attempt")


class InPlaceFirst(ReschedulingPolicyBase):
    """Restart in place (or move off a node that must be left); if that fails, restart the whole job."""

    name: ClassVar[str] = "example-in-place-first"
    version: ClassVar[str] = "1"
    parameters = InPlaceFirstParams
    params: InPlaceFirstParams

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        deadline = int(self.params.deadline_s * NS)
        if ctx.forced is not None:
            return StartRung(ctx.forced, f"operator forced {ctx.forced.value}", deadline)
        if ctx.previous:
            return StartRung(Granularity.RESTART_JOB, "the first attempt did not recover: restart the job", deadline,
                             rung=1)
        if not ctx.sdk:
            # A stock script (no SDK): its surviving processes cannot join restarted peers.
            return StartRung(Granularity.RESTART_JOB, "the script does not use the SDK: restart the job", deadline)
        if ctx.needs_move:
            if ctx.nodes_to_migrate > ctx.spares_available:
                return Wait("no spare for the node to leave: wait")
            return StartRung(Granularity.MIGRATE, "the node must be left: move its ranks", deadline)
        return StartRung(Granularity.IN_PLACE, "restart the faulty processes where they are", deadline)

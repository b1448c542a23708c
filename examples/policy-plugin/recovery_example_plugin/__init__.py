"""An example third-party rescheduling policy for `recovery`.

A policy subclasses its family's base from `policies` (here `ReschedulingPolicyBase`), names itself, declares its
parameters and implements the family's method (`decide`); its distribution registers it under the entry-point group
`recovery.policies` in pyproject.toml. Its tests (tests/) run the contract of `recovery.testing` on it.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies import (
    NS,
    Fail,
    Granularity,
    Params,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicyBase,
    StartRung,
    Wait,
)


class InPlaceFirstParams(Params):
    deadline_s: float = Field(120.0, gt=0, description="deadline of each attempt")
    wait_s: float = Field(3600.0, gt=0, description="how long to wait for spare nodes before failing the job")


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
        # A second attempt restarts the job; so does the first for a script whose ranks do not re-form in process
        # (a stock one, or one that only reports steps): its surviving processes cannot join restarted peers.
        job_level = bool(ctx.previous) or not ctx.reform
        need = ctx.nodes_to_replace if job_level else ctx.nodes_to_migrate if ctx.needs_move else 0
        if need > ctx.spares_available:
            if ctx.wait_expired:  # every wait needs an exit: the engine asks again once its deadline has passed
                return Fail(f"waited for {need} spare node(s); none came")
            return Wait(f"{need} node(s) to replace, {ctx.spares_available} spare(s): wait",
                        deadline_ns=int(self.params.wait_s * NS))
        if job_level:
            why = "the first attempt did not recover" if ctx.previous else "the script does not use the SDK"
            return StartRung(Granularity.RESTART_JOB, f"{why}: restart the job", deadline,
                             rung=1 if ctx.previous else 0)
        if ctx.needs_move:
            return StartRung(Granularity.MIGRATE, "the node must be left: move its ranks", deadline)
        return StartRung(Granularity.IN_PLACE, "restart the faulty processes where they are", deadline)

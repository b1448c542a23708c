"""An example third-party rescheduling policy for `recovery`.

A policy is a class with `family`, `name` and `version`, a constructor taking its parameters (a dict), and the
method of its family's Protocol (`policies.base.ReschedulingPolicy.decide`), registered under the entry-point
group `recovery.policies` in this distribution's pyproject.toml.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from events.values import Granularity
from policies.base import NS, Action, Params, RescheduleContext


class InPlaceFirstParams(Params):
    deadline_s: float = Field(120.0, gt=0, description="deadline of each attempt")


class InPlaceFirst:
    """Restart in place (or move off a node that must be left); if that fails, restart the whole job."""

    family: ClassVar[str] = "rescheduling"
    name: ClassVar[str] = "example-in-place-first"
    version: ClassVar[str] = "1"

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self.params = InPlaceFirstParams.model_validate(params or {})

    def decide(self, ctx: RescheduleContext) -> Action:
        deadline = int(self.params.deadline_s * NS)
        if ctx.forced is not None:
            return Action(ctx.forced, f"operator forced {ctx.forced.value}", deadline)
        if ctx.previous:
            return Action(Granularity.RESTART_JOB, "the first attempt did not recover: restart the job", deadline,
                          rung=1)
        if ctx.needs_move:
            if ctx.nodes_to_migrate > ctx.spares_available:
                return Action(None, "no spare for the node to leave: wait", deadline, wait=True)
            return Action(Granularity.MIGRATE, "the node must be left: move its ranks", deadline)
        return Action(Granularity.IN_PLACE, "restart the faulty processes where they are", deadline)

"""The example policy passes the rescheduling contract of `recovery.testing`, and does what its docstring says."""

from __future__ import annotations

from typing import Any, ClassVar

from recovery_example_plugin import InPlaceFirst

from policies import NS, AttemptOutcome, Granularity, Wait
from recovery.testing import Call, ReschedulingPolicyContract, make_reschedule_context


class TestInPlaceFirst(ReschedulingPolicyContract):
    policy = InPlaceFirst
    params: ClassVar[dict[str, Any]] = {"deadline_s": 90}
    entry_point = "example-in-place-first"

    def sample_calls(self) -> list[Call]:
        # The contract's own contexts, and the cases this policy treats apart.
        return [*super().sample_calls(),
                ("decide", make_reschedule_context(nodes_to_replace=1, nodes_to_migrate=2, spares_available=1))]


def test_restarts_the_faulty_processes_where_they_are_first() -> None:
    action = InPlaceFirst({"deadline_s": 90}).decide(make_reschedule_context())
    assert action.granularity is Granularity.IN_PLACE and action.deadline_ns == 90 * NS


def test_moves_off_a_node_that_must_be_left_or_waits_for_a_spare() -> None:
    policy = InPlaceFirst()
    assert policy.decide(make_reschedule_context(nodes_to_replace=1)).granularity is Granularity.MIGRATE
    waiting = policy.decide(make_reschedule_context(nodes_to_replace=1, spares_available=0))
    assert isinstance(waiting, Wait)


def test_restarts_the_job_once_the_first_attempt_failed() -> None:
    failed = make_reschedule_context(previous=[(Granularity.IN_PLACE, AttemptOutcome.FAILED, 0)])
    assert InPlaceFirst().decide(failed).granularity is Granularity.RESTART_JOB

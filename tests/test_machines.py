"""Both state machines, transition by transition: every (source, trigger) pair of the tables in
`recovery/core/machine.py` is driven through the engine by a scenario below, which asserts what it brought about.
A pair no scenario reaches fails `test_every_transition_in_the_tables_is_driven`: a transition that cannot fire has
no place in a table."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from recovery.core import machine
from recovery.core.machine import PHASE_TRANSITIONS, TRANSITIONS, IllegalTransition, fire, fire_phase
from recovery.testing.scenario import Scenario

NO_DYING = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}
JOB_LEVEL = {**NO_DYING, "rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
    {"granularity": "restart_job"}]}}}}
"""a process fault restarts the whole job: the healthy ranks are stopped first"""
SAVE_FIRST = {"checkpoint": {"name": "newest-complete", "params": {"peer": False}}}
"""healthy replicas write a dying checkpoint before a restart"""
Fired = set[tuple[str, str, str]]
"""(machine, source, trigger)"""


@contextmanager
def watching() -> Iterator[Fired]:
    """Every transition the engine fires while the block runs, by machine, source and trigger."""
    fired: Fired = set()
    real = machine._fire

    def spy(which: Any, model: Any, trigger: str, now: str) -> None:
        real(which, model, trigger, now)
        fired.add(("job" if which is machine.JOB_MACHINE else "phase", now, trigger))

    machine._fire = spy  # type: ignore[assignment]
    try:
        yield fired
    finally:
        machine._fire = real  # type: ignore[assignment]


def training(policies: dict[str, Any] | None = None, nodes: int = 2) -> Scenario:
    """A running job of `nodes` 4-rank nodes, pure data parallel, with a storage checkpoint at step 5."""
    s = Scenario()
    s.submit("j", [f"n{i}" for i in range(nodes)], ranks_per_node=4, dp=4 * nodes, policies=policies or NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    return s


# -- scenarios: each drives a few transitions and checks where they lead --------------------------------------
def crash_and_recover() -> None:
    """A crashed rank (nothing left to stop) restarts in place and trains past the resume point."""
    s = training()
    assert s.state("j") == "running" and s.phase("j") is None
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    assert s.state("j") == "recovering" and s.phase("j") == "rescheduling"
    s.ack_all()
    assert s.phase("j") == "restoring"
    s.train("j", 2)
    assert s.state("j") == "running" and s.phase("j") is None and s.find("incident.closed", "j")


def job_restart_stops_first() -> None:
    """A job-level restart stops the healthy ranks first; the stop's ack sends the restart."""
    s = training(JOB_LEVEL)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    assert s.phase("j") == "stopping"
    [stop] = s.outstanding("stop_ranks")
    s.ack(stop)
    assert s.phase("j") == "rescheduling"


def dying_checkpoint_then_stop() -> None:
    """Healthy replicas save a dying checkpoint; then they are stopped for the job-level restart."""
    s = training({**SAVE_FIRST, "rescheduling": JOB_LEVEL["rescheduling"]})
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    assert s.phase("j") == "saving"
    [save] = s.outstanding("save_checkpoint")
    s.complete(save)
    assert s.phase("j") == "stopping"


def dying_checkpoint_then_restart() -> None:
    """Healthy replicas save a dying checkpoint; the crashed rank has nothing to stop, so the restart goes."""
    s = training(SAVE_FIRST)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    assert s.phase("j") == "saving"
    [save] = s.outstanding("save_checkpoint")
    s.complete(save)
    assert s.phase("j") == "rescheduling"


def dying_checkpoint_asked_again() -> None:
    """The dying checkpoint of SIGTERM'd ranks does not land in time, but ranks on one node came back meanwhile:
    they are asked for one instead, so the incident stays `saving`, now for another checkpoint."""
    s = training(SAVE_FIRST)
    s.job_event("j", "process.exited", rank=1, signal=15)
    assert s.find("checkpoint.awaiting", "j") and s.phase("j") == "saving"
    for rank in range(4, 8):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank)
    s.advance(31)
    assert s.find("checkpoint.dying_failed", "j")
    assert s.phase("j") == "saving" and s.outstanding("save_checkpoint")


def forced_while_saving() -> None:
    """An operator forces a job-level restart while the dying checkpoint is written: the policy plans again."""
    s = training(SAVE_FIRST)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    assert s.phase("j") == "saving"
    s.job_event("j", "operator.force", granularity="restart_job")
    assert s.find("attempt.superseded", "j") and s.phase("j") != "saving"


def stop_fails() -> None:
    """The stop fails: the attempt failed, the policy plans the next rung."""
    s = training(JOB_LEVEL)
    s.job_event("j", "process.exited", rank=2, exit_code=139)
    [stop] = s.outstanding("stop_ranks")
    s.ack(stop, status="failed", reason="no agent")
    assert s.find("attempt.failed", "j") and s.phase("j") in ("stopping", "rescheduling", "settling")


def restart_fails() -> None:
    s = training()
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    [restart] = s.outstanding("restart_ranks")
    s.ack(restart, status="failed", reason="no GPU")
    assert s.find("attempt.failed", "j")


def restarted_rank_crashes() -> None:
    s = training()
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.ack_all()
    assert s.phase("j") == "restoring"
    s.job_event("j", "process.exited", rank=1, exit_code=139, attempt=1)
    assert s.find("attempt.failed", "j")


SETTLES_AT_ONCE = {**NO_DYING, "rescheduling": {"name": "ladder", "params": {"quick_widenings": 0}}}
"""the ladder settling at the first fault that widens an incident (by default the first two restart at once)"""


def widened_then_settled() -> None:
    """A fault outside the attempt under way supersedes it; the policy settles, then plans when the window ends."""
    s = training(SETTLES_AT_ONCE)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.job_event("j", "process.exited", rank=5, exit_code=139)
    assert s.phase("j") == "settling"
    s.advance(2)
    assert s.phase("j") in ("rescheduling", "stopping")


def cancelled_while_settling() -> None:
    s = training(SETTLES_AT_ONCE)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.job_event("j", "process.exited", rank=5, exit_code=139)
    assert s.phase("j") == "settling"
    s.job_event("j", "job.cancelled", reason="gone")
    assert s.state("j") == "cancelled" and s.phase("j") is None


def waits_for_a_node_then_moves() -> None:
    """A node fault with no spare: the job waits; a spare joins and the move goes."""
    s = training()
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("j", 120, ranks=range(4))  # n0's ranks go on heartbeating: only n1 is gone
    assert s.phase("j") == "waiting", s.kinds("j")
    s.spare("s0")
    assert s.phase("j") != "waiting" and s.state("j") == "recovering"


def cancelled_while_waiting() -> None:
    s = training()
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("j", 120, ranks=range(4))
    assert s.phase("j") == "waiting"
    s.job_event("j", "operator.cancel", reason="give up")
    assert s.state("j") == "cancelled"


def cancelled_mid_attempt(phase: str) -> Callable[[], None]:
    def scenario() -> None:
        s = training({"saving": SAVE_FIRST, "stopping": JOB_LEVEL}.get(phase, NO_DYING))
        s.job_event("j", "process.exited", rank=1, exit_code=139)
        assert s.phase("j") == phase
        s.job_event("j", "job.cancelled", reason="gone")
        assert s.state("j") == "cancelled"
    scenario.__name__ = f"cancelled_while_{phase}"
    return scenario


def paused_and_resumed() -> None:
    s = training()
    s.job_event("j", "operator.pause", reason="maintenance")
    s.ack_all()
    assert s.state("j") == "paused" and s.phase("j") == "paused"
    s.job_event("j", "operator.resume")
    assert s.state("j") == "recovering"
    s.ack_all()
    s.train("j", 2)
    assert s.state("j") == "running"


def paused_then(event: str) -> Callable[[], None]:
    def scenario() -> None:
        s = training()
        s.job_event("j", "operator.pause", reason="maintenance")
        s.ack_all()
        assert s.state("j") == "paused"
        s.job_event("j", event, **({"reason": "done with it"} if event == "job.cancelled" else {}))
        assert s.state("j") == ("completed" if event == "job.completed" else "cancelled")
    scenario.__name__ = f"paused_then_{event}"
    return scenario


def lifecycle_end(event: str, when: str) -> Callable[[], None]:
    def scenario() -> None:
        s = Scenario()
        s.submit("j", ["n0"], ranks_per_node=4, dp=4, start=when != "submitted")
        assert s.state("j") == ("submitted" if when == "submitted" else "running")
        if when != "submitted":
            s.train("j", 3)
        if when == "recovering":
            s.job_event("j", "process.exited", rank=1, exit_code=139)
            assert s.state("j") == "recovering"
        s.job_event("j", event, **({"reason": "the end"} if event == "job.cancelled" else {}))
        assert s.state("j") == ("completed" if event == "job.completed" else "cancelled")
    scenario.__name__ = f"{event}_while_{when}"
    return scenario


def budget_exhausted_fails() -> None:
    """A ladder whose only rung is spent: the policy fails the job from `planning`."""
    s = training({**NO_DYING, "rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
        {"granularity": "in_place", "budget": 1}]}}}})
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    [restart] = s.outstanding("restart_ranks")
    s.ack(restart, status="failed", reason="no GPU")
    assert s.state("j") == "failed" and s.phase("j") is None


def dumped() -> None:
    """The `dump` strategy saves and stops the job for an operator: failed from `rescheduling`."""
    s = training({**NO_DYING, "rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
        {"granularity": "dump"}]}}}})
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.ack_all()
    assert s.state("j") == "failed"


SCENARIOS: list[Callable[[], None]] = [
    crash_and_recover, job_restart_stops_first, dying_checkpoint_then_stop, dying_checkpoint_then_restart,
    dying_checkpoint_asked_again, forced_while_saving, stop_fails, restart_fails, restarted_rank_crashes,
    widened_then_settled, cancelled_while_settling, waits_for_a_node_then_moves, cancelled_while_waiting,
    cancelled_mid_attempt("saving"), cancelled_mid_attempt("stopping"), cancelled_mid_attempt("rescheduling"),
    paused_and_resumed, paused_then("job.completed"), paused_then("job.cancelled"),
    *(lifecycle_end(event, when) for event in ("job.completed", "job.cancelled")
      for when in ("submitted", "running", "recovering")),
    budget_exhausted_fails, dumped,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario_reaches_what_it_says(scenario: Callable[[], None]) -> None:
    scenario()


def pairs(table: list[dict[str, Any]]) -> set[tuple[str, str]]:
    found = set()
    for t in table:
        for source in t["source"] if isinstance(t["source"], list) else [t["source"]]:
            found.add((source, t["trigger"]))
    return found


def test_every_transition_in_the_tables_is_driven() -> None:
    with watching() as fired:
        for scenario in SCENARIOS:
            scenario()
    table = {("job", *p) for p in pairs(TRANSITIONS)} | {("phase", *p) for p in pairs(PHASE_TRANSITIONS)}
    assert sorted(table - fired) == [], "transitions no scenario drives"
    assert fired <= table  # the engine fired only what the tables hold (else IllegalTransition had stopped it)


def test_a_transition_outside_the_tables_is_refused() -> None:
    class Model:
        state = "completed"
        phase = "closed"

    with pytest.raises(IllegalTransition):
        fire(Model(), "start")
    with pytest.raises(IllegalTransition):
        fire_phase(Model(), "plan")

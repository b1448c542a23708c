"""Regressions the property tests of `tests/test_properties.py` found: each sequence was an `internal_error` (an
illegal transition, an index past the placement) or a built-in policy's `policy_error` before its fix in the engine;
the plans hypothesis printed are kept as they were found, played by the property's own driver."""

from __future__ import annotations

from events.commands import StopRanks
from events.values import Tier
from recovery.testing.scenario import Scenario
from tests import test_properties
from tests.property_plans import JobPlan, Plan


def check_plan(plan: Plan) -> test_properties.Driver:
    """A plan hypothesis printed, played by the property itself (its inner test: nothing drawn, nothing shrunk); and
    once more by its driver, for a test to look at what the plan led to."""
    test_properties.test_random_interleavings_keep_the_invariants_and_replay_identically.hypothesis.inner_test(plan)
    return test_properties.run_plan(plan)


def no_internal_errors(scenario: Scenario) -> None:
    assert not [r for r in scenario.rejections if r.code == "internal_error"], scenario.rejections


def test_resume_without_enough_nodes_waits_instead_of_failing_the_transition() -> None:
    """paused -> wait was an IllegalTransition: a resume that finds a node gone must leave `paused` first."""
    s = Scenario()
    s.submit("job", ["n0", "n1"], ranks_per_node=1, dp=2)
    s.train("job", 3)
    s.job_event("job", "operator.pause")
    s.ack_all()
    assert s.state("job") == "paused"
    s.node_event("n1", "node.not_ready", reason="rebooting")
    s.job_event("job", "operator.resume")
    no_internal_errors(s)
    assert s.phase("job") == "waiting"
    assert s.find("attempt.started", "job")[-1].previous == "paused"


def test_resume_stops_processes_that_came_back_while_paused() -> None:
    """paused -> stop was an IllegalTransition: a process that started while the job was paused is stopped."""
    s = Scenario()
    s.submit("job", ["n0", "n1"], ranks_per_node=1, dp=2)
    s.train("job", 3)
    s.job_event("job", "operator.pause")
    s.ack_all()
    s.job_event("job", "process.started", rank=0, pid=4242, attempt=s.engine.jobs["job"].generation)
    s.job_event("job", "operator.resume")
    no_internal_errors(s)
    assert s.phase("job") == "stopping"
    assert [c.ranks for c in s.outstanding() if isinstance(c, StopRanks)] == [[0]]


def test_suspicion_that_comes_due_while_paused_is_dropped() -> None:
    """A link went down during an incident, then an operator paused the job: the confirmation used to open a
    recovery from `paused` (an IllegalTransition); a paused job takes no signals."""
    s = Scenario()
    s.submit("job", ["n0", "n1"], ranks_per_node=1, dp=2)
    s.train("job", 3)
    s.job_event("job", "process.exited", rank=0, exit_code=1)
    s.node_event("n1", "network.link_down", link="mlx5_0")
    s.job_event("job", "operator.pause")
    s.ack_all()
    assert s.state("job") == "paused"
    s.advance(11)  # past the 10 s link debounce
    no_internal_errors(s)
    assert s.state("job") == "paused"
    assert s.find("fault.cleared", "job")[-1].reason.endswith("job is paused")


def test_forced_scale_in_never_places_the_job_on_too_few_nodes() -> None:
    """A forced scale-in that could not shrink (dp already at min_dp) sent restart_job with no nodes, and the
    next planning indexed past the placement."""
    s = Scenario()
    s.submit("job", ["n0"], ranks_per_node=1, dp=1, elastic={"min_dp": 1, "max_dp": 1})
    s.train("job", 3)
    s.node_event("n0", "node.not_ready", reason="gone")
    s.advance(21)  # past the not-ready grace: node fault, no spare: wait
    assert s.phase("job") == "waiting"
    s.job_event("job", "operator.force", granularity="scale_in")
    s.job_event("job", "operator.force", granularity="scale_in")
    no_internal_errors(s)
    for command in s.commands_of("restart_job") + s.commands_of("scale_job"):
        assert command.nodes, command
    assert s.phase("job") == "waiting"


def suspicion_across_scale_in(link_node: str) -> Scenario:
    """dp=3 elastic job on n0..n2 with no spare; n0 is drained, so it scales in to n1, n2, while a link on
    `link_node` is down and its debounce still counts (the link goes down once the new placement is chosen:
    a node whose link is down already is not chosen)."""
    s = Scenario()
    s.submit("job", ["n0", "n1", "n2"], ranks_per_node=1, dp=3, elastic={"min_dp": 1, "max_dp": 3})
    s.train("job", 3)
    s.node_event("n0", "node.drained", reason="maintenance")
    if link_node == "n0":  # drained anyway: its link changes no placement
        s.node_event(link_node, "network.link_down", link="mlx5_0")
    while not s.outstanding("scale_job"):
        [command] = s.outstanding()
        s.complete(command)
    if link_node != "n0":
        s.node_event(link_node, "network.link_down", link="mlx5_0")
    s.ack_all()
    assert s.engine.jobs["job"].nodes == ["n1", "n2"]
    s.train("job", 12)  # recovers at the first step, and trains on past the 10 s link debounce
    no_internal_errors(s)
    assert s.find("incident.closed", "job")
    return s


def test_suspicion_confirmed_after_scale_in_names_the_renumbered_rank() -> None:
    """n2's rank was 2 when its link went down and is 1 after the scale-in: the confirmation used rank 2 and
    indexed past the smaller job."""
    s = suspicion_across_scale_in("n2")
    fault = s.find("fault.confirmed", "job")[-1]
    assert fault.detail["fault"]["ranks"] == [1]
    assert fault.detail["fault"]["node"] == "n2"


def test_suspicion_about_a_node_the_job_left_is_dropped() -> None:
    s = suspicion_across_scale_in("n0")
    assert s.find("fault.cleared", "job")[-1].reason.endswith("job no longer on n0")
    assert s.state("job") == "running"


def test_in_place_restart_after_scale_in_ignores_ranks_the_job_no_longer_has() -> None:
    """Rank 1 failed, then a drain scaled the job in to one rank within the same incident; an in-place restart
    after that took rank 1 from the incident's faults and indexed past the smaller job."""
    s = Scenario()
    s.submit("job", ["n0", "n1"], ranks_per_node=1, dp=2, elastic={"min_dp": 1, "max_dp": 2})
    s.train("job", 3)
    s.job_event("job", "process.exited", rank=1, exit_code=1)
    s.node_event("n0", "node.drained", reason="maintenance")
    s.ack_all()
    s.advance(2)  # the drain widened the incident: the scale-in starts after the ladder's settle window
    s.ack_all()
    assert s.engine.jobs["job"].world == 1
    s.job_event("job", "operator.force", granularity="in_place")
    no_internal_errors(s)
    assert s.find("attempt.started", "job")[-1].detail["ranks"] == [0]


def test_scale_in_forgets_the_old_worlds_exiting_ranks() -> None:
    """A SIGINT while the job waited for nodes (a preemption: all 4 ranks asked to stop) marked them exiting, writing a
    dying checkpoint; the scale-in it led to renumbered the job into 2 ranks, took the new numbers off that set and
    left ranks 2 and 3 in it, and the next plan (the operator's pause) made the built-in checkpoint policy index
    past the job's ranks (a `policy_error`)."""
    s = Scenario()
    s.submit("job", ["n0", "n1"], ranks_per_node=2, dp=2, pp=2, elastic={"min_dp": 1, "max_dp": 2})
    s.train("job", 3)
    s.advance(11)  # every rank silent past the watchdog: a node fault, no spare: wait
    assert s.phase("job") == "waiting"
    s.job_event("job", "process.exited", rank=0, exit_code=0, signal=2, attempt=0)  # n0 speaks: scale in onto it
    assert s.find("attempt.started", "job")[-1].detail["granularity"] == "scale_in"
    assert s.engine.jobs["job"].world == 2
    incident = s.engine.jobs["job"].incident
    assert incident is not None and incident.exiting <= set(range(2)) and incident.stopped <= set(range(2))
    s.job_event("job", "operator.pause", reason="test")
    assert not s.rejections, s.rejections
    assert s.state("job") == "paused"


def test_plan_whose_scale_in_kept_old_exiting_ranks() -> None:
    """The plan hypothesis found for `test_scale_in_forgets_the_old_worlds_exiting_ranks`: the operator's pause at the
    end was a `policy_error` (newest-complete's `exiting_step` indexed rank 2 of a 2-rank job)."""
    check_plan(Plan(
        jobs=[JobPlan("job0", dp=2, tp=1, pp=2, ranks_per_node=2, elastic=(1, 2), max_restarts=None),
              JobPlan("job1", dp=1, tp=1, pp=1, ranks_per_node=1, elastic=(1, 1), max_restarts=None)],
        spares=0,
        ops=[("train", 0, 1, 0), ("train", 0, 1, 0), ("recover", 1), ("link_down", 0, 0), ("train", 0, 1, 0),
             ("link_up", 0, 0), ("recover", 1), ("train", 0, 1, 0), ("train", 0, 1, 0), ("recover", 1),
             ("advance", 3), ("checkpoint", 0, 0, 0, 0, 0, 0), ("train", 1, 1, 0), ("advance", 0),
             ("exit", 0, 0, 0, 2, 0), *[("train", 0, 1, 0)] * 15, ("advance", 0), ("operator", 0, "pause", 1, 0)]))


def test_plan_whose_only_newer_checkpoint_was_in_a_rebooted_nodes_memory() -> None:
    """job1 saved step 2 in job1-n1's host memory only; job1-n1 then joined again (booted: the engine forgets what it
    held), so the in-place restart after the XID rightly took step 1 from the live replicas. The driver still
    counted step 2 as saved and called that a recovery that threw saved progress away: it now forgets a joining
    node's host memory as the engine does."""
    driver = check_plan(Plan(
        jobs=[JobPlan("job0", dp=1, tp=1, pp=1, ranks_per_node=1, elastic=None, max_restarts=None),
              JobPlan("job1", dp=2, tp=1, pp=2, ranks_per_node=2, elastic=None, max_restarts=None)],
        spares=0,
        ops=[("recover", 1), ("recover", 1), *[("train", 0, 1, 0)] * 3, ("checkpoint", 1, 0, 0, 2, 0, 2),
             ("resubmit", 0), ("recover", 1), *[("train", 0, 1, 0)] * 5, ("node", 2, "joined"), ("link_down", 0, 0),
             *[("train", 0, 1, 0)] * 6, ("advance", 0), ("train", 0, 1, 0), ("train", 0, 1, 0), ("recover", 1),
             ("train", 0, 1, 0), ("train", 6, 1, 0), ("train", 0, 1, 0), ("recover", 1), ("xid", 1, 0, 0)]))
    assert not driver.scenario.engine.jobs["job1"].frozen_catalog()[2][Tier.MEMORY]  # job1-n1's memory: forgotten
    plan = driver.scenario.find("checkpoint.plan", "job1")[-1]
    assert plan.detail["checkpoint_step"] == 1 and plan.detail["tiers"] == {"peer": 2}


def test_plan_whose_spare_joined_during_a_scale_in() -> None:
    """job1 (dp=2, elastic 1..2) lost a link on job1-n0: no spare, so a scale-in to dp=1 keeping rank 1, whose live
    replica the plan restores from. A spare joined while rank 0 was being stopped; the restart placed the job again
    at dp=2 and restarted every rank, the peer it was to restore from included. The scale keeps the size it was
    planned for."""
    driver = check_plan(Plan(
        jobs=[JobPlan("job0", dp=1, tp=1, pp=1, ranks_per_node=1, elastic=None, max_restarts=None),
              JobPlan("job1", dp=2, tp=1, pp=1, ranks_per_node=1, elastic=(1, 2), max_restarts=None)],
        spares=0,
        ops=[("link_down", 1, 0), *[("train", 0, 1, 0)] * 4, ("recover", 1), ("train", 0, 1, 0), ("train", 0, 3, 0),
             ("node", 3, "joined"), ("train", 0, 1, 0), ("recover", 1)]))
    [rescheduled] = driver.scenario.find("ranks.rescheduling", "job1")
    assert [c.kind for c in rescheduled.commands] == ["scale_job"] and rescheduled.detail["nodes"] == ["job1-n1"]

"""Focused engine behaviours: generations, staleness and what a restart replaces."""

from __future__ import annotations

from policies.base import NS
from recovery.testing.scenario import Scenario

NO_DYING = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}


def restarted_rank_1() -> Scenario:
    s = Scenario()
    s.submit("j", ["a", "b"], ranks_per_node=4, dp=8, policies=NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    [restart] = s.outstanding("restart_ranks")
    assert restart.ranks == [1] and restart.attempt == 1
    return s


def test_exit_of_a_rank_that_was_only_rolled_back_is_a_fault() -> None:
    s = restarted_rank_1()
    s.job_event("j", "process.exited", rank=5, exit_code=139, attempt=0)  # same process, generation 0
    assert "attempt.superseded" in s.kinds("j")[-5:]
    # rank 1's restart was sent and resumes from the same checkpoint: carried over, only rank 5 restarts
    [started] = [d for d in s.find("attempt.started", "j") if d.detail["attempt"] == 2]
    assert started.detail["ranks"] == [1, 5] and started.detail["carried"] == [1]
    [restart] = s.outstanding("restart_ranks")
    assert restart.ranks == [5]


def test_many_faults_widening_a_crash_settle_after_the_first_few() -> None:
    """The ladder restarts the first `quick_widenings` (2) widenings at once; the third settles, gathering the rest
    of what looks like a job-wide crash into one attempt."""
    s = restarted_rank_1()
    for rank in (5, 6):
        s.job_event("j", "process.exited", rank=rank, exit_code=139, attempt=0)
        assert s.outstanding("restart_ranks")[0].ranks == [rank]
    s.job_event("j", "process.exited", rank=7, exit_code=139, attempt=0)
    assert s.kinds("j")[-2:] == ["attempt.superseded", "attempt.settling"]
    assert s.engine.jobs["j"].phase == "settling" and not s.outstanding("restart_ranks")
    s.job_event("j", "process.exited", rank=3, exit_code=139, attempt=0)
    s.advance(2)  # the ladder's settle window: the next attempt covers the exits since, carrying the restarts sent
    [restart] = s.outstanding("restart_ranks")
    assert restart.ranks == [3, 7]


def test_exit_of_a_replaced_process_is_stale() -> None:
    s = restarted_rank_1()
    before = len(s.decisions)
    s.job_event("j", "process.exited", rank=1, exit_code=137, attempt=0)  # the process the restart replaced
    assert len(s.decisions) == before and not s.rejections


def test_progress_of_an_untouched_rank_in_its_own_generation_neither_closes_nor_moves_the_job() -> None:
    """Rank 5 was rolled back, not restarted: a report in its own generation (in flight from before the rollback,
    or sent after it by a process its agent has not told the new generation) is the rank's own progress, never the
    job's: it does not close the incident nor move the job's step, and its roll-back is no step backwards."""
    s = restarted_rank_1()
    s.ack_all()
    s.job_event("j", "progress.step", rank=5, step=9, attempt=0)
    job = s.engine.jobs["j"]
    assert job.step == 5 and job.phase == "restoring"
    s.job_event("j", "progress.step", rank=5, step=6, attempt=0)  # rolled back to the resume point, trains on
    assert not s.rejections and job.steps[5] == 6
    s.job_event("j", "progress.step", rank=1, step=6, attempt=1)
    assert job.state == "running"


def crash_every_rank(nodes: int = 8, rpn: int = 8) -> Scenario:
    """A dependency every rank uses goes away: the agents report the exits one by one."""
    s = Scenario()
    s.submit("j", [f"n{i}" for i in range(nodes)], ranks_per_node=rpn, dp=nodes * rpn, policies=NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    for rank in range(nodes * rpn):
        s.job_event("j", "process.exited", rank=rank, exit_code=1)
    return s


def test_a_burst_of_exits_makes_one_attempt_after_the_settle_window() -> None:
    s = crash_every_rank()
    # The first exit starts an attempt at once, and so do the next two (the ladder's quick widenings: each adds
    # its rank, carrying the restarts sent); the fourth opens the settle window, in which the other 60 only join
    # the incident instead of superseding one attempt after another.
    assert s.kinds("j").count("attempt.started") == 3
    assert s.kinds("j").count("attempt.superseded") == 3
    assert s.phase("j") == "settling"
    s.advance(2)
    started = s.find("attempt.started", "j")
    assert len(started) == 4 and started[-1].detail["ranks"] == list(range(64))
    assert started[-1].detail["carried"] == [0, 1, 2]
    [restart] = s.outstanding("restart_ranks")
    assert restart.ranks == list(range(3, 64)) and restart.plan.checkpoint_step == 5
    s.ack_all()
    s.train("j", 2)
    [closed] = s.find("incident.closed", "j")
    assert closed.detail["attempts"] == 4


def test_an_operator_order_closes_the_settle_window() -> None:
    s = crash_every_rank(nodes=2, rpn=2)
    assert s.phase("j") == "settling"
    s.job_event("j", "operator.force", granularity="restart_job")
    started = s.find("attempt.started", "j")[-1]
    assert started.detail["granularity"] == "restart_job"
    assert any("/settle/" in timer for timer in started.cancelled_timers)
    assert s.kinds("j").count("attempt.started") == 4  # three quick ones, then the operator's
    s.advance(2)  # the cancelled window does not fire another attempt
    assert s.kinds("j").count("attempt.started") == 4


def test_a_node_whose_link_is_down_is_left_or_waited_for_not_restarted_on() -> None:
    s = Scenario()
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.node_event("b", "network.link_down", link="mlx5_0", switch="leaf1")
    assert not s.engine.cluster.usable("b")
    s.advance(10)  # the link debounce: a fault now, and no spare to move to
    assert s.find("fault.confirmed", "j")
    assert s.phase("j") == "waiting" and not s.outstanding()
    assert "retry" not in [d.detail.get("granularity") for d in s.find("attempt.started", "j")]
    s.node_event("b", "network.link_up", link="mlx5_0")  # the switch is back: the job recovers where it is
    [started] = s.find("attempt.started", "j")
    assert started.detail["granularity"] == "retry"
    s.ack_all()
    s.train("j", 2)
    assert s.state("j") == "running" and s.find("incident.closed", "j")


def test_a_node_whose_link_is_down_is_not_a_spare_to_move_to() -> None:
    s = Scenario()
    s.spare("s1")
    s.spare("s2")
    s.node_event("s1", "network.link_down", link="mlx5_0")
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("j", 3)
    s.node_event("b", "node.not_ready", reason="kernel panic")
    s.idle("j", 30, ranks=[0, 1])  # node a's ranks go on heartbeating: only b is gone
    s.ack_all()
    [migrate] = s.commands_of("migrate_ranks")
    assert (migrate.from_node, migrate.to_node) == ("b", "s2")


def test_new_hardware_under_a_job_level_restart_widens_the_incident_instead_of_failing_it() -> None:
    job_level = {"rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
        {"granularity": "restart_job", "budget": 1, "deadline_s": 900}]}}}, **NO_DYING}
    s = Scenario()
    s.spare("s1")
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, policies=job_level)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.job_event("j", "process.exited", rank=0, exit_code=1)
    while not s.outstanding("restart_job"):  # the stop is done; the job-level restart is under way
        [command] = s.outstanding()
        s.complete(command)
    # a GPU falls off the bus on b while the job restarts: not this restart's failure (its one try is left)
    s.node_event("b", "device.fault", device=1, vendor="nvidia", code="79", severity="critical")
    assert "attempt.failed" not in s.kinds("j") and "job.failed" not in s.kinds("j")
    assert s.kinds("j")[-2:] == ["attempt.superseded", "attempt.settling"]
    s.advance(2)
    s.ack_all()
    # the widened incident is planned for its worst fault, a node's: the node ladder moves b's ranks to the spare
    [move] = s.commands_of("migrate_ranks")
    assert (move.from_node, move.to_node) == ("b", "s1")
    assert s.engine.jobs["j"].nodes == ["a", "s1"]
    s.train("j", 2)
    assert s.state("j") == "running"


def test_a_crash_of_the_restarted_processes_still_fails_the_attempt() -> None:
    s = Scenario()
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.ack_all()
    s.job_event("j", "process.exited", rank=1, exit_code=139, attempt=1)  # the restarted process crashes again
    assert "attempt.failed" in s.kinds("j")


def test_finished_jobs_beyond_the_kept_number_are_forgotten_oldest_first() -> None:
    from recovery.core.engine import FINISHED_JOBS_KEPT

    s = Scenario()
    total = FINISHED_JOBS_KEPT + 3
    for i in range(total):
        s.submit(f"j{i}", [f"n{i}"], ranks_per_node=1, dp=1)
        s.job_event(f"j{i}", "job.completed")
    s.submit("live", ["m0"], ranks_per_node=1, dp=1)
    jobs = s.engine.jobs
    assert [f"j{i}" for i in range(3)] == [j for j in (f"j{i}" for i in range(total)) if j not in jobs]
    assert len(jobs) == FINISHED_JOBS_KEPT + 1 and jobs["live"].state == "running"
    # a late event for a forgotten job is an unknown job; its id may be submitted afresh
    s.job_event("j0", "command.ack", command_id="j0:1:0", status="done")
    assert s.rejections[-1].code == "unknown_job"
    s.submit("j0", ["n0"], ranks_per_node=1, dp=1)
    assert jobs["j0"].state == "running"
    assert s.engine._order["j0"] > s.engine._order["live"]  # submission order survives the gaps


def sub_healthy_node_b(spare: bool) -> Scenario:
    s = Scenario()
    if spare:
        s.spare("s1")
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=2, tp=2)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.node_event("b", "device.fault", device=1, vendor="ascend", code="SubHealthFault", severity="warning")
    return s


def test_a_sub_healthy_node_is_drained_at_the_next_complete_checkpoint() -> None:
    s = sub_healthy_node_b(spare=True)
    assert s.kinds("j")[-1] == "node.drain_planned" and s.state("j") == "running" and not s.outstanding()
    s.train("j", 4)
    s.checkpoint("j", 10, "memory", "a", shards=[0])  # not complete yet: shard 1 is missing
    assert not s.outstanding()
    s.checkpoint("j", 10, "memory", "a", shards=[1])
    [started] = s.find("attempt.started", "j")
    assert started.detail["granularity"] == "migrate" and started.detail["vacate"] == ["b"]
    assert s.engine.jobs["j"].incident.cause == "drain" and not s.find("fault.confirmed", "j")
    s.ack_all()
    [migrate] = s.commands_of("migrate_ranks")
    assert (migrate.from_node, migrate.to_node) == ("b", "s1")
    assert not s.engine.cluster.usable("b")  # nothing new lands on it until it rejoins
    s.train("j", 2)
    assert s.state("j") == "running" and s.engine.jobs["j"].nodes == ["a", "s1"]
    assert s.find("incident.closed", "j")


def test_a_drain_without_a_spare_waits_for_a_later_checkpoint() -> None:
    s = sub_healthy_node_b(spare=False)
    s.train("j", 4)
    s.checkpoint("j", 10, "storage", "storage")
    assert s.kinds("j")[-1] == "node.drain_deferred" and not s.outstanding() and s.state("j") == "running"
    s.spare("s1")
    s.train("j", 4)
    s.checkpoint("j", 14, "storage", "storage")
    assert s.find("attempt.started", "j")[-1].detail["vacate"] == ["b"]


def test_a_periodic_timer_fired_late_skips_the_periods_nobody_fired() -> None:
    s = Scenario()
    s.submit("j", ["a"], ranks_per_node=1, dp=1, watchdog_interval_s=10)
    (timer_id, (_, due, every)), = [(t, e) for t, e in s.engine.timers.items() if "/watchdog/" in t]
    assert every == 10 * NS
    s.now = due + 3600 * NS + 5 * NS  # the daemon was down for an hour; the timer service fires once, late
    s.steps("j", 600)  # what the agents reported meanwhile comes first in the stream
    s.job_event("j", "timer.fired", timer_id=timer_id, due=due)
    assert s.state("j") == "running"
    _, following, _ = s.engine.timers[timer_id]
    assert following == due + 361 * every  # the first period after the firing, not the 360 missed ones
    s.job_event("j", "timer.fired", timer_id=timer_id, due=due + every)  # a missed period fired anyway: stale
    assert s.engine.timers[timer_id][1] == following


def test_a_node_whose_every_rank_falls_silent_is_moved_at_once() -> None:
    s = Scenario()
    s.spare("s1")
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, watchdog_interval_s=2, policies=NO_DYING)
    s.train("j", 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.idle("j", 15, ranks=[0, 1])  # b's host died: its agent and both its ranks went quiet together
    [fault] = s.find("fault.confirmed", "j")
    assert fault.detail["fault"]["class"] == "node" and fault.detail["fault"]["ranks"] == [2, 3]
    [started] = s.find("attempt.started", "j")
    assert started.detail["granularity"] == "migrate" and started.detail["vacate"] == ["b"]
    assert not s.commands_of("stop_ranks")  # nothing to stop on a host that does not answer
    s.ack_all()
    [migrate] = s.commands_of("migrate_ranks")
    assert (migrate.from_node, migrate.to_node) == ("b", "s1")


def test_one_silent_rank_on_a_node_is_still_a_hang() -> None:
    s = Scenario()
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, watchdog_interval_s=2, policies=NO_DYING)
    s.train("j", 6)
    s.idle("j", 15, ranks=[0, 1, 2])
    [fault] = s.find("fault.confirmed", "j")
    assert fault.detail["fault"]["class"] == "hang" and fault.detail["fault"]["ranks"] == [3]
    assert s.find("attempt.started", "j")[0].detail["granularity"] == "in_place"


def test_a_plan_from_live_replicas_is_made_again_when_they_moved_on_before_the_restart() -> None:
    s = Scenario()
    s.spare("s1")
    s.submit("j", ["a", "b"], ranks_per_node=1, dp=2)
    s.train("j", 5)
    s.node_event("b", "network.link_down", link="mlx5_0")
    s.idle("j", 10)  # the link debounce: b's rank moves to the spare, its state from rank 0 at step 5
    [plan] = s.find("checkpoint.plan", "j")
    assert plan.detail["checkpoint_step"] == 5 and plan.detail["tiers"] == {"peer": 1}
    [stop] = s.outstanding("stop_ranks")
    # while rank 1 is being stopped, rank 0 finishes step 6 and a checkpoint of it lands
    s.steps("j", 6, ranks=[0])
    s.checkpoint("j", 6, "storage", "storage")
    s.complete(stop)
    again = s.find("checkpoint.plan", "j")[-1]
    assert again.reason.startswith("again before the restart") and again.detail["checkpoint_step"] == 6
    [migrate] = s.outstanding("migrate_ranks")
    assert (migrate.to_node, migrate.plan.checkpoint_step) == ("s1", 6)

"""A graceful exit must lose nothing: the restart carries the plan made when its command is sent, and waits, bounded,
for a dying checkpoint that SIGTERM handlers are writing."""

from __future__ import annotations

from events.commands import RestartJob
from events.values import Tier
from recovery.testing.scenario import Scenario

NO_LIVE_STATE = {"checkpoint": {"name": "newest-complete", "params": {"dying": False, "peer": False}}}


def test_a_checkpoint_that_lands_while_processes_stop_is_the_one_the_restart_carries() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.train("j", 10)
    s.checkpoint("j", 8, "storage", "storage")
    s.job_event("j", "operator.force", granularity="restart_job", reason="driver update")
    [plan] = s.find("checkpoint.plan", "j")
    assert plan.detail["checkpoint_step"] == 8
    [stop] = s.outstanding("stop_ranks")
    s.checkpoint("j", 10, "local", "n0")  # the step-10 save finished while the processes were being stopped
    s.ack(stop)
    [restart] = s.commands_of("restart_job")
    assert isinstance(restart, RestartJob)
    assert restart.plan.checkpoint_step == 10 and {src.tier for src in restart.plan.shards} == {Tier.LOCAL}
    again = s.find("checkpoint.plan", "j")[-1]
    assert "again before the restart" in again.reason and again.detail["checkpoint_step"] == 10


def test_a_holder_lost_while_processes_stop_is_not_in_the_restart_plan() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.spare("s0")
    s.train("j", 10)
    s.checkpoint("j", 6, "storage", "storage")
    s.checkpoint("j", 9, "memory", "n1")
    s.job_event("j", "operator.force", granularity="restart_job", reason="maintenance")
    assert s.find("checkpoint.plan", "j")[0].detail["checkpoint_step"] == 9
    s.node_event("n1", "node.joined", spare=False)  # rebooted: its host memory is gone
    for command in s.outstanding("stop_ranks"):
        s.ack(command)
    [restart] = s.commands_of("restart_job")
    assert restart.plan.checkpoint_step == 6


def test_one_rank_sigterm_on_a_tensor_parallel_job_waits_for_the_whole_dying_checkpoint() -> None:
    """Detection reads one SIGTERM as the platform stopping the job: every rank is writing. Half the shards landing
    is not enough; the restart goes when the last shard lands."""
    s = Scenario()
    s.submit("tp", ["t0", "t1"], ranks_per_node=4, dp=2, tp=4)
    s.train("tp", 7)
    s.checkpoint("tp", 5, "storage", "storage")
    s.job_event("tp", "process.exited", rank=6, exit_code=143)
    assert s.find("checkpoint.awaiting", "tp")
    s.checkpoint("tp", 7, "dying", "storage", shards=[0, 1])
    assert not s.commands_of("restart_job"), "restarted before the dying checkpoint was complete"
    s.checkpoint("tp", 7, "dying", "storage", shards=[2, 3])
    s.ack_all()
    [restart] = s.commands_of("restart_job")
    assert restart.plan.checkpoint_step == 7
    s.advance(10)
    s.train("tp", 1)
    [closed] = s.find("incident.closed", "tp")
    assert closed.detail["lost_steps"] == 0


def test_no_wait_when_the_policy_says_zero() -> None:
    s = Scenario()
    s.submit("z", ["z0"], ranks_per_node=2, dp=2,
             policies={"checkpoint": {"name": "newest-complete", "params": {"dying_wait_s": 0.0}}})
    s.train("z", 4)
    s.job_event("z", "process.exited", rank=0, signal=15)
    assert not s.find("checkpoint.awaiting", "z")
    assert s.commands_of("restart_job")[0].plan.checkpoint_step is None


def test_a_cancel_with_a_grace_stops_the_ranks_gracefully_with_its_signal_and_one_without_kills_them() -> None:
    """What recovery-run sends on Ctrl-C (SIGINT, its --stop-grace) reaches the agents as a graceful stop, so that a
    script's own handlers (Lightning's checkpoint on an interrupt) run; a cancel without a grace kills at once, and is
    written as it was before a grace could be given."""
    s = Scenario()
    s.submit("a", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.submit("b", ["n2", "n3"], ranks_per_node=2, dp=4)
    s.train("a", 3)
    s.train("b", 3)
    s.job_event("a", "operator.cancel", reason="Ctrl-C", grace_s=30.0, signal="SIGINT")
    s.job_event("b", "operator.cancel", reason="give up")
    graceful, kill = s.commands_of("stop_ranks")
    assert (graceful.job, graceful.mode, graceful.grace_s, graceful.signal) == ("a", "graceful", 30.0, "SIGINT")
    assert graceful.ranks == [0, 1, 2, 3] and graceful.deadline_s >= 30.0 + 30.0  # the grace, then a kill's time
    assert (kill.job, kill.mode, kill.grace_s, kill.signal, kill.deadline_s) == ("b", "kill", 0.0, "SIGTERM", 60.0)
    assert "signal" not in kill.model_dump(mode="json")  # a SIGTERM stop's bytes are the older ones
    assert s.state("a") == s.state("b") == "cancelled"
    assert graceful.stuck == "wait"  # an operator's stop waits for every rank: nothing is known to be stuck


def test_a_stop_after_a_fault_kills_the_ranks_that_cannot_run_a_handler_where_the_agents_know_the_word() -> None:
    """A job stopped whole after a fault: its survivors get SIGTERM and the grace, except one that cannot run a
    handler (its collective waits on the rank the fault took): the stop says so to agents that announce what the
    SDK can do; to older ones (an old log) the stop is written as it always was."""
    for announces in (True, False):
        s = Scenario()
        s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, spares=0, policies=NO_LIVE_STATE)
        for rank in range(4):
            s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=announces)
        s.advance(5)
        s.job_event("j", "process.exited", rank=1, attempt=0, signal=9)
        s.advance(1)
        [stop] = s.outstanding("stop_ranks")
        assert stop.mode == "graceful" and stop.ranks == [0, 2, 3]
        assert stop.stuck == ("kill" if announces else "wait")
        assert ("stuck" in stop.model_dump(mode="json")) is announces
    s = Scenario()  # not after a fault: an operator's forced restart waits for every rank
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, spares=0, policies=NO_LIVE_STATE)
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=True)
    s.job_event("j", "operator.force", granularity="restart_job", reason="driver update")
    [stop] = s.outstanding("stop_ranks")
    assert stop.mode == "graceful" and stop.stuck == "wait"


def test_a_dying_checkpoint_gives_way_to_a_newer_persistent_one() -> None:
    """A dying checkpoint is a one-off save of the step a fault reached; once the job has trained on and saved a
    newer complete checkpoint, it is just an older step. A later crash of every rank (no live state) resumes from
    the newer checkpoint, not thousands of steps back at the dying one, wherever the dying one was written."""
    for holder in ("storage", "n0"):
        s = Scenario()
        s.submit("j", ["n0", "n1"], ranks_per_node=4, dp=2, tp=4)
        s.train("j", 10)
        s.checkpoint("j", 10, "storage", "storage")
        s.train("j", 10)
        s.advance(0.5)
        s.checkpoint("j", 20, "dying", holder)  # the SIGTERM handlers' save
        for rank in range(8):
            s.job_event("j", "process.exited", rank=rank, exit_code=None, signal=15)
        s.advance(5)
        s.ack_all()
        s.advance(30)
        s.train("j", 10)
        assert s.find("incident.closed", "j")
        s.checkpoint("j", 30, "storage", "storage")
        s.train("j", 5)
        for rank in range(8):  # a dependency crash: every rank exits at once
            s.job_event("j", "process.exited", rank=rank, exit_code=1, attempt=s.engine.jobs["j"].generation)
        s.advance(5)
        s.ack_all()
        last = [d for d in s.find("checkpoint.plan", "j") if d.incident == "j#2"][-1]
        assert last.detail["checkpoint_step"] == 30, last.reason
        restart = s.commands_of("restart_ranks")[-1]
        assert restart.plan.checkpoint_step == 30 and {src.tier for src in restart.plan.shards} == {Tier.STORAGE}

"""Focused engine behaviours: generations, staleness and what a restart replaces."""

from __future__ import annotations

from recovery.scenario import Scenario

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
    assert "attempt.superseded" in s.kinds("j")
    [restart] = s.outstanding("restart_ranks")
    assert restart.ranks == [1, 5]


def test_exit_of_a_replaced_process_is_stale() -> None:
    s = restarted_rank_1()
    before = len(s.decisions)
    s.job_event("j", "process.exited", rank=1, exit_code=137, attempt=0)  # the process the restart replaced
    assert len(s.decisions) == before and not s.rejections


def test_progress_from_before_the_rollback_is_ignored() -> None:
    s = restarted_rank_1()
    s.ack_all()
    s.job_event("j", "progress.step", rank=5, step=9, attempt=0)  # in flight from before the rollback
    job = s.engine.jobs["j"]
    assert job.steps[5] == 5 and job.state == "restoring"
    s.job_event("j", "progress.step", rank=1, step=6, attempt=1)
    assert job.state == "running"

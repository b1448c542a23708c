"""Reports that cannot be true are judged by bounded, documented rules (recovery.core.progress.STEP_LEAD and the pace
rule for checkpoints), and the decision or rejection says so; survivors of a partial restart are told from stale
processes by the generation their own process started in."""

from __future__ import annotations

from recovery.core.progress import STEP_LEAD
from recovery.testing.scenario import Scenario

NO_LIVE_STATE = {"checkpoint": {"name": "newest-complete", "params": {"dying": False, "peer": False}}}


def running(ranks: int = 4, **spec: object) -> Scenario:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=ranks // 2, dp=ranks, **spec)  # type: ignore[arg-type]
    s.train("j", 20)
    return s


def test_one_corrupted_step_counter_is_corrected_by_the_next_true_report() -> None:
    s = running()
    s.job_event("j", "progress.step", rank=2, step=2**40)  # a flipped bit in one report
    for step in (21, 22, 23):
        s.advance(1)
        s.steps("j", step)
    assert not [r for r in s.rejections if r.code == "step_backwards"], s.rejections
    [corrected] = s.find("progress.corrected", "j")
    assert corrected.detail == {"rank": 2, "step": 21, "implausible": 2**40}
    assert str(STEP_LEAD) in corrected.reason
    job = s.engine.jobs["j"]
    assert job.step == 23 and job.steps == [23] * 4
    s.train("j", 90)  # far past the stall threshold: no rank is taken for stuck behind the bogus step
    assert not s.find("fault.confirmed", "j")


def test_a_step_backwards_within_the_lead_is_still_refused() -> None:
    s = running()
    s.job_event("j", "progress.step", rank=1, step=25)
    effects = s.job_event("j", "progress.step", rank=1, step=24)
    assert [e.code for e in effects] == ["step_backwards"]  # type: ignore[union-attr]


def test_a_checkpoint_far_beyond_the_jobs_progress_is_refused_and_never_the_resume_point() -> None:
    s = running(policies=NO_LIVE_STATE)
    s.checkpoint("j", 18, "storage", "storage")
    effects = s.checkpoint("j", 10**12, "storage", "storage")
    [rejection] = effects
    assert rejection.code == "implausible" and "beyond what the job can have trained" in rejection.reason  # type: ignore[union-attr]
    s.job_event("j", "process.exited", rank=0, exit_code=1)
    s.ack_all()
    [restart] = s.commands_of("restart_ranks")
    assert restart.plan.checkpoint_step == 18
    s.train("j", 2)
    assert s.state("j") == "running"


def test_a_checkpoint_ahead_by_what_the_job_trained_since_its_last_report_is_plausible() -> None:
    """Reports may be sparse: an hour without a step report, then a checkpoint 3,600 steps on at 1 s a step."""
    s = running(policies=NO_LIVE_STATE)
    s.advance(3600)
    assert s.checkpoint("j", 20 + 3600, "storage", "storage") == []


def test_a_job_may_start_from_an_older_runs_checkpoint_at_any_step() -> None:
    s = Scenario()
    s.submit("resumed", ["r0"], ranks_per_node=2, dp=2)
    assert s.checkpoint("resumed", 500_000, "storage", "storage") == []
    s.steps("resumed", 500_001)
    assert not s.rejections


def test_memory_on_a_host_declared_dead_by_the_watchdog_is_no_source() -> None:
    """Every rank of n1 falls silent: the host is gone, though nothing said it is not ready. The in-memory copy it
    held is not planned as a source; the restart reads the persistent checkpoint."""
    s = Scenario()
    s.spare("s0")
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.train("j", 10)
    s.checkpoint("j", 8, "storage", "storage")
    s.checkpoint("j", 10, "memory", "n1")
    s.idle("j", 20, ranks=[0, 1])
    [fault] = s.find("fault.confirmed", "j")
    assert fault.detail["fault"]["class"] == "node"
    s.ack_all()
    [move] = s.commands_of("migrate_ranks")
    assert move.plan.checkpoint_step == 8 and {src.tier.value for src in move.plan.shards} == {"storage"}


def test_in_place_survivors_reporting_their_own_generation_are_not_restarted() -> None:
    s = running(policies=NO_LIVE_STATE)
    s.checkpoint("j", 20, "storage", "storage")
    s.job_event("j", "process.exited", rank=3, exit_code=1)
    s.ack_all()
    job = s.engine.jobs["j"]
    assert job.rank_gen == [0, 0, 0, 1]
    for _ in range(100):
        s.advance(1)
        step = max(job.steps) + 1
        for rank in range(4):
            s.job_event("j", "process.heartbeat", rank=rank, step=step, attempt=job.rank_gen[rank])
    assert len(s.find("fault.confirmed", "j")) == 1 and s.state("j") == "running"
    assert not s.rejections


def test_a_replaced_process_reporting_its_old_generation_is_still_stale() -> None:
    s = running(policies=NO_LIVE_STATE)
    s.job_event("j", "process.exited", rank=3, exit_code=1)
    s.ack_all()
    s.train("j", 1, ranks=[3])  # the new rank 3 (generation 1) reports
    job = s.engine.jobs["j"]
    seen = job.last_seen[3]
    s.advance(1)
    s.job_event("j", "process.heartbeat", rank=3, step=999, attempt=0)  # the old rank 3 on its way out
    assert job.last_seen[3] == seen and job.steps[3] != 999

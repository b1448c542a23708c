"""Golden scenarios of the faults no exit code shows, found from what the ranks report: a straggler's compute
times, a bad step's loss (registered by `tests.golden.scenarios`)."""

from __future__ import annotations

from recovery.testing.scenario import Scenario


def _reports(s: Scenario, job: str, steps: int, slow: dict[int, float], compute_s: float = 0.2) -> None:
    """`steps` steps of a second, each node's agent folding its ranks' step and compute time into one report."""
    state = s.engine.jobs[job]
    for _ in range(steps):
        s.advance(1)
        step = state.step + 1
        for index in range(len(state.nodes)):
            ranks = range(index * state.rpn, (index + 1) * state.rpn)
            s.job_event(job, "progress.report", ranks=[
                {"rank": r, "step": step, "attempt": state.generation, "compute_s": slow.get(r, compute_s),
                 "compute_steps": 1} for r in ranks])


def straggler_drained() -> Scenario:
    """Rank 5 (on n2) computes each step in 0.5 s where its peers take 0.2 s: the job runs at its pace, with no fault
    anywhere. Once the detection policy's window of steps is measured, the node's drain is planned with the rank,
    its time and the peers' median; with no spare free the checkpoint at step 30 defers it; a spare joins, and the
    checkpoint at step 40 moves n2's ranks to it, a planned pod-level move. The moved ranks' compute times start
    a new tally, and nothing more is drained."""
    s = Scenario()
    s.submit("slow", ["n0", "n1", "n2", "n3"], ranks_per_node=2, dp=8)
    _reports(s, "slow", 30, {5: 0.5})
    s.checkpoint("slow", 30, "storage", "storage")
    s.spare("s0")
    _reports(s, "slow", 10, {5: 0.5})
    s.checkpoint("slow", 40, "storage", "storage")
    s.ack_all()
    _reports(s, "slow", 25, {})
    return s


def bad_step_rollback() -> Scenario:
    """A NaN loss (a bad batch, silent data corruption): rank 1 reports loss nan at step 23, and the all-reduce
    spreads it, so rank 0 reports nan at step 24 first (its node's report was quicker). The job rolls back once, to
    the newest checkpoint before step 23 (20; the one at 25 holds the poisoned state), every rank restarted in place,
    and the plan skips the data the script named for step 23."""
    s = Scenario()
    s.submit("lm", ["n0", "n1"], ranks_per_node=1, dp=2)
    for step in range(1, 23):
        s.advance(1)
        for rank in range(2):
            s.job_event("lm", "progress.step", rank=rank, step=step, loss=round(2.0 / step, 4))
        if step in (10, 20):
            s.checkpoint("lm", step, "storage", "storage")
    s.advance(1)
    s.job_event("lm", "progress.step", rank=0, step=23, loss=0.087)
    s.advance(0.5)
    s.job_event("lm", "progress.report", ranks=[{"rank": 0, "step": 24, "loss": "nan", "loss_step": 24}])
    s.job_event("lm", "progress.report",
                ranks=[{"rank": 1, "step": 23, "loss": "nan", "loss_step": 23, "skip": ["shard-7/batch-22"]}])
    s.checkpoint("lm", 25, "storage", "storage")  # rank 0 saved the poisoned state before the stop reached it
    s.job_event("lm", "progress.step", rank=1, step=25, loss="nan")
    s.ack_all()
    s.advance(5)
    for step in range(21, 24):
        s.advance(1)
        for rank in range(2):
            s.job_event("lm", "progress.step", rank=rank, step=step, attempt=1, loss=0.09)
    return s


ALL = (straggler_drained, bad_step_rollback)

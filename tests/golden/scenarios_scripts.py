"""Golden scenarios of real training scripts' ways: the engine's own stop, a crash of the generation it started, a
stock script that reports nothing, a crash that recurs at the same step; and an incident widened by a worse fault.
Registered by `tests.golden.scenarios`."""

from __future__ import annotations

from typing import Any

from recovery.testing.scenario import Scenario

NO_DYING: dict[str, Any] = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}
JOB_RESTARTS: dict[str, Any] = {
    **NO_DYING,
    "rescheduling": {"name": "ladder", "params": {"ladders": {
        "process": [{"granularity": "restart_job", "budget": 3, "deadline_s": 900}]}}},
}


def stop_the_job_then_crash(s: Scenario, job: str) -> None:
    """Rank 1 crashes; the job restarts whole: the engine stops ranks 0, 2 and 3 with SIGTERM, they exit by it, the
    executors restart every rank, and rank 0 of the new generation crashes before any step."""
    s.job_event(job, "process.exited", rank=1, exit_code=1, attempt=0)
    [stop] = s.outstanding("stop_ranks")
    s.advance(0.4)
    for rank in stop.ranks:  # type: ignore[attr-defined]
        s.job_event(job, "process.exited", rank=rank, exit_code=None, signal=15, attempt=0)
    s.ack(stop)
    [restart] = s.outstanding("restart_job")
    s.advance(3)
    s.ack(restart)
    s.advance(2)
    s.job_event(job, "process.exited", rank=0, exit_code=1, attempt=s.engine.jobs[job].generation)


def engine_stop_not_preemption() -> Scenario:
    """The engine's own SIGTERM before a whole-job restart is no preemption: the stopped ranks' exits are expected
    and say nothing, and the new generation's crash (rank 0, exit code 1) fails the attempt and starts the next."""
    s = Scenario()
    s.submit("ddp", ["a0", "a1"], ranks_per_node=2, dp=4, policies=JOB_RESTARTS)
    s.train("ddp", 10)
    s.checkpoint("ddp", 10, "storage", "storage")
    s.train("ddp", 3)
    stop_the_job_then_crash(s, "ddp")
    s.ack_all()
    s.advance(5)
    s.train("ddp", 2)
    return s


def stale_exit_explained() -> Scenario:
    """A process of an older generation that exits after its replacement started (it outlived an agent that lost
    track of it) is no fault of the running job, and a decision says so rather than dropping it unseen."""
    s = Scenario()
    s.spare("sp")
    s.submit("old", ["o0", "o1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("old", 10)
    s.checkpoint("old", 10, "storage", "storage")
    s.train("old", 2)
    s.node_event("o1", "device.fault", device=0, vendor="nvidia", code="79")  # ranks 2 and 3 move to the spare
    s.ack_all()
    s.advance(5)
    s.train("old", 2)
    s.job_event("old", "process.exited", rank=2, exit_code=1, attempt=0)  # the moved rank's old process, late
    s.train("old", 2)
    return s


def stock_script_restarts_whole() -> Scenario:
    """A stock torchrun script (no SDK): it sends no heartbeat and reports no step. It is never silent for that,
    however long it trains; a crash restarts the whole job from the script's own checkpoint (its survivors cannot
    join restarted peers); the incident closes once the restarted processes have run the ladder's grace period; and
    the new generation crashing within it fails that attempt rather than being dropped."""
    s = Scenario()
    s.submit("stock", ["s0", "s1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.advance(120)  # two minutes of training with nothing reported: no fault
    stop_the_job_then_crash(s, "stock")  # the first restart's processes crash within the grace period
    s.ack_all()
    s.advance(31)  # the second restart's processes run past the grace period: recovered
    s.advance(600)  # and train on, unseen and unharmed: no attempt deadline kills them
    return s


def crash_loop() -> Scenario:
    """A rank that raises at the same step on every run: each recovery resumes from the step-10 checkpoint and the
    job crashes again at step 14. After two recoveries the third crash is a loop: the job fails and says so, where
    the job-wide budgets would have restarted it dozens of times more."""
    s = Scenario()
    s.submit("loop", ["l0"], ranks_per_node=4, dp=4, policies=NO_DYING)
    s.train("loop", 10)
    s.checkpoint("loop", 10, "storage", "storage")
    for _ in range(3):
        s.train("loop", 4)
        s.job_event("loop", "process.exited", rank=1, exit_code=1, attempt=s.engine.jobs["loop"].generation)
        s.ack_all()
        s.advance(3)
    return s


def widened_for_worst_fault() -> Scenario:
    """A crash's in-place restart is under way when a GPU of the other node falls off the bus (XID 79): the incident
    widens, and its next attempt is planned for the worst fault it holds, a node fault, by the node ladder: the
    node's ranks move to a spare at once, rather than the process ladder waiting for the node to run processes."""
    s = Scenario()
    for node in ("sp0", "sp1", "sp2"):
        s.spare(node)
    s.submit("wide", ["w0", "w1"], ranks_per_node=4, dp=8, policies=NO_DYING)
    s.train("wide", 10)
    s.checkpoint("wide", 10, "storage", "storage")
    s.train("wide", 2)
    s.job_event("wide", "process.exited", rank=1, exit_code=1, attempt=0)
    s.advance(0.5)
    s.node_event("w1", "device.fault", device=2, vendor="nvidia", code="79")
    s.advance(5)
    s.ack_all()
    s.advance(10)
    s.train("wide", 2)
    return s


def double_fault_carries_restart() -> Scenario:
    """Two ranks killed 5 ms apart: the first exit's in-place restart of rank 1 is sent when rank 2's exit
    supersedes it. The next attempt carries rank 1's new process over (it joins the newest generation like a
    survivor) and restarts rank 2 alone: 2 processes started, not 3. Then a survivor, rank 3, dies while the others
    form that generation (rank 2's restart is done, its process running): again only rank 3 restarts. A carried
    restart that its agent reports failed fails the attempt that counted on it."""
    s = Scenario()
    s.submit("twice", ["t0", "t1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("twice", 10)
    s.checkpoint("twice", 10, "storage", "storage")
    s.train("twice", 3)
    gen = s.engine.jobs["twice"].generation
    s.job_event("twice", "process.exited", rank=1, exit_code=None, signal=9, attempt=gen)
    [first] = s.outstanding("restart_ranks")
    s.advance(0.005)
    s.job_event("twice", "process.exited", rank=2, exit_code=None, signal=9, attempt=gen)
    s.ack(first)  # the superseded attempt's restart is done: rank 1's new process runs
    [second] = s.outstanding("restart_ranks")
    s.ack(second)
    s.advance(0.7)
    s.job_event("twice", "process.exited", rank=3, exit_code=None, signal=9, attempt=gen)
    [third] = s.outstanding("restart_ranks")
    s.ack(third)
    s.advance(1)
    s.train("twice", 2)
    # A carried restart that fails: rank 0 dies, and rank 1 during its restart; rank 0's restart is then reported
    # failed (its node could not start it), which fails the attempt that carried it.
    gen = s.engine.jobs["twice"].generation
    s.job_event("twice", "process.exited", rank=0, exit_code=None, signal=9, attempt=gen)
    [fourth] = s.outstanding("restart_ranks")
    s.advance(0.005)
    s.job_event("twice", "process.exited", rank=1, exit_code=None, signal=9, attempt=gen)
    s.ack(fourth, status="failed", reason="exec format error")
    s.ack_all()
    s.advance(1)
    s.train("twice", 2)
    return s


ALL = (engine_stop_not_preemption, stale_exit_explained, stock_script_restarts_whole, crash_loop,
       widened_for_worst_fault, double_fault_carries_restart)

"""A step retry on real processes (the shared cluster of `tests/e2e_cluster.py`: a nats-server, a daemon, the agents,
the gloo job of `examples/dp-training`): the collectives of step 16 time out for real, every process alive, and the
job goes on with no process restarted.

The fault is real, not raised by hand: rank 3 enters the all_reduce of step 16 the group's timeout (4 s) plus 2 s late
(`--collective-timeout-at-step 15`: the 0-based index of the step), so the other ranks' gloo collectives time out
("Timed out waiting ... for recv operation to complete") while rank 3 lives and heartbeats. The SDK of the first rank
to time out reports `process.collective_failed`; every rank is alive, so the detection policy calls it a network
fault of the job and the ladder's first rung is `retry`: a new generation with no process restarted. The agents ask
the job store for generation 1, which wakes every rank waiting in `recover()` (rank 3 is freed by the first
rank's marking the group failed); each forms generation 1's group in its own process and trains step 16 again."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

from recovery.client.torch import TIMED_OUT
from tests.e2e_cluster import STEPS, Cluster, assert_bitwise_equal, run_job

LATE_STEP = 15  # the step's index in the loop: it is the 16th step, reported as step 16 once done
GROUP_TIMEOUT_S = 4.0


async def test_a_collective_timeout_with_every_rank_alive_retries_the_step_in_a_new_generation_with_no_restart(
        shared_cluster: Cluster, shared_fault_free: dict[str, Any]) -> None:
    cluster = shared_cluster
    job = "retry-collective"
    begun = time.monotonic()
    w, params = await run_job(cluster, job, args=["--group-timeout-s", str(GROUP_TIMEOUT_S),
                                                  "--collective-timeout-at-step", str(LATE_STEP)])

    def explain() -> str:
        decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
        return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n--- events:\n{w.story()}\n" \
            f"{cluster.explain(job)}"

    # No process restarted: each rank ran in one process, started once.
    assert sorted(w.pids()) == [0, 1, 2, 3] and all(len(p) == 1 for p in w.pids().values()), explain()
    # A live rank's collective timed out, in the first generation, at the step rank 3 was late for.
    reports = w.of("process.collective_failed")
    assert reports, explain()
    assert {(e["data"]["attempt"], e["data"]["step"]) for e in reports} == {(0, LATE_STEP + 1)}, reports
    assert all(any(said in e["data"]["error"] for said in TIMED_OUT) for e in reports), reports
    assert 3 not in {e["data"]["rank"] for e in reports}  # the late rank was freed by the others, not timed out
    # One incident, closed by a retry: a new generation (1) in which the same processes train the step again.
    [retry] = [c for d in w.decisions for c in d["data"]["commands"] if c["kind"] == "retry_step"]
    assert (retry["attempt"], retry["step"]) == (1, LATE_STEP + 1), explain()
    restarts = {"stop_ranks", "restart_ranks", "migrate_ranks", "restart_job", "scale_job"}
    assert not [c for d in w.decisions for c in d["data"]["commands"] if c["kind"] in restarts], explain()
    [closed] = w.decided("incident.closed")
    assert (closed["data"]["detail"]["granularity"], closed["data"]["detail"]["lost_steps"]) == ("retry", 0)
    assert [d["data"]["detail"]["granularity"] for d in w.decided("attempt.started")] == ["retry"], explain()
    # The step was done again and none lost or doubled: in generation 0 no rank completed step 16; in generation 1
    # every rank resumes at 15 (its first heartbeats carry the last step done), never below, and its steps only go up
    # to the end (the agent's fold sends each period's newest word, so not every step shows); the incident closed on
    # progress past 15 in generation 1. Adam's state after 40 steps would differ from the fault-free run's had a step
    # been skipped or applied twice (below).
    for rank in range(4):
        steps = [(e["data"]["attempt"], e["data"]["step"]) for e in w.of("progress.step") if e["data"]["rank"] == rank]
        assert max(s for a, s in steps if a == 0) == LATE_STEP, (rank, steps)
        again = [s for a, s in steps if a == 1]
        assert min(again) >= LATE_STEP and again[-1] == STEPS, (rank, steps)
        assert all(b >= a for a, b in pairwise(again)), (rank, steps)
    assert f"past resume point {LATE_STEP}" in closed["data"]["reason"], closed
    # Every step done once in the end: the parameters of the run without faults, bit for bit.
    assert_bitwise_equal(params, shared_fault_free)
    opened = next(d["_seen"] for d in w.decided("fault.confirmed"))
    print(f"retry: {len(reports)} timeout report(s); incident closed {closed['_seen'] - opened:.2f} s after the "
          f"fault; mttr (log) {closed['data']['detail']['mttr_ns'] / 1e9:.2f} s; test {time.monotonic() - begun:.1f} s")

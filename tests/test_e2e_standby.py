"""A warm standby on real processes: the session's shared cluster (`tests/e2e_cluster.py`: a nats-server, a
`recovery-daemon`, the agents, whose standbys start with a job that opts in) and the 4-way gloo job of
`examples/dp-training`, the job opted in with `RECOVERY_STANDBY=1` in its entrypoint's environment. A SIGKILLed rank
is handed to the node's standby (an interpreter that had imported torch) instead of a new one, the three others keep
their processes, and the job ends with the parameters of the session's run without faults, bit for bit: the same as
a cold restart gives (tests/test_e2e_recovery.py)."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

from tests.e2e_cluster import STEPS, Cluster, assert_bitwise_equal
from tests.e2e_support import JobWatch, connect, free_port, job_spec, submit, wait_until, watch

NODES = ["n0", "n1"]
STEP_TIME_S = 0.4  # a job long enough for its standbys to be ready before the fault, on a loaded machine too
FAULT_AT_STEP = 10
VICTIM = 2  # on n1


def standby_pids(cluster: Cluster, node: str, job: str) -> set[int]:
    """The standbys the node's agent reported ready for the job."""
    log = (cluster.workdir / node / "agent.log").read_text(errors="replace")
    return {int(pid) for pid in re.findall(rf"standby of {re.escape(job)} ready \(pid (\d+)", log)}


async def run_job(cluster: Cluster, job: str) -> tuple[JobWatch, dict[str, Any]]:
    """The job opted in to standbys: once n1's is ready and every rank passed FAULT_AT_STEP, rank VICTIM is
    SIGKILLed; returns what was seen and the final parameters."""
    import torch

    out = cluster.workdir / f"{job}.pt"
    nc = await connect(cluster.nats.url)
    try:
        w = await watch(nc, job)

        def explain() -> str:
            decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
            return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n{cluster.explain(job)}"

        spec = job_spec(out, STEPS, STEP_TIME_S, NODES, free_port())
        spec["entrypoint"]["env"]["RECOVERY_STANDBY"] = "1"
        # at full speed from the start: on a host the suite keeps busy, a standby on idle CPU time alone would be
        # ready only once `standby_idle_s` passed, maybe after the job's last step (this test is of the hand-over)
        spec["entrypoint"]["env"]["RECOVERY_STANDBY_IDLE"] = "0"
        await submit(nc, job, spec)
        try:
            await wait_until(lambda: bool(standby_pids(cluster, "n1", job)), 120, f"{job}'s standby on n1", explain)
            await wait_until(lambda: all(w.step(r) >= FAULT_AT_STEP for r in range(4)), 60,
                             f"{job} to train {FAULT_AT_STEP} steps", explain)
            step = max(w.step(r) for r in range(4))
            assert step < STEPS - 8, "the job ended too soon after its standby was ready to test a hand-over"
            killed = time.monotonic()
            os.kill(w.pids()[VICTIM][-1], signal.SIGKILL)

            def recovered() -> bool:
                return any(e["data"]["rank"] == VICTIM and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                           and e["_seen"] > killed for e in w.of("progress.step"))

            await wait_until(recovered, 60, f"rank {VICTIM} to be recovered", explain)
            await wait_until(lambda: "job.completed" in w.kinds() and out.exists(), 120, f"{job} to complete",
                             explain)
        finally:
            cluster.started.extend(pid for pids in w.pids().values() for pid in pids)
    finally:
        await nc.close()
    return w, torch.load(out)


async def test_a_sigkilled_rank_handed_to_the_warm_standby_ends_as_a_fault_free_run(
        shared_cluster: Cluster, shared_fault_free: dict[str, Any]) -> None:
    cluster = shared_cluster
    # the session's fault-free job did not opt in: it had no standby
    assert not standby_pids(cluster, "n1", "shared-fault-free")
    w, params = await run_job(cluster, "warm")
    pids = w.pids()
    assert len(pids[VICTIM]) == 2, pids  # restarted once
    assert pids[VICTIM][1] in standby_pids(cluster, "n1", "warm"), (pids, standby_pids(cluster, "n1", "warm"))
    assert all(len(pids[r]) == 1 for r in range(4) if r != VICTIM), pids  # the others kept their processes
    assert w.kinds().count("incident.closed") == 1
    assert_bitwise_equal(params, shared_fault_free)

"""Elastic training on real processes (the shared cluster of `tests/e2e_cluster.py`, with agents of this module's own:
e0 and e1 run the job, e2 joins later). The job is the 4-way data-parallel gloo job of `examples/dp-training`, elastic
within dp 2..4, taking spares only from a pool of its own (`spare_pool`), so the cluster's shared spares stay free for
the other modules.

e1 is lost (its agent and its ranks SIGKILLed) and no spare of the job's pool is free: the job scales in to 2 ranks.
e0's processes keep their PIDs and train on in the smaller world, each accumulating two micro-batches a step (the
global batch of 4 stays). Then e2 joins the job's pool: the job scales out to 4, e2's new ranks taking the state from
e0's. No step is lost or trained twice, and the final parameters equal those one process computes for the same
schedule of world sizes (`train.py --reference-schedule`, the same math as the job's `--ordered-reduction`)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import torch

from tests.e2e_cluster import SPARES, Cluster, assert_bitwise_equal
from tests.e2e_support import (
    ROOT,
    TRAIN,
    AgentProcess,
    JobWatch,
    connect,
    environment,
    kill_leftovers,
    stop_agents,
    submit,
    wait_until,
    watch,
)

JOB = "elastic"
POOL = "elastic-e2e"
STEPS = 50
STEP_TIME_S = 0.3  # slow enough that the job is still at 2 ranks when e2's agent has started (seconds on a busy host)
LOSS_AT_STEP = 5
AGENT_ARGS = ("--report-s", "0")  # every step its own event: the test sees each step of each generation


def spec(out: str, store_port: int) -> dict[str, Any]:
    return {
        "nodes": ["e0", "e1"], "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": 1.0,
        "elastic": {"min_dp": 2, "max_dp": 4}, "spare_pool": POOL,
        "policies": {"detection": {"name": "default",
                                   "params": {"hang_min_silence_s": 5.0, "agent_silence_s": 3.0}}},
        "entrypoint": {"command": sys.executable,
                       "args": [str(TRAIN), "--steps", str(STEPS), "--step-time", str(STEP_TIME_S), "--out", out,
                                "--ordered-reduction"],
                       "cwd": str(ROOT), "rendezvous": "external",
                       "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": environment()["PYTHONPATH"]}},
    }


def steps_by_generation(w: JobWatch) -> dict[int, dict[int, set[int]]]:
    """generation -> rank -> the steps it reported in it."""
    found: dict[int, dict[int, set[int]]] = {}
    for e in w.of("progress.step"):
        found.setdefault(e["data"]["attempt"], {}).setdefault(e["data"]["rank"], set()).add(e["data"]["step"])
    return found


async def test_an_elastic_job_scales_in_without_a_spare_keeping_its_survivors_and_out_when_a_node_joins(
        shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    out = cluster.workdir / f"{JOB}.pt"
    agents = {name: AgentProcess(cluster.workdir, name, cluster.nats.url, False, *AGENT_ARGS) for name in ("e0", "e1")}
    cluster.extra.extend(agents.values())
    nc = await connect(cluster.nats.url)
    w: JobWatch | None = None
    try:
        ready: set[str] = set()

        async def on_node(msg: Any) -> None:
            ready.add(msg.subject.split(".")[3])

        await nc.subscribe("recovery.ev.node.>", cb=on_node)
        await wait_until(lambda: {"e0", "e1"} <= ready, 60, "e0 and e1 to report their nodes", cluster.explain)
        w = await watch(nc, JOB)
        job_watch = w

        def explain() -> str:
            decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in job_watch.decisions]
            return f"--- decisions of {JOB}: {decisions}\n--- pids: {job_watch.pids()}\n{cluster.explain()}"

        def scales() -> list[dict[str, Any]]:
            return [c for d in job_watch.decided("ranks.rescheduling") for c in d["data"]["commands"]
                    if c["kind"] == "scale_job"]

        def trained_in(generation: int, ranks: range) -> bool:
            done = steps_by_generation(job_watch).get(generation, {})
            return all(done.get(rank) for rank in ranks)

        started = time.monotonic()
        await submit(nc, JOB, spec(str(out), cluster.store.port))  # the job store off the nodes: e1 may go
        await wait_until(lambda: all(job_watch.step(r) >= LOSS_AT_STEP for r in range(4)), 120,
                         f"{JOB} to train {LOSS_AT_STEP} steps", explain)
        survivors = {r: job_watch.pids()[r][-1] for r in (0, 1)}

        # e1 is lost: its agent and its ranks together, as a host that is gone
        lost = [job_watch.pids()[r][-1] for r in (2, 3)]
        killed = time.monotonic()
        agents["e1"].proc.kill()
        kill_leftovers(lost)
        await wait_until(lambda: trained_in(1, range(2)), 90, "e0's ranks to train on in a world of 2", explain)
        scaled_in = time.monotonic()

        # e2 joins the job's pool: the job grows back to 4
        joined = time.monotonic()
        agents["e2"] = AgentProcess(cluster.workdir, "e2", cluster.nats.url, True, "--pool", POOL, *AGENT_ARGS)
        cluster.extra.append(agents["e2"])
        await wait_until(lambda: trained_in(2, range(4)), 120, "the job to train on 4 ranks again", explain)
        scaled_out = time.monotonic()
        await wait_until(lambda: "job.completed" in job_watch.kinds() and out.exists(), 120, f"{JOB} to complete",
                         explain)
        finished = time.monotonic()

        # The engine's decisions: in to 2 on e0 keeping its processes, out to 4 on e0 and e2 keeping them again
        scale_in, scale_out = scales()
        assert (scale_in["dp"], scale_in["nodes"], scale_in["kept"]) == (2, ["e0"], [0, 1]), scales()
        assert (scale_out["dp"], scale_out["nodes"], scale_out["kept"]) == (4, ["e0", "e2"], [0, 1]), scales()
        assert not [c for d in job_watch.decisions for c in d["data"].get("commands", [])
                    if c["kind"] == "migrate_ranks" or set(c.get("nodes", ())) & {s.split("@")[1] for s in SPARES}]
        # The survivors kept their PIDs through both scales; e2's ranks are new processes of generation 2
        pids = job_watch.pids()
        assert {r: pids[r] for r in (0, 1)} == {r: [pid] for r, pid in survivors.items()}, pids
        assert all(len(pids[r]) == 2 for r in (2, 3)), pids
        e2_started = [e for e in job_watch.of("process.started") if e["source"] == "agent@e2"]
        assert sorted((e["data"]["rank"], e["data"]["attempt"]) for e in e2_started) == [(2, 2), (3, 2)]
        # Every step trained once. A generation goes on from the last step of the one before (which its ranks'
        # heartbeats may say again: a heartbeat carries the last step), never from an earlier one, and every step
        # is reported; that none was trained twice or skipped, the parameters below show (one update more or less
        # and they differ from the reference).
        by_generation = steps_by_generation(job_watch)
        assert sorted(by_generation) == [0, 1, 2], by_generation.keys()
        assert sorted(by_generation[1]) == [0, 1] and sorted(by_generation[2]) == [0, 1, 2, 3]
        spans = {g: (min(min(s) for s in ranks.values()), max(max(s) for s in ranks.values()))
                 for g, ranks in by_generation.items()}
        assert spans[0][0] == 1 and spans[2][1] == STEPS, spans
        assert spans[0][1] <= spans[1][0] <= spans[0][1] + 1 and spans[1][1] <= spans[2][0] <= spans[1][1] + 1, spans
        assert set().union(*(s for ranks in by_generation.values() for s in ranks.values())) == \
            set(range(1, STEPS + 1))
        closed = job_watch.decided("incident.closed")
        assert [d["data"]["detail"]["granularity"] for d in closed] == ["scale_in", "scale_out"]
        assert [d["data"]["detail"]["lost_steps"] for d in closed] == [0, 0]
    finally:
        if w is not None:
            cluster.started.extend(pid for pids in w.pids().values() for pid in pids)
        await nc.close()
        stop_agents(agents.values())

    # The reference: one process, the same schedule of world sizes, the same math
    schedule = f"4@1,2@{spans[0][1] + 1},4@{spans[1][1] + 1}"  # world 2 from the first step after generation 0
    reference = cluster.workdir / f"{JOB}-reference.pt"
    proc = subprocess.Popen([sys.executable, str(TRAIN), "--steps", str(STEPS), "--ordered-reduction",
                             "--reference-schedule", schedule, "--out", str(reference)], cwd=ROOT,
                            env={**environment(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")
    assert_bitwise_equal(torch.load(out), torch.load(reference))
    print(f"elastic: schedule {schedule}; node loss to training on 2 ranks {scaled_in - killed:.1f}s, agent start "
          f"to training on 4 ranks {scaled_out - joined:.1f}s, job {finished - started:.1f}s; pids {pids}")

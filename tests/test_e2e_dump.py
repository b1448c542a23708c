"""Dump before acting, on real processes (the shared cluster of `tests/e2e_cluster.py`: a nats-server, a daemon, the
agents, the gloo job of `examples/dp-training`): rank 2's data loader blocks at step 15 while ranks 0, 1 and 3 wait
for it in their all_reduce. The watchdog finds the stall; before any process is stopped every node's agent takes its
ranks' stacks with py-spy; the job recovers and completes; and `recovery-replay report` names rank 2 and the frame
it is stuck in, against the three others' all_reduce."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.e2e_cluster import Cluster, run_job
from tests.e2e_support import environment

STUCK_RANK = 2
STUCK_AT = 15


async def test_a_rank_stuck_in_its_data_loader_is_named_by_the_stacks_taken_before_the_restart(
        shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    job = "stuck-loader"
    detection: dict[str, Any] = {"hang_min_silence_s": 30.0, "agent_silence_s": 3.0, "stall_min_s": 3.0,
                                 "stall_factor": 10.0}
    w, _ = await run_job(cluster, job, detection=detection,
                         args=["--stall-rank", str(STUCK_RANK), "--stall-at-step", str(STUCK_AT)])

    def explain() -> str:
        return f"--- decisions of {job}: {[d['data']['kind'] for d in w.decisions]}\n{cluster.explain()}"

    stacks = w.of("process.stacks")
    assert len(stacks) == 2, explain()  # one per node, every live rank in it
    assert sorted(s["rank"] for e in stacks for s in e["data"]["ranks"]) == [0, 1, 2, 3]
    assert not [s["error"] for e in stacks for s in e["data"]["ranks"] if s.get("error")]
    # taken before the stop: each process dumped is the one that was running when the hang was found
    first = {rank: pids[0] for rank, pids in w.pids().items()}
    assert all(s["pid"] == first[s["rank"]] for e in stacks for s in e["data"]["ranks"]), (stacks, w.pids())

    report = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "report", "--nats", cluster.nats.url,
                             "--job", job, "--json"], capture_output=True, env=environment(), timeout=120, check=True)
    [incident] = json.loads(report.stdout)["jobs"][0]["incidents"]
    odd = incident["stacks"]["odd"]
    assert [o["ranks"] for o in odd] == [[STUCK_RANK]], incident["stacks"]
    assert "load_batch (train.py:" in odd[0]["frame"], incident["stacks"]  # main.<locals>.load_batch
    assert incident["stacks"]["groups"][0]["ranks"] == [0, 1, 3]
    text = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "report", "--nats", cluster.nats.url,
                           "--job", job], capture_output=True, env=environment(), timeout=120, check=True)
    assert f"stacks: rank(s) {STUCK_RANK} stand out, in main.<locals>.load_batch (train.py:" in text.stdout.decode()
    print(f"stacks: odd {odd}; the others in {incident['stacks']['groups'][0]['frame']}")

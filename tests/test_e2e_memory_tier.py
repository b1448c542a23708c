"""The in-memory checkpoint tier on real processes (MindIO ACP), on the shared cluster of `tests/e2e_cluster.py`: the
gloo job of `examples/dp-training` with `--save-async-every`, every rank copying its state into its node agent's
shared memory, rank 0's agent persisting it to storage in the background. With the `peer` tier and dying checkpoints
off, the plan chooses between memory and storage: a SIGKILLed rank restarts in place and loads the memory copy on
its own node, and the job ends as the fault-free run did; the memory is gone once the job is."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recovery.agent.memory import memory_root
from tests.e2e_cluster import Cluster, assert_bitwise_equal, run_job
from tests.e2e_support import JobWatch, wait_until

VICTIM = 2  # on n1, with rank 3
SAVE_EVERY = 5


def saved(w: JobWatch, tier: str) -> list[int]:
    """The steps of the job's checkpoints reported in `tier`."""
    return sorted({e["data"]["step"] for e in w.of("checkpoint.saved") if e["data"]["tier"] == tier})


async def test_a_sigkilled_rank_restarts_in_place_from_its_nodes_memory_checkpoint(
        shared_cluster: Cluster, shared_fault_free: dict[str, Any]) -> None:
    cluster = shared_cluster
    job = "memory-tier"
    storage = cluster.workdir / f"{job}-storage"
    memory = {node: memory_root(Path("/dev/shm"), node, cluster.workdir / node) / job for node in ("n0", "n1")}
    killed_after: list[int] = []

    async def sigkill_after_a_memory_checkpoint(w: JobWatch, explain: Callable[[], str]) -> None:
        def on_both_nodes() -> list[int]:
            holders: dict[int, set[str]] = {}
            for e in w.of("checkpoint.saved"):
                if e["data"]["tier"] == "memory":
                    holders.setdefault(e["data"]["step"], set()).add(e["data"]["holder"])
            return sorted(step for step, nodes in holders.items() if nodes >= set(memory))

        await wait_until(lambda: bool(on_both_nodes()), 60, "a memory checkpoint on both nodes", explain)
        killed_after.append(on_both_nodes()[-1])
        assert all(d.is_dir() for d in memory.values()), memory  # the agents' shared memory, while the job runs
        os.kill(w.pids()[VICTIM][-1], signal.SIGKILL)
        await wait_until(lambda: w.kinds().count("incident.closed") == 1, 90, f"rank {VICTIM} to be recovered",
                         explain)

    w, params = await run_job(cluster, job, sigkill_after_a_memory_checkpoint,
                              checkpoint={"peer": False, "dying": False},
                              args=["--save-async-every", str(SAVE_EVERY), "--checkpoint-dir", str(storage)])

    def explain() -> str:
        return f"--- decisions of {job}: {[d['data']['kind'] for d in w.decisions]}\n{cluster.explain()}"

    pids = w.pids()
    assert len(pids[VICTIM]) == 2 and all(len(pids[r]) == 1 for r in range(4) if r != VICTIM), pids
    # both tiers reported: every rank's copy in memory, rank 0's persisted by its agent
    assert saved(w, "memory") and saved(w, "storage"), explain()
    assert set(saved(w, "storage")) <= set(saved(w, "memory")), explain()
    holders = {e["data"]["holder"] for e in w.of("checkpoint.saved") if e["data"]["tier"] == "memory"}
    assert holders == {"n0", "n1"}, holders
    # the plan of the in-place restart names the memory tier, this node among its holders
    [restart] = [c for d in w.decided("ranks.rescheduling") for c in d["data"]["commands"]]
    assert restart["kind"] == "restart_ranks" and restart["ranks"] == [VICTIM], restart
    plan = restart["plan"]
    [source] = plan["shards"]
    assert source["tier"] == "memory" and "n1" in source["holders"], plan
    step = plan["checkpoint_step"]
    assert step >= killed_after[0] and step % SAVE_EVERY == 0, (plan, killed_after)
    # and the restarted process read it from its own node's shared memory
    log = (cluster.workdir / "n1" / f"{job}.rank{VICTIM}.gen1.log").read_text(errors="replace")
    assert f"resumed from the memory checkpoint of step {step}: {memory['n1']}/" in log, log[-2000:]
    assert (storage / f"step{step:09d}.shard0.mem").exists()
    assert_bitwise_equal(params, shared_fault_free)
    # the memory went with the job, on every node
    await wait_until(lambda: not any(d.exists() for d in memory.values()), 30, "the job's memory to be removed",
                     explain)

"""A straggler on real processes (the shared cluster of `tests/e2e_cluster.py`): the gloo job of `examples/dp-training`
runs on two agents of this module's own (sg0, sg1), and rank 3 (on sg1) computes 0.2 s longer every step. Nothing
fails: every rank only waits for it in the all_reduce. The ranks' compute times (from a step's start to its
collective) reach the engine in the agents' progress reports; the detection policy plans sg1's drain naming rank 3
and its time against the peers' median; at the next complete checkpoint the ranks of sg1 move to a free spare; the
job completes with the parameters of the fault-free run, bit for bit.

The spare the move takes is one of the shared cluster's: once the job is done it is announced again as a free spare
(as its agent announces itself when it starts), so that the cluster is left as it was found."""

from __future__ import annotations

import time
from typing import Any

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from tests.e2e_cluster import Cluster, assert_bitwise_equal, run_job
from tests.e2e_support import AgentProcess, connect, wait_until

SLOW_RANK = 3
SLOW_S = 0.2


async def _own_nodes(cluster: Cluster, names: list[str]) -> None:
    """Start an agent per name (stopped with the cluster) and wait until each has reported its node."""
    nc = await connect(cluster.nats.url)
    heard: set[str] = set()

    async def on_node(msg: Any) -> None:
        heard.add(msg.subject.split(".")[3])

    try:
        for name in names:
            await nc.subscribe(f"recovery.ev.node.{name}.>", cb=on_node)
        cluster.extra.extend(AgentProcess(cluster.workdir, name, cluster.nats.url) for name in names)
        await wait_until(lambda: heard >= set(names), 60, f"the agents of {names} to report their nodes",
                         cluster.explain)
    finally:
        await nc.close()


async def _announce_spare(cluster: Cluster, node: str, cause: str) -> None:
    """`node` is a free spare again, as its agent says when it starts."""
    nc = await connect(cluster.nats.url)
    try:
        envelope = make_envelope("node.joined", {"spare": True, "devices": 8}, id=f"{node}:joined-after:{cause}",
                                 node=node, source="test")
        await nc.jetstream().publish(subjects.node_event(node, "node.joined"), encode_envelope(envelope),
                                     headers={"Nats-Msg-Id": envelope.id})
    finally:
        await nc.close()


async def test_a_rank_slower_than_its_peers_has_its_node_drained_to_a_spare_and_the_job_ends_as_the_fault_free_run(
        shared_cluster: Cluster, shared_fault_free: dict[str, Any]) -> None:
    cluster = shared_cluster
    await _own_nodes(cluster, ["sg0", "sg1"])
    job = "straggler-drained"
    detection = {"hang_min_silence_s": 5.0, "agent_silence_s": 3.0, "straggler_window_steps": 8}
    started = time.monotonic()
    w, params = await run_job(cluster, job, nodes=["sg0", "sg1"], detection=detection,
                              args=["--slow-rank", str(SLOW_RANK), "--slow-s", str(SLOW_S), "--checkpoint-every", "5",
                                    "--checkpoint-dir", str(cluster.workdir / f"{job}-checkpoints")])
    moves = [c for d in w.decisions for c in d["data"]["commands"] if c["kind"] == "migrate_ranks"]
    for move in moves:  # first, so that a failed assertion below leaves the shared spare as it was found, too
        await _announce_spare(cluster, move["to_node"], job)

    def explain() -> str:
        return f"--- decisions of {job}: {[(d['data']['kind'], d['data']['reason']) for d in w.decisions]}"

    [planned] = w.decided("node.drain_planned")
    detail = planned["data"]["detail"]
    assert (detail["node"], detail["code"], detail["rank"]) == ("sg1", "straggler", SLOW_RANK), explain()
    # The injected 0.2 s stands out against the peers' few ms: the mean is over at least the window's 8 steps.
    assert detail["compute_s"] >= SLOW_S and detail["peers_median_s"] < SLOW_S / 2 and detail["steps"] >= 8
    [move] = moves
    assert move["from_node"] == "sg1" and sorted(move["ranks"]) == [2, 3], explain()
    assert move["to_node"] not in ("sg0", "sg1")
    [closed] = w.decided("incident.closed")
    assert closed["data"]["detail"]["granularity"] == "migrate" and closed["data"]["detail"]["lost_steps"] == 0
    assert "job.completed" in w.kinds() and not w.decided("fault.confirmed"), explain()
    # sg0's ranks kept their processes; sg1's were started again on the spare
    assert [len(w.pids()[r]) for r in range(4)] == [1, 1, 2, 2], w.pids()
    assert_bitwise_equal(params, shared_fault_free)
    print(f"straggler: {planned['data']['reason']}; moved {move['from_node']} -> {move['to_node']}; "
          f"job done in {time.monotonic() - started:.1f}s")

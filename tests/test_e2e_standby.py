"""A warm standby on real processes: a nats-server, a `recovery-daemon`, a `recovery-agent` per node and the 4-way
gloo job of `examples/dp-training`, the job opted in with `RECOVERY_STANDBY=1` in its entrypoint's environment.
A SIGKILLed rank is handed to the node's standby (an interpreter that had imported torch) instead of a new one,
the three others keep their processes, and the job ends with the parameters of a run without faults, bit for bit:
the same as a cold restart gives (tests/test_e2e_recovery.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess
from tests.e2e_support import (
    AgentProcess,
    JobWatch,
    connect,
    free_port,
    job_spec,
    kill_leftovers,
    submit,
    wait_until,
    watch,
)

NODES = ["n0", "n1"]
STEPS = 200
STEP_TIME_S = 0.05  # long enough a job for its standbys to be ready before the fault, on a loaded machine too
FAULT_AT_STEP = 10
VICTIM = 2  # on n1


@dataclass
class Cluster:
    nats: NatsServer
    daemon: DaemonProcess
    agents: list[AgentProcess]
    workdir: Path
    started: list[int]

    def explain(self) -> str:
        return "\n".join(f"--- agent {a.node}:\n{a.log_tail()}" for a in self.agents) + \
            f"\n--- daemon:\n{self.daemon.log_tail()}"

    def standby_pids(self, node: str, job: str) -> set[int]:
        """The standbys the node's agent reported ready for the job."""
        log = (self.workdir / node / "agent.log").read_text(errors="replace")
        return {int(pid) for pid in re.findall(rf"standby of {re.escape(job)} ready \(pid (\d+)", log)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("e2e-standby")
    server = NatsServer(workdir / "nats")
    server.start()
    daemon = DaemonProcess(workdir / "daemon", server.url, lease_ttl_s=0, snapshot_fork=False)
    agents: list[AgentProcess] = []
    state = Cluster(server, daemon, agents, workdir, [])
    try:
        daemon.start(PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        daemon.wait_ready()
        with pytest.MonkeyPatch.context() as patch:
            # The agents' setting (environment variables are one of its sources): the standby starts with the job.
            patch.setenv("RECOVERY_AGENT_STANDBY_DELAY_S", "0")

            async def start_agents() -> None:
                nc = await connect(server.url)
                ready: set[str] = set()

                async def on_node(msg: Any) -> None:
                    ready.add(msg.subject.split(".")[3])

                await nc.subscribe("recovery.ev.node.>", cb=on_node)
                agents.extend(AgentProcess(workdir, node, server.url) for node in NODES)
                await wait_until(lambda: ready >= set(NODES), 30, "the agents to report their nodes", state.explain)
                await nc.close()

            asyncio.run(start_agents())
        yield state
    finally:
        for agent in agents:
            agent.stop()
        kill_leftovers(state.started)
        daemon.close()
        server.stop()


async def run_job(cluster: Cluster, job: str, step_time: float, standby: bool,
                  kill: bool) -> tuple[JobWatch, dict[str, Any]]:
    import torch

    out = cluster.workdir / f"{job}.pt"
    nc = await connect(cluster.nats.url)
    try:
        w = await watch(nc, job)

        def explain() -> str:
            decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
            return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n{cluster.explain()}"

        spec = job_spec(out, STEPS, step_time, NODES, free_port())
        if standby:
            spec["entrypoint"]["env"]["RECOVERY_STANDBY"] = "1"
        await submit(nc, job, spec)
        try:
            if kill:
                await wait_until(lambda: bool(cluster.standby_pids("n1", job)), 120, f"{job}'s standby on n1",
                                 explain)
                await wait_until(lambda: all(w.step(r) >= FAULT_AT_STEP for r in range(4)), 60,
                                 f"{job} to train {FAULT_AT_STEP} steps", explain)
                step = max(w.step(r) for r in range(4))
                assert step < STEPS - 20, "the job ended too soon after its standby was ready to test a hand-over"
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


async def test_a_sigkilled_rank_handed_to_the_warm_standby_ends_as_a_fault_free_run(cluster: Cluster) -> None:
    import torch

    _, reference = await run_job(cluster, "fault-free", 0.0, standby=False, kill=False)
    assert not cluster.standby_pids("n1", "fault-free")  # not opted in: no standby
    w, params = await run_job(cluster, "warm", STEP_TIME_S, standby=True, kill=True)
    pids = w.pids()
    assert len(pids[VICTIM]) == 2, pids  # restarted once
    assert pids[VICTIM][1] in cluster.standby_pids("n1", "warm"), (pids, cluster.standby_pids("n1", "warm"))
    assert all(len(pids[r]) == 1 for r in range(4) if r != VICTIM), pids  # the others kept their processes
    assert w.kinds().count("incident.closed") == 1
    assert params.keys() == reference.keys()
    for name in params:
        assert torch.equal(params[name], reference[name]), f"{name} differs from the fault-free run"

"""The end-to-end cluster on real processes: a nats-server, a `recovery-daemon`, a rendezvous store, four
`recovery-agent`s (n0-n3) and four spares (spare0-spare3), and `run_job`, which trains the 4-way data-parallel job
of `examples/dp-training` on it with gloo and strikes a fault once every rank passed FAULT_AT_STEP.

`start_cluster` gives one to a module whose tests consume it (`tests/test_e2e_recovery.py` kills agents for good);
the session fixture `shared_cluster` (in `tests/conftest.py`) gives one to every module whose tests leave the nodes
as they found them, and `shared_fault_free` the parameters of its fault-free run, so that the cluster and the
reference run are paid for once."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess
from tests.e2e_support import (
    AgentProcess,
    JobWatch,
    RendezvousProcess,
    connect,
    free_port,
    job_spec,
    kill_leftovers,
    stop_agents,
    submit,
    wait_until,
    watch,
)

NODES = ["n0", "n1"]
STEPS = 40
STEP_TIME_S = 0.05
FAULT_AT_STEP = 10
SPARES = {f"agent@spare{i}" for i in range(4)}


@dataclass
class Cluster:
    nats: NatsServer
    daemon: DaemonProcess
    agents: list[AgentProcess]
    workdir: Path
    started: list[int]
    store: RendezvousProcess
    extra: list[AgentProcess] = field(default_factory=list)

    def agent(self, node: str) -> AgentProcess:
        return next(a for a in self.agents if a.node == node)

    def explain(self, job: str | None = None) -> str:
        """The agents' and the daemon's last lines; with `job`, also the tail of each of its processes' output."""
        outputs = "" if job is None else "".join(
            f"\n--- {path.parent.name}/{path.name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-8:])
            for a in [*self.agents, *self.extra] for path in sorted(a.workdir.glob(f"{job}.rank*.gen*.log")))
        return "\n".join(f"--- agent {a.node}:\n{a.log_tail()}" for a in [*self.agents, *self.extra]) + \
            f"\n--- daemon:\n{self.daemon.log_tail()}" + outputs


@contextmanager
def start_cluster(workdir: Path) -> Iterator[Cluster]:
    """A cluster in `workdir`; every process it started (and every training process a job of it started) is
    stopped by its PID on the way out, also when the body failed."""
    server = NatsServer(workdir / "nats")
    server.start()
    daemon = DaemonProcess(workdir / "daemon", server.url, lease_ttl_s=0, snapshot_fork=False)
    agents: list[AgentProcess] = []
    store = RendezvousProcess(workdir / "rendezvous")
    state = Cluster(server, daemon, agents, workdir, [], store)
    try:
        daemon.start(PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        daemon.wait_ready()
        store.wait_ready()

        async def start_agents() -> None:
            nc = await connect(server.url)
            ready: set[str] = set()

            async def on_node(msg: Any) -> None:
                ready.add(msg.subject.split(".")[3])

            await nc.subscribe("recovery.ev.node.>", cb=on_node)
            # n2, n3 and four spares for the scenarios that move ranks: a preemption moves both nodes of its job
            # (n1's agent stops), a node loss one (n0), an agent's loss one (n3)
            # A job that opts in (`RECOVERY_STANDBY=1`, tests/test_e2e_standby.py) has its standbys start with it;
            # the others have none.
            # n1 with the agent's own preemption linger: the preemption scenario stops n1's agent, and its engine
            # addresses n1 after that (the others end once their ranks are stopped, at the cluster's end)
            agents.extend([AgentProcess(workdir, name, server.url, env={"RECOVERY_AGENT_STANDBY_DELAY_S": "0"},
                                        linger_s=None if name == "n1" else 0.0) for name in ("n0", "n1", "n2", "n3")])
            agents.extend([AgentProcess(workdir, name, server.url, spare=True)
                           for name in ("spare0", "spare1", "spare2", "spare3")])
            await wait_until(lambda: ready >= {a.node for a in agents}, 30, "the agents to report their nodes",
                             state.explain)
            await nc.close()

        asyncio.run(start_agents())
        yield state
    finally:
        stop_agents([*agents, *state.extra])
        kill_leftovers(state.started)
        store.stop()
        daemon.close()
        server.stop()


async def run_job(cluster: Cluster, job: str, fault: Any = None, nodes: list[str] = NODES,
                  rendezvous: str = "agent", checkpoint: dict[str, Any] | None = None,
                  step_time: float = STEP_TIME_S, detection: dict[str, Any] | None = None,
                  args: list[str] | None = None) -> tuple[JobWatch, dict[str, Any]]:
    """Submit the job, let `fault(watch)` strike once every rank passed FAULT_AT_STEP, wait for the job to
    complete; returns what was seen and the final parameters."""
    import torch

    out = cluster.workdir / f"{job}.pt"
    nc = await connect(cluster.nats.url)
    try:
        w = await watch(nc, job)

        def explain() -> str:
            decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
            return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n--- events:\n{w.story()}\n" \
                f"{cluster.explain(job)}"

        port = cluster.store.port if rendezvous == "external" else free_port()
        await submit(nc, job, job_spec(out, STEPS, step_time, nodes, port, rendezvous, checkpoint, detection, args))
        try:
            await wait_until(lambda: all(w.step(r) >= FAULT_AT_STEP for r in range(4)), 120,
                             f"{job} to train {FAULT_AT_STEP} steps", explain)
            if fault is not None:
                await fault(w, explain)
            await wait_until(lambda: "job.completed" in w.kinds() and out.exists(), 120, f"{job} to complete",
                             explain)
            # Each node's agent sends its ranks' last words in its own report, which may land after the job's
            # completion (decided on the exits of every node): the tests read every rank's last step, so it is waited
            # for too, within a bound (a job that ends otherwise, scaled or failed, is the test's own to judge).
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: all(w.step(r) >= STEPS for r in range(4)), 10, "every rank's last step")
        finally:
            cluster.started.extend(pid for pids in w.pids().values() for pid in pids)
    finally:
        await nc.close()
    return w, torch.load(out)


async def through_a_fault(cluster: Cluster, nc: Any, w: JobWatch, job: str, spec: dict[str, Any], out: Path,
                          fault: Any, explain: Any, fault_at: int, timeout_s: float) -> None:
    """Submit `spec` as `job`, let `fault(w, explain)` strike once every rank of 4 passed `fault_at`, wait for the job
    to complete and write `out`; every process it started is the cluster's to stop, and any left is killed here."""
    try:
        await submit(nc, job, spec)
        await wait_until(lambda: all(w.step(r) >= fault_at for r in range(4)), timeout_s,
                         f"{job} to train {fault_at} steps", explain)
        if fault is not None:
            await fault(w, explain)
        await wait_until(lambda: "job.completed" in w.kinds() and out.exists(), timeout_s, f"{job} to complete",
                         explain)
    finally:
        pids = [pid for pids in w.pids().values() for pid in pids]
        cluster.started.extend(pids)
        kill_leftovers([pid for pid in pids if _running(pid)])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fault_free_run(cluster: Cluster, job: str = "fault-free") -> dict[str, Any]:
    """The parameters of the job run without faults: what every recovered run must end with, bit for bit."""
    w, params = asyncio.run(run_job(cluster, job))
    assert all(len(pids) == 1 for pids in w.pids().values())
    return params


def assert_bitwise_equal(params: dict[str, Any], reference: dict[str, Any]) -> None:
    import torch

    assert params.keys() == reference.keys()
    for name in params:
        assert torch.equal(params[name], reference[name]), f"{name} differs from the fault-free run"

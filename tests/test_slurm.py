"""Slurm for real: a slurmctld and three slurmd nodes on this host (`recovery.testing.slurm`), the control plane's
daemon, job store and agents (what `recovery-run --standalone` starts), and `recovery-slurm` between them.

Every process is stopped by its pid when a test ends, also when it fails: the cluster by its fixture, the control
plane by `LocalStack.stop`, the bridge by `stop_process`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from events.commands import IsolateNode
from events.names import DecisionKind
from events.outputs import Decision
from events.values import SchedulerJob
from recovery.cli.ctl import CtlFailure, connect, request
from recovery.cli.local_stack import LocalStack
from recovery.slurm.allocation import from_environment
from recovery.slurm.bridge import SlurmBridge
from recovery.slurm.scontrol import Scontrol
from recovery.testing.slurm import SlurmCluster
from tests.daemon_support import async_wait_for

TRAIN = """\
import sys
import time

# The first run of the allocation trains until Slurm takes it back; the run after a requeue finishes at once.
if sys.argv[1] == "0":
    while True:
        time.sleep(1)
print("trained in run", sys.argv[1])
"""


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", ["n1", "n2", "n3"]) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def control_plane(data_dir: Path, nodes: list[str], spares: list[str]
                        ) -> AsyncIterator[tuple[LocalStack, Client]]:
    """The daemon, the job store and an agent per node, named as the Slurm nodes are."""
    stack = LocalStack(data_dir, nodes, spares, devices=2)
    nc: Client | None = None
    try:
        nc = await stack.start(lambda url: connect(url, 10.0))
        yield stack, nc
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        await asyncio.to_thread(stack.stop)


def start_bridge(url: str, cluster: SlurmCluster, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "recovery.cli.slurm", "--nats-url", url, "--slurm-conf",
                                 str(cluster.conf), "--log-format", "text", "--log-level", "INFO"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


until = async_wait_for  # the shared deadline-bounded wait, with the logs that say why it timed out


async def job_state(url: str, job: str) -> str | None:
    with contextlib.suppress(CtlFailure):
        reply = await request(url, "job", {"job": job}, 5.0)
        if reply.get("ok"):
            return str(reply["job"]["state"])
    return None


def test_an_allocation_is_read_from_the_environment_slurm_gives_a_batch_script(slurm: SlurmCluster,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "allocation.txt"
    script = tmp_path / "read.sh"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import os; from recovery.slurm.allocation import "
                      f"from_environment as f; a = f(os.environ); print(a.job_id, a.restarts, a.run_name, "
                      f"*a.nodes)' > {out}\n")
    script.chmod(0o755)
    job = slurm.sbatch(script, "-N", "3", "-o", str(tmp_path / "read.out"))
    slurm.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 30, "the batch script to end")
    assert out.read_text().split() == [job, "0", f"slurm-{job}", "n1", "n2", "n3"]
    assert from_environment({"PATH": "/usr/bin"}) is None  # outside an allocation: nothing to take


async def test_an_isolated_node_is_drained_with_its_reason_and_resumed_when_released(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    async with control_plane(tmp_path / "plane", ["n1", "n2"], ["n3"]) as (stack, _):
        bridge = start_bridge(stack.url, slurm, tmp_path / "bridge.log")
        try:
            await until(lambda: "following decisions" in (tmp_path / "bridge.log").read_text(), 30,
                        "the bridge to follow the decisions")
            # Two device faults on the node, with a spare to take its rank: a lemon node, isolated.
            spec = {"nodes": ["n1", "n2"], "ranks_per_node": 1, "layout": {"dp": 2},
                    "policies": {"detection": {"name": "default", "params": {"node_frequency_threshold": 2}}},
                    "entrypoint": {"command": sys.executable, "args": [str(train), "0"], "cwd": str(tmp_path),
                                   "rendezvous": "external",
                                   "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(stack.store_port)}}}
            reply = await request(stack.url, "submit", {"job": "lemon", "spec": spec}, 10.0)
            assert reply["ok"], reply
            await until(lambda: _is(job_state(stack.url, "lemon"), "running"), 30, "the job to run")
            for _ in range(2):
                reply = await request(stack.url, "inject", {"type": "device.fault", "node": "n2", "data": {
                    "device": 1, "vendor": "nvidia", "code": "63"}}, 10.0)
                assert reply["ok"], reply
            await until(lambda: "DRAIN" in slurm.node("n2")["State"], 30, "Slurm to drain n2",
                        lambda: (tmp_path / "bridge.log").read_text())
            reason = slurm.node("n2")["Reason"]
            assert reason.startswith("recovery: XID 63 on n2 device 1") and "lemon node" in reason
            assert "(job lemon)" in reason
            assert "DRAIN" not in slurm.node("n1")["State"]

            reply = await request(stack.url, "release", {"job": "lemon", "node": "n2", "reason": "board replaced"},
                                  10.0)
            assert reply["ok"], reply
            await until(lambda: slurm.node("n2")["State"] == "IDLE", 30, "Slurm to resume n2",
                        lambda: (tmp_path / "bridge.log").read_text())
        finally:
            stop_process(bridge)


async def test_a_node_drained_by_an_administrator_stays_drained_when_the_engine_releases_it(
        slurm: SlurmCluster) -> None:
    slurm.run("scontrol", "update", "nodename=n1", "state=drain", "reason=memory test")
    bridge = SlurmBridge("nats://unused", Scontrol(env=slurm.env))
    released = Decision(job="j", cause_seq=7, index=0, kind=DecisionKind.HARDWARE_RELEASED, previous="running",
                        state="running", phase=None, policy=None, reason="an operator released node n1",
                        detail={"node": "n1", "device": None, "by": "operator"})
    assert not await bridge.handle(7, released)
    assert "DRAIN" in slurm.node("n1")["State"] and slurm.node("n1")["Reason"].startswith("memory test")
    isolated = released.model_copy(update={"kind": DecisionKind.HARDWARE_MARKED, "reason": "lemon", "commands": [
        IsolateNode(id="j:7:0", job="j", attempt=0, deadline_s=60, node="n1", reason="lemon")]})
    assert await bridge.handle(7, isolated)  # drained again, now by the engine: its reason replaces the old one
    assert await bridge.handle(8, released)
    # A resumed node is NOT_RESPONDING until slurmctld has pinged it again.
    slurm.wait(lambda: slurm.node("n1")["State"] == "IDLE", 30, "n1 to be idle again")


async def test_a_waiting_decision_read_again_never_requeues_a_later_run(slurm: SlurmCluster,
                                                                        tmp_path: Path) -> None:
    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/sh\nexec sleep 600\n")
    script.chmod(0o755)
    job = slurm.sbatch(script, "-N", "2", "--requeue", "-o", str(tmp_path / "hold.out"))
    slurm.wait_job(job, lambda j: j["JobState"] == "RUNNING", 30, "the allocation to run")
    waiting = Decision(job="big", cause_seq=40, index=1, kind=DecisionKind.ATTEMPT_WAITING, previous="recovering",
                       state="recovering", phase="waiting", policy="ladder@7", reason="no spare",
                       detail={"vacate": ["n2"], "spares": 0})

    def bridge() -> SlurmBridge:
        """A bridge that knows the job's allocation from its spec, as it reads it from the log."""
        fresh = SlurmBridge("nats://unused", Scontrol(env=slurm.env))
        fresh.jobs["big"] = SchedulerJob(scheduler="slurm", id=job, restarts=0)
        return fresh

    assert await bridge().handle(40, waiting)
    slurm.wait_job(job, lambda j: j["JobState"] == "RUNNING" and j["Restarts"] == "1", 60, "the second run")
    assert slurm.job(job)["NodeList"] == "n[1,3]"  # not the drained n2
    # A restarted bridge reads the decision again: it is about the first run, which is gone.
    assert not await bridge().handle(40, waiting)
    assert slurm.job(job)["Restarts"] == "1" and slurm.job(job)["JobState"] == "RUNNING"
    # Spares enough, or nothing to leave: the engine's own wait stands.
    assert not await bridge().handle(41, waiting.model_copy(update={"detail": {"vacate": ["n2"], "spares": 1}}))
    assert not await bridge().handle(42, waiting.model_copy(update={"detail": {"vacate": [], "spares": 0}}))


async def test_recovery_run_in_sbatch_takes_the_allocation_and_a_lost_node_requeues_it(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    async with control_plane(tmp_path / "plane", ["n1", "n2", "n3"], []) as (stack, _):
        bridge = start_bridge(stack.url, slurm, tmp_path / "bridge.log")
        batch_out = tmp_path / "batch.out"

        def logs() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in (batch_out, tmp_path / "bridge.log") if p.exists())

        try:
            await until(lambda: "following decisions" in (tmp_path / "bridge.log").read_text(), 30,
                        "the bridge to follow the decisions")
            script = tmp_path / "train.sh"
            script.write_text(f"#!/bin/sh\nexec {sys.executable} -m recovery.cli.run --nats-url {stack.url} "
                              f"--rdzv-endpoint 127.0.0.1:{stack.store_port} --nproc-per-node 1 {train} "
                              "${SLURM_RESTART_COUNT:-0}\n")
            script.chmod(0o755)
            job = slurm.sbatch(script, "-N", "2", "--requeue", "--open-mode=append", "-o", str(batch_out),
                               "-D", str(tmp_path))
            first = f"slurm-{job}"
            await until(lambda: _is(job_state(stack.url, first), "running"), 60, f"{first} to run", logs)
            nodes = slurm.job(job)["NodeList"]
            assert nodes == "n[1-2]", nodes
            assert f"Slurm job {job}: 2 node(s) allocated" in batch_out.read_text()

            # n2's GPU falls off the bus: its rank must leave the node, and no spare can take it.
            reply = await request(stack.url, "inject", {"type": "device.fault", "node": "n2", "data": {
                "device": 0, "vendor": "nvidia", "code": "79"}}, 10.0)
            assert reply["ok"], reply
            await until(lambda: slurm.job(job)["Restarts"] == "1", 60, "Slurm to requeue the allocation", logs)
            assert "DRAIN" in slurm.node("n2")["State"]
            assert slurm.node("n2")["Reason"].startswith(f"recovery: {first} had to leave it, no spare: XID 79")
            # its recovery-run ends with the run: its cancel reaches the daemon shortly after Slurm requeued
            await until(lambda: _is(job_state(stack.url, first), "cancelled"), 30, f"{first} to be cancelled", logs)

            # The requeued run starts on the nodes Slurm picks, not the drained one, as a new recovery job.
            await until(lambda: slurm.job(job)["JobState"] == "COMPLETED", 90, "the requeued run to complete", logs)
            assert slurm.job(job)["NodeList"] == "n[1,3]"
            assert await job_state(stack.url, f"{first}-r1") == "completed"
            out = batch_out.read_text()
            assert f"submitted {first}-r1: 2 rank(s) on n1, n3" in out, logs()
        finally:
            stop_process(bridge)


async def _is(state: Any, wanted: str) -> bool:
    return bool(await state == wanted)

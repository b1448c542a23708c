"""One job's trouble never reaches another on the same node: an agent starts ranks only for a job the daemon accepted,
jobs that name the same job store port share the agent's store, a port another process holds fails that job alone
(said in a `job.cancelled` and the agent's log), and a restarted agent serves its jobs' stores again."""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.agent.stores import JobStores, StoreUnavailable
from recovery.agent.tcpstore import StoreError, TorchStore
from recovery.log.jetstream import ensure_stream, stream_config
from recovery.service import config as config_mod
from recovery.service.connection import retry
from recovery.service.streams import ensure_streams
from recovery.testing.nats import NatsServer, free_port
from tests.daemon_support import running_daemon
from tests.e2e_support import STAND_IN, AgentProcess, connect, kill_leftovers, node_heard, submit, wait_until, watch


@pytest.fixture(autouse=True)
def short_store_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose job store does not answer starts after half a second's wait for it, not a minute (the stand-ins
    use none)."""
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")


def stand_in_job(tmp_path: Path, nodes: list[str], master_port: int | None = None, rendezvous: str = "agent",
                 **spec: Any) -> dict[str, Any]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return {"nodes": nodes, "ranks_per_node": 1, "layout": {"dp": len(nodes)}, **spec,
            "entrypoint": {"command": sys.executable, "args": [str(script)], "cwd": str(tmp_path),
                           "rendezvous": rendezvous,
                           "env": {"MASTER_PORT": str(free_port() if master_port is None else master_port)}}}


async def store_answers(port: int) -> bool:
    try:
        async with await TorchStore.connect("127.0.0.1", port, timeout_s=1.0):
            return True
    except StoreError:
        return False


async def test_a_port_another_process_holds_is_the_jobs_failure_named_at_once() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        stores = JobStores("127.0.0.1")
        with pytest.raises(StoreUnavailable, match=rf"j cannot listen on 127.0.0.1:{port}: another process holds it"):
            await stores.serve("j", port)
        assert stores.jobs_on(port) == []


@pytest.fixture
async def streams(nats_server: NatsServer) -> AsyncIterator[NatsServer]:
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    await ensure_stream(js, stream_config())
    await ensure_stream(js, stream_config("RECOVERY_CMD", [subjects.COMMANDS]))
    await nc.close()
    yield nats_server


async def test_a_job_the_daemon_rejected_starts_no_rank(nats_server: NatsServer, tmp_path: Path) -> None:
    """Two submissions the daemon refuses (an unknown policy, an unknown parameter) start nothing on a node that runs
    another job; the job it accepts, submitted after them, starts."""
    nc = await connect(nats_server.url)
    watches = {job: await watch(nc, job) for job in ("bad-policy", "bad-param", "good")}
    agent: AgentProcess | None = None
    try:
        async with running_daemon(nats_server.url, tmp_path / "data", timers_enabled=False) as daemon:
            agent = AgentProcess(tmp_path, "n1", nats_server.url)
            await wait_until(lambda: "n1" in daemon.engine.cluster.nodes, 60, "the agent's node", agent.log_tail)
            await submit(nc, "bad-policy", stand_in_job(tmp_path, ["n1"], policies={
                "detection": {"name": "no-such-policy"}}))
            await submit(nc, "bad-param", stand_in_job(tmp_path, ["n1"], policies={
                "detection": {"name": "default", "params": {"no_such_parameter": 1}}}))
            await submit(nc, "good", stand_in_job(tmp_path, ["n1"]))
            await wait_until(lambda: watches["good"].step(0) >= 2, 60, "the accepted job's rank to train",
                             agent.log_tail)
            assert "bad-policy" not in daemon.engine.jobs and "bad-param" not in daemon.engine.jobs
            for job in ("bad-policy", "bad-param"):
                assert watches[job].of("process.started") == [], f"{job} was rejected, yet its ranks started"
            assert agent.log_tail(200).count("the daemon did not accept its submission") == 2
            # the rejected id, fixed and submitted again (the good job gone): it starts now
            await nc.jetstream().publish(subjects.job_event("good", "job.cancelled"), encode_envelope(make_envelope(
                "job.cancelled", {"reason": "done"}, id="good:cancelled", job="good", source="test")))
            await wait_until(lambda: daemon.engine.jobs["good"].state == "cancelled", 30, "the good job's end")
            await submit(nc, "bad-policy", stand_in_job(tmp_path, ["n1"]), again=1)
            await wait_until(lambda: watches["bad-policy"].step(0) >= 2, 60, "the fixed job's rank to train",
                             agent.log_tail)
    finally:
        if agent is not None:
            agent.stop()
        kill_leftovers([pid for w in watches.values() for pids in w.pids().values() for pid in pids])
        await nc.close()


async def test_jobs_share_a_store_port_a_taken_port_fails_one_job_and_a_restarted_agent_serves_again(
        streams: NatsServer, tmp_path: Path) -> None:
    nc = await connect(streams.url)
    port = free_port()
    watches = {job: await watch(nc, job) for job in ("first", "second", "squatted", "late")}
    squatter = socket.socket()  # a process that is not this agent's holds the third job's port
    squatter.bind(("0.0.0.0", 0))
    squatter.listen()
    ready = await node_heard(nc, "recovery.ev.node.n1.node.ready")
    agent = AgentProcess(tmp_path, "n1", streams.url)
    restarted: AgentProcess | None = None
    try:
        await wait_until(lambda: bool(ready), 60, "the agent's node.ready", agent.log_tail)
        await submit(nc, "first", stand_in_job(tmp_path, ["n1"], port), accepted=True)
        await wait_until(lambda: watches["first"].step(0) >= 2, 90, "the first job to train", agent.log_tail)
        assert await store_answers(port)
        # the same MASTER_PORT: one store serves both (each job's keys under its run id), no EADDRINUSE
        await submit(nc, "second", stand_in_job(tmp_path, ["n1"], port), accepted=True)
        await wait_until(lambda: watches["second"].step(0) >= 2, 60, "the second job to train", agent.log_tail)
        await submit(nc, "squatted", stand_in_job(tmp_path, ["n1"], squatter.getsockname()[1]), accepted=True)
        await wait_until(lambda: bool(watches["squatted"].of("job.cancelled")), 60, "the squatted job's failure",
                         agent.log_tail)
        reason = watches["squatted"].of("job.cancelled")[0]["data"]["reason"]
        assert "another process holds it" in reason and str(squatter.getsockname()[1]) in reason
        assert watches["squatted"].of("process.started") == []
        assert agent.proc.poll() is None, agent.log_tail()
        steps = watches["first"].step(0)
        await wait_until(lambda: watches["first"].step(0) > steps + 2, 30, "the first job to train on",
                         agent.log_tail)

        agent.proc.kill()  # its store goes with it (its stdin closes); its ranks run on in their own sessions
        agent.proc.wait(timeout=10)
        # accepted while no agent runs here: the next one starts it
        await submit(nc, "late", stand_in_job(tmp_path, ["n1"], rendezvous="external"), accepted=True)
        restarted = AgentProcess(tmp_path, "n1", streams.url)
        # the same log file: the old agent's line is the first
        await wait_until(lambda: restarted.log_path.read_text(errors="replace").count("rendezvous store of") >= 2, 90,
                         "the restarted agent to serve the store again", restarted.log_tail)
        assert await store_answers(port)
        assert len(watches["first"].of("process.started")) == 1  # taken back, not started again
        await wait_until(lambda: watches["late"].step(0) >= 2, 60, "the job accepted while no agent ran to train",
                         restarted.log_tail)
    finally:
        squatter.close()
        agent.stop()
        if restarted is not None:
            restarted.stop()
        kill_leftovers([pid for w in watches.values() for pids in w.pids().values() for pid in pids])
        await nc.close()


async def test_an_agent_starts_accepted_jobs_of_every_partition(nats_server: NatsServer, tmp_path: Path) -> None:
    """With several partitions the log stores each job event in its partition (`recovery.p.<k>.ev.job...`): the agent
    reads the submissions there, and starts each accepted job whatever its partition."""
    count = 2
    cfg = config_mod.load(nats_url=nats_server.url, data_dir=tmp_path / "data", partitions=count)
    nc = await connect(nats_server.url)
    await ensure_streams(nc.jetstream(), cfg, lambda op, what: retry(op, what, lambda: False))
    jobs = ["a", "b"]
    assert sorted(subjects.partition_of(job, count) for job in jobs) == [0, 1]
    watches = {job: await watch(nc, job) for job in jobs}
    ready = await node_heard(nc, "recovery.ev.node.n1.node.ready")
    agent = AgentProcess(tmp_path, "n1", nats_server.url)
    try:
        await wait_until(lambda: bool(ready), 60, "the agent's node.ready", agent.log_tail)
        for job in jobs:
            seq = await submit(nc, job, stand_in_job(tmp_path, ["n1"], rendezvous="external"), accepted=True)
            stored = (await nc.jetstream().get_msg(cfg.stream, seq)).subject
            assert stored == f"recovery.p.{subjects.partition_of(job, count)}.ev.job.{job}.job.submitted"
        for job in jobs:
            await wait_until(lambda j=job: watches[j].step(0) >= 1, 60, f"job {job}'s rank to train", agent.log_tail)
    finally:
        agent.stop()
        kill_leftovers([pid for w in watches.values() for pids in w.pids().values() for pid in pids])
        await nc.close()

"""`recovery-replay` on a live log written by the daemon on a real nats-server: a per-job export through the
JetStream export path re-derives the job's decisions (node events and another job's taking the spare included), and
a log with hostile input (a message typed `decision` on an event subject, which the daemon dead-letters) verifies."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from events import subjects
from events.envelope import Record, make_envelope
from events.outputs import Decision
from events.values import Layout
from recovery.log import ExportHeader, iter_file, read_header
from recovery.log.jetstream import JetStreamLog
from recovery.service.daemon import Daemon
from recovery.testing.nats import NatsServer
from tests.daemon_support import ROOT, connect, running_daemon


@pytest.fixture
async def daemon(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Daemon]:
    # No timer service: every input of the incident is published here, so the log holds exactly these.
    async with running_daemon(nats_server.url, tmp_path / "data", timers_enabled=False) as d:
        yield d


class Cluster:
    """Publishes events as a cluster's agents would and returns the decisions the daemon made for each."""

    def __init__(self, log: JetStreamLog, daemon: Daemon) -> None:
        self.log = log
        self.daemon = daemon
        self.count = 0

    async def send(self, subject: str, payload: Any) -> list[Decision]:
        appended = await self.log.append(subject, payload)
        await self.daemon.wait_applied(appended.seq, 10)
        return [r.envelope.data async for r in self.log.read(appended.seq + 1)
                if isinstance(r, Record) and r.subject.startswith("recovery.dec.")
                and r.envelope.data.cause_seq == appended.seq]

    async def job(self, job: str, type_: str, **data: Any) -> list[Decision]:
        self.count += 1
        envelope = make_envelope(type_, data, id=f"{type_}-{self.count}", job=job, source="test")
        return await self.send(subjects.job_event(job, type_), envelope)

    async def node(self, node: str, type_: str, **data: Any) -> list[Decision]:
        self.count += 1
        envelope = make_envelope(type_, data, id=f"{type_}-{self.count}", node=node, source="test")
        return await self.send(subjects.node_event(node, type_), envelope)


async def shared_spare_pool(cluster: Cluster) -> list[Decision]:
    """The incident of tests/test_replay_truth.py, live: b takes the only spare, a then waits for one, and a spare
    joining starts a's attempt. Returns a's decisions caused by node events."""
    await cluster.node("spare0", "node.joined", spare=True, devices=8)
    for job, nodes in (("a", ["a0", "a1"]), ("b", ["b0", "b1"])):
        spec = {"nodes": nodes, "ranks_per_node": 2, "layout": Layout(dp=4).model_dump()}
        await cluster.job(job, "job.submitted", spec=spec)
        await cluster.job(job, "job.started")
        for rank in range(4):
            await cluster.job(job, "progress.step", rank=rank, step=1)
        await cluster.job(job, "checkpoint.saved", step=1, tier="storage", shards=[0], holder="storage")
    stops = await cluster.node("b1", "device.fault", device=1, vendor="nvidia", code="79")
    for command in [c for d in stops for c in d.commands]:
        await cluster.job("b", "command.ack", command_id=command.id, status="done")
    driven = await cluster.node("a1", "device.fault", device=0, vendor="nvidia", code="79")
    driven += await cluster.node("spare1", "node.joined", spare=True, devices=8)
    return [d for d in driven if d.job == "a"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False)


async def test_a_job_export_of_the_live_log_verifies(daemon: Daemon, nats_server: NatsServer, tmp_path: Path) -> None:
    url = nats_server.url
    nc, js = await connect(url)
    try:
        driven = await shared_spare_pool(Cluster(JetStreamLog(nc, js, "RECOVERY", owns_connection=False), daemon))
    finally:
        await nc.close()
    assert [d.kind for d in driven][:2] == ["fault.confirmed", "attempt.waiting"]  # the spare was b's
    assert "attempt.started" in [d.kind for d in driven]  # spare1 joined
    out = tmp_path / "a.jsonl"
    exported = await asyncio.to_thread(cli, "export", "--nats", url, "--job", "a", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    assert read_header(out) == ExportHeader(job="a", inputs="all")
    records = list(iter_file(out))
    assert any(r.subject.startswith("recovery.ev.node.") for r in records)
    assert any(r.subject.startswith("recovery.ev.job.b.") for r in records)
    assert not [r for r in records if r.subject == "recovery.dec.b" and isinstance(r, Record)
                and r.envelope.data.kind != "job.accepted"]
    verified = await asyncio.to_thread(cli, "verify", str(out))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("ok: ") and "job a's" in verified.stdout
    piped = await asyncio.to_thread(cli, "export", "--nats", url, "--job", "a")  # to standard output: same filter
    assert piped.returncode == 0 and piped.stdout.encode() == out.read_bytes()
    whole = await asyncio.to_thread(cli, "verify", "--nats", url, "--job", "a")
    assert whole.returncode == 0, whole.stdout + whole.stderr


async def test_a_live_log_with_hostile_input_verifies(daemon: Daemon, nats_server: NatsServer) -> None:
    url = nats_server.url
    nc, js = await connect(url)
    try:
        cluster = Cluster(JetStreamLog(nc, js, "RECOVERY", owns_connection=False), daemon)
        await cluster.job("a", "job.submitted", spec={"nodes": ["a0"], "ranks_per_node": 2,
                                                     "layout": Layout(dp=2).model_dump()})
        await cluster.job("a", "job.started")
        forged = Decision(job="a", cause_seq=2, index=1, kind="job.completed", previous="running", state="completed")
        for subject in (subjects.job_event("a", "decision"), subjects.node_event("a0", "decision")):
            envelope = make_envelope("decision", forged, id=f"forged-{subject}", job="a", source="mallory")
            assert await cluster.send(subject, envelope) == []
        crash = await cluster.job("a", "process.exited", rank=1, exit_code=139)
        assert crash and crash[0].kind == "fault.confirmed"
    finally:
        await nc.close()
    verified = await asyncio.to_thread(cli, "verify", "--nats", url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    as_json = await asyncio.to_thread(cli, "verify", "--nats", url, "--json")
    assert '"rejections_match": true' in as_json.stdout

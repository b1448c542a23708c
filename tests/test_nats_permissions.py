"""NATS users per role (`recovery.service.auth`) on a real nats-server: an agent publishes its own node's events and
reads its own node's commands, and nothing of another node's; the auditor reads and cannot write; the daemon runs
under its own user."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import orjson
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.log.pull import PullReader
from recovery.log.refusals import Refusals
from recovery.service.auth import authorization, main, urls, users
from recovery.service.daemon import Daemon
from recovery.testing.nats import NatsServer
from tests.daemon_support import async_wait_for, running_daemon
from tests.e2e_support import AgentProcess
from tests.test_daemon import ctl, spec

PASSWORD = "pw-for-tests"
NODES = ["n1", "n2"]


@pytest.fixture
def secured(tmp_path: Path) -> tuple[NatsServer, dict[str, dict[str, str]]]:
    made = users(NODES, password=PASSWORD)
    conf = tmp_path / "auth.conf"
    conf.write_text(authorization(made))
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)])
    server.start()
    try:
        yield server, urls(made, server.url.removeprefix("nats://"))
    finally:
        server.stop()


@pytest.fixture
async def daemon(secured: tuple[NatsServer, dict[str, dict[str, str]]], tmp_path: Path) -> AsyncIterator[Daemon]:
    _, roles = secured
    async with running_daemon(roles["daemon"]["url"], tmp_path / "data", timers_enabled=False) as d:
        yield d


async def connect_as(role: dict[str, str], errors: list[str]) -> Client:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(role["url"], inbox_prefix=role["inbox_prefix"], error_cb=on_error,
                              allow_reconnect=False)


def commands_of(node: str) -> ConsumerConfig:
    return ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, filter_subject=subjects.node_commands(node))


def node_ready(node: str) -> tuple[str, bytes, str]:
    envelope = make_envelope("node.ready", {}, id=f"ready-{node}", node=node, source="test")
    return subjects.node_event(node, "node.ready"), encode_envelope(envelope), envelope.id


async def test_an_agent_publishes_its_own_node_events_and_not_another_nodes(
        secured: tuple[NatsServer, dict[str, dict[str, str]]], daemon: Daemon) -> None:
    _, roles = secured
    errors: list[str] = []
    nc = await connect_as(roles["agent-n1"], errors)
    try:
        js = nc.jetstream(timeout=2.0)
        subject, data, ident = node_ready("n1")
        assert (await js.publish(subject, data, headers={"Nats-Msg-Id": ident})).seq > 0
        subject, data, ident = node_ready("n2")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish(subject, data, headers={"Nats-Msg-Id": ident})
        await async_wait_for(lambda: any("permissions violation" in e.lower() for e in errors), 5,
                             "the server to refuse the publish")
        assert "n1" in daemon.engine.cluster.nodes and "n2" not in daemon.engine.cluster.nodes
    finally:
        await nc.close()


async def test_an_agent_reads_its_own_node_commands_and_not_another_nodes(
        secured: tuple[NatsServer, dict[str, dict[str, str]]], daemon: Daemon) -> None:
    _, roles = secured
    await ctl(roles["daemon"]["url"], "submit", job="j", spec=spec(NODES))
    await ctl(roles["daemon"]["url"], "inject", type="job.started", job="j")
    await ctl(roles["daemon"]["url"], "inject", type="process.exited", job="j", data={"rank": 1, "exit_code": 1})
    errors: list[str] = []
    nc = await connect_as(roles["agent-n1"], errors)
    try:
        js = nc.jetstream(timeout=2.0)
        theirs = PullReader(nc, js, "RECOVERY_CMD", commands_of("n2"), batch=10)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await theirs.open(1)
        await theirs.close()
        # Nor by a core subscription, nor by watching every inbox.
        await nc.subscribe(subjects.node_commands("n2"))
        await nc.subscribe("_INBOX.>")
        await nc.flush()
        await async_wait_for(lambda: sum("permissions violation" in e.lower() for e in errors) >= 2, 5,
                             "the server to refuse both subscriptions")
        own = PullReader(nc, js, "RECOVERY_CMD", commands_of("n1"), batch=10)
        try:
            await own.open(1)
            batch = await own.next_batch(5)
            assert batch and all(d.subject.startswith("recovery.cmd.n1.") for d in batch)
        finally:
            await own.close()
    finally:
        await nc.close()


async def test_the_auditor_reads_the_log_and_cannot_write_to_it(
        secured: tuple[NatsServer, dict[str, dict[str, str]]], daemon: Daemon) -> None:
    _, roles = secured
    await ctl(roles["daemon"]["url"], "submit", job="j", spec=spec(NODES))
    errors: list[str] = []
    nc = await connect_as(roles["auditor"], errors)
    try:
        js = nc.jetstream(timeout=2.0)
        reader = PullReader(nc, js, "RECOVERY", ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True), batch=10)
        try:
            await reader.open(1)
            assert [d for d in await reader.next_batch(5) if d.subject == subjects.job_event("j", "job.submitted")]
        finally:
            await reader.close()
        subject, data, ident = node_ready("n1")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish(subject, data, headers={"Nats-Msg-Id": ident})
        # recovery-ctl's reads go through the daemon; the operator may ask, the auditor may not.
        operator = await connect_as(roles["operator"], errors)
        try:
            reply = await operator.request(f"{subjects.PREFIX}.ctl.jobs", b"{}", timeout=5)
            assert b"\"j\"" in reply.data
        finally:
            await operator.close()
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(f"{subjects.PREFIX}.ctl.jobs", b"{}", timeout=1)
    finally:
        await nc.close()


def test_the_generator_writes_a_block_and_urls_and_refuses_a_bad_node_name(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out, secrets_path = tmp_path / "auth.conf", tmp_path / "urls.json"
    assert main(["--nodes", "n1,n2", "--out", str(out), "--urls", str(secrets_path), "--host", "nats:4222"]) == 0
    text = out.read_text()
    assert text.count("{user:") == 5 and "recovery.cmd.n2.>" in text
    assert secrets_path.stat().st_mode & 0o777 == 0o600
    assert out.stat().st_mode & 0o777 == 0o600  # every password, in plain text
    out.chmod(0o644)  # a file left readable by an earlier version is narrowed when written again
    assert main(["--nodes", "n1", "--out", str(out), "--urls", str(secrets_path)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    assert main(["--nodes", "n1,bad.node", "--out", str(out), "--urls", str(secrets_path)]) == 2
    assert "bad.node" in capsys.readouterr().err



async def test_an_agent_may_not_publish_a_timer_firing(secured: tuple[NatsServer, dict[str, dict[str, str]]]) -> None:
    _, roles = secured
    errors: list[str] = []
    nc = await connect_as(roles["agent-n1"], errors)
    try:
        await nc.publish(subjects.job_event("j", "timer.fired"), b"{}")  # only the daemon's timer service may
        await nc.publish(subjects.job_event("j", "process.exited"), b"{}")  # its ranks' job events it may
        await nc.flush()
        await async_wait_for(lambda: any("permissions violation" in e.lower() for e in errors), 5,
                             "the server to refuse the firing")
        assert len(errors) == 1 and "timer.fired" in errors[0]
    finally:
        await nc.close()


async def test_an_agent_sends_its_own_reports_to_the_daemon_and_no_summary_and_no_other_nodes_reports(
        secured: tuple[NatsServer, dict[str, dict[str, str]]]) -> None:
    """`progress = "summary"`: an agent publishes its node's reports on core NATS; another node's, or a summary
    (only the daemon writes those), the server refuses."""
    _, roles = secured
    errors: list[str] = []
    nc = await connect_as(roles["agent-n1"], errors)
    try:
        await nc.publish(subjects.reports("n1"), b"{}")
        await nc.flush()
        await nc.publish(subjects.reports("n2"), b"{}")
        await nc.publish(subjects.job_event("j", "progress.summary"), b"{}")
        await nc.flush()
        await async_wait_for(lambda: len(errors) >= 2, 5, "the server to refuse both")
        assert len(errors) == 2 and "recovery.progress.n2" in errors[0] and "progress.summary" in errors[1], errors
    finally:
        await nc.close()


async def test_an_agent_with_another_nodes_credentials_says_the_server_refuses_it(
        secured: tuple[NatsServer, dict[str, dict[str, str]]], daemon: Daemon, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, roles = secured
    monkeypatch.setenv("RECOVERY_AGENT_NATS_INBOX_PREFIX", roles["agent-n1"]["inbox_prefix"])
    agent = AgentProcess(tmp_path, "n2", roles["agent-n1"]["url"])  # n1's user and password, on node n2
    try:
        def refusals() -> list[dict[str, str]]:
            return [orjson.loads(text) for text in agent.log_path.read_text(errors="replace").splitlines()
                    if text.startswith("{") and "nats permissions violation" in text]

        def own_events_refused() -> bool:
            return any('publish to "recovery.ev.node.n2.' in line["error"].lower() for line in refusals())

        await async_wait_for(own_events_refused, 60, "the agent to log the server's refusal of its node's events")
        assert all(line["level"] == "error" and "the agent of node n2" in line["hint"] for line in refusals())
        assert len({line["error"] for line in refusals()}) == len(refusals())  # each said once
    finally:
        agent.stop()


def test_a_refusal_is_logged_once_per_subject_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    refusals = Refusals(logging.getLogger("recovery.agent"), "the agent of node n2")
    consumer = 'nats: permissions violation for publish to "$js.api.consumer.create.recovery_cmd.{}.recovery.cmd.n2.>"'
    with caplog.at_level(logging.DEBUG, logger="recovery.agent"):
        for name in ("htvoplpcphbnwumw84lby0", "Zq0k3oWc8TfyUQvH5Ab2xY"):  # each retry names a new consumer
            assert refusals.seen(Exception(consumer.format(name)))
        assert refusals.seen(Exception('nats: permissions violation for publish to "recovery.ev.node.n2.node.ready"'))
        assert not refusals.seen(Exception("nats: timeout"))
    assert refusals.count == 3
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]

"""recovery-agent's start against a control plane that is not there yet: it waits for NATS, then for the streams the
daemon creates, saying so at INFO with its attempts, instead of printing nothing or crashing on `stream not found`;
and under the NATS permissions of its node it connects through its own inbox and reports its node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from events import subjects
from recovery.service.auth import authorization, urls, users
from recovery.testing.nats import NatsServer, free_port
from tests.daemon_support import async_wait_for, read_stream, running_daemon
from tests.e2e_support import AgentProcess


def logged(agent: AgentProcess, message: str, at_least: int = 1) -> bool:
    for line in agent.log_path.read_text(errors="replace").splitlines():
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("level") == "info" and str(entry.get("msg", "")).startswith(message) \
                and entry.get("attempts", 0) >= at_least:
            return True
    return False


async def test_an_agent_waits_for_nats_then_for_the_streams_then_reports_its_node(tmp_path: Path) -> None:
    port = free_port()
    agent = AgentProcess(tmp_path, "early", f"nats://127.0.0.1:{port}")
    try:
        await async_wait_for(lambda: logged(agent, "waiting for NATS", 2), 60, f"the agent to say it waits for NATS:"
                             f"\n{agent.log_tail()}")
        with NatsServer(tmp_path / "nats", port=port) as server:
            await async_wait_for(lambda: logged(agent, "waiting for the streams RECOVERY, RECOVERY_CMD", 2), 60,
                                 f"the agent to say it waits for the streams:\n{agent.log_tail()}")
            assert agent.proc.poll() is None, agent.log_tail()  # no crash on "stream not found"
            async with running_daemon(server.url, tmp_path / "data", timers_enabled=False) as daemon:
                await async_wait_for(lambda: "early" in daemon.engine.cluster.nodes, 60,
                                     f"the agent's node to reach the daemon:\n{agent.log_tail()}")
            assert logged(agent, "the streams RECOVERY, RECOVERY_CMD exist")
    finally:
        agent.stop()


async def test_an_agent_under_its_node_permissions_reports_its_node(tmp_path: Path) -> None:
    made = users(["n1"], password="pw-for-tests")
    conf = tmp_path / "auth.conf"
    conf.write_text(authorization(made))
    with NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)]) as server:
        roles = urls(made, server.url.removeprefix("nats://"))
        async with running_daemon(roles["daemon"]["url"], tmp_path / "data", timers_enabled=False) as daemon:
            agent = AgentProcess(tmp_path, "n1", roles["agent-n1"]["url"], False, "--nats-inbox-prefix",
                                 roles["agent-n1"]["inbox_prefix"])
            try:
                await async_wait_for(lambda: "n1" in daemon.engine.cluster.nodes, 60,
                                     f"the confined agent's node to reach the daemon:\n{agent.log_tail()}")
                # The node joins with its `node.ready`; its first heartbeat follows within a period (later on a
                # loaded host): read the stream again until one is there.
                # Its health checks at the join follow its `node.ready` too.
                deadline = asyncio.get_running_loop().time() + 30
                beats: list[object] = []
                checked: list[object] = []
                while not (beats and checked) and asyncio.get_running_loop().time() < deadline:
                    records = await read_stream(roles["daemon"]["url"])
                    beats = [r for r in records if r.subject == subjects.node_event("n1", "node.heartbeat")]
                    checked = [r for r in records if r.subject == subjects.node_event("n1", "node.checked")]
                    if not (beats and checked):
                        await asyncio.sleep(0.2)  # the poll's interval, within the deadline
                assert beats, "the agent's heartbeats go through under its permissions"
                assert checked, "the agent's health checks reach the log under its permissions"
                assert "Permissions Violation" not in agent.log_path.read_text(errors="replace")
            finally:
                agent.stop()

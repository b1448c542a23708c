"""A node suspected lost is asked at once: the daemon probes its agent on core NATS, and NATS's "no responders", twice,
is logged as `node.unreachable`, which the engine's detection policy takes as the agent gone, at the record. A slow
agent, an agent that never answered a probe, or one that answers, is never declared; a sign of life ends it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import nats
import orjson
import pytest
from nats.aio.client import Client

from events import subjects
from events.outputs import Rejection
from recovery.service.auth import agent_user, authorization, urls, users
from recovery.service.publisher import Outgoing
from recovery.service.reachability import Prober
from recovery.testing.nats import NatsServer
from recovery.testing.scenario import Scenario
from tests.daemon_support import async_wait_for
from tests.test_live_liveness import forged_after_seals
from tests.test_node_heartbeat import beat

DETECTION = {"detection": {"name": "default", "params": {"agent_silence_s": 30.0, "hang_min_silence_s": 60.0}}}


def job(s: Scenario, params: dict[str, Any] | None = None) -> None:
    policies = DETECTION if params is None else {
        "detection": {"name": "default", "params": {**DETECTION["detection"]["params"], **params}}}
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=policies)
    s.spare("s0")
    beat(s, ["n0", "n1", "s0"])
    s.train("j", 3)


def test_an_unreachable_node_is_gone_at_the_record_and_its_ranks_move_to_the_spare() -> None:
    s = Scenario()
    job(s)
    s.node_event("n0", "node.unreachable", cause="rank 2 of j (n1) lost a peer's connection", confirm_s=0.2)
    [confirmed] = s.find("fault.confirmed", "j")  # long before the 30 s bound, and not at a tick
    assert confirmed.reason.startswith("agent of n0 unreachable"), confirmed.reason
    assert confirmed.detail["fault"]["class"] == "node"
    [migrate] = s.outstanding("migrate_ranks")
    assert migrate.from_node == "n0" and migrate.to_node == "s0"  # type: ignore[attr-defined]
    assert s.engine.cluster.nodes["n0"].gone
    beat(s, ["n0"])  # its agent speaks again: back, and unreachable no more
    n0 = s.engine.cluster.nodes["n0"]
    assert not n0.gone and n0.unreachable is None and n0.usable


def test_a_sign_of_life_before_the_watchdog_judges_ends_it_and_a_policy_may_not_trust_it() -> None:
    s = Scenario()
    job(s, {"unreachable_is_lost": False})
    s.node_event("n0", "node.unreachable", cause="incident 1 of j began", confirm_s=0.2)
    assert not s.find("fault.confirmed", "j") and s.engine.cluster.nodes["n0"].unreachable is not None
    s.train("j", 2)  # its ranks' steps, relayed by its agent: it lives
    assert s.engine.cluster.nodes["n0"].unreachable is None
    assert not s.find("fault.confirmed", "j")


def test_an_unsealed_unreachable_in_a_sealed_log_is_dead_lettered() -> None:
    s = Scenario()
    job(s)
    [rejection] = forged_after_seals(s, "node.unreachable", {"cause": "forged"}, "unreachable:n0:j:0")
    assert isinstance(rejection, Rejection) and rejection.code == "unreachable_unsealed"
    assert not s.find("fault.confirmed", "j") and not s.engine.cluster.nodes["n0"].gone


def test_an_agent_answers_its_own_probe_and_may_not_declare_a_node_unreachable() -> None:
    user = agent_user("n0", "secret")
    assert subjects.probe("n0") in user.subscribe and subjects.probe("n1") not in user.subscribe
    assert subjects.suspect("n0") in user.publish and subjects.suspect("n1") not in user.publish
    assert subjects.node_event("n0", "node.unreachable") in user.publish_deny and user.responds


# -- the prober, on a real nats-server -----------------------------------------------------------------------------
async def agent_for(url: str, node: str, answer: bool = True) -> Client:
    """A client that answers `node`'s probes as its agent does (`answer`: False, one that hears and never answers)."""
    nc = await nats.connect(url)

    async def respond(msg: Any) -> None:
        if answer:
            await msg.respond(b"")

    await nc.subscribe(subjects.probe(node), cb=respond)
    await nc.flush()
    return nc


def prober_for(s: Scenario) -> tuple[Prober, list[list[Outgoing]]]:
    published: list[list[Outgoing]] = []

    async def publish(out: list[Outgoing]) -> None:
        published.append(out)

    return Prober(lambda: s.engine, publish, lambda ident: f"{ident}~sealed", lambda: True), published


async def test_a_dead_agent_is_declared_unreachable_at_once_and_a_slow_or_unknown_one_never(
        nats_server: NatsServer) -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1", "n2"], ranks_per_node=1, dp=3, policies=DETECTION)
    s.spare("s0")
    beat(s, ["n0", "n1", "n2", "s0"])
    s.train("j", 3)
    daemon = await nats.connect(nats_server.url)
    n0, n1 = await agent_for(nats_server.url, "n0"), await agent_for(nats_server.url, "n1", answer=False)
    try:
        prober, _ = prober_for(s)
        learn = prober.look()
        assert learn == ["n0", "n1", "n2"] and prober.look() == []  # each node asked for a first answer once
        await prober._ask_all(daemon, learn)
        assert prober.answering == {"n0"}  # n1 heard and did not answer in time; n2 has no agent here
        # n0's agent dies (its connection closes); n2 never answered: only n0 may be declared.
        await n0.close()
        out = await prober.probe_job(daemon, "j", "rank 1 of j (n1) lost a peer's connection", speaker="n1")
        [(subject, envelope)] = [(o.subject, orjson.loads(o.data)) for o in out]
        assert subject == subjects.node_event("n0", "node.unreachable") and envelope["node"] == "n0"
        assert envelope["data"]["cause"].startswith("rank 1 of j") and out[0].msg_id.endswith("~sealed")
        # Survivors of one loss say so together: a second suspicion within `AGAIN_S` probes nothing.
        assert await prober.probe_job(daemon, "j", "rank 2 of j (n2) lost a peer's connection", "n2") == []
        for message in out:
            s.send(message.subject, message.data)
        [confirmed] = s.find("fault.confirmed", "j")
        assert "n0 unreachable" in confirmed.reason and s.engine.cluster.nodes["n0"].gone
    finally:
        for client in (daemon, n1):
            await client.close()


async def test_a_reconnecting_agent_whose_second_answer_comes_is_not_declared(nats_server: NatsServer) -> None:
    """The first probe finds no one, the agent's subscription is back before the second: it lives."""
    s = Scenario()
    job(s)
    daemon = await nats.connect(nats_server.url)
    n0 = await agent_for(nats_server.url, "n0")
    back: list[Client] = []
    try:
        prober, _ = prober_for(s)
        await prober._ask_all(daemon, prober.look())
        assert "n0" in prober.answering
        await n0.close()

        async def reconnect() -> None:
            back.append(await agent_for(nats_server.url, "n0"))

        async with anyio.create_task_group() as tasks:
            real_ask = prober.ask

            async def ask(nc: Client, node: str) -> bool | None:
                answer = await real_ask(nc, node)
                if answer is False and not back:
                    await reconnect()  # within the confirmation's distance
                return answer

            prober.ask = ask  # type: ignore[method-assign]
            out = await prober.probe_job(daemon, "j", "incident 1 of j began", None)
            tasks.cancel_scope.cancel()
        assert out == [] and back
    finally:
        await daemon.close()
        for client in back:
            await client.close()


async def test_the_agents_user_answers_its_probe_and_tells_its_suspicion_under_real_permissions(
        tmp_path: Path) -> None:
    made = users(["n0", "n1"], password="pw")
    conf = tmp_path / "auth.conf"
    conf.write_text(authorization(made))
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)])
    server.start()
    try:
        roles = urls(made, server.url.removeprefix("nats://"))
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        agent = await nats.connect(roles["agent-n0"]["url"], inbox_prefix=roles["agent-n0"]["inbox_prefix"],
                                   error_cb=on_error, allow_reconnect=False)
        daemon = await nats.connect(roles["daemon"]["url"], allow_reconnect=False)
        heard: list[bytes] = []
        try:
            async def respond(msg: Any) -> None:
                await msg.respond(b"")

            async def hear(msg: Any) -> None:
                heard.append(msg.data)

            await agent.subscribe(subjects.probe("n0"), cb=respond)
            await daemon.subscribe(subjects.SUSPECTS, cb=hear)
            await agent.flush()
            await daemon.flush()
            answer = await daemon.request(subjects.probe("n0"), b"", timeout=5.0)
            assert answer.data == b""
            await agent.publish(subjects.suspect("n0"), orjson.dumps({"job": "j", "rank": 0}))
            await agent.publish(subjects.suspect("n1"), b"{}")  # another node's name: refused
            await async_wait_for(lambda: heard and any("permissions violation" in e.lower() for e in errors), 20.0,
                                 "the agent's suspicion heard and another node's refused")
            assert heard == [orjson.dumps({"job": "j", "rank": 0})]
        finally:
            await agent.close()
            await daemon.close()
    finally:
        server.stop()


@pytest.mark.parametrize("data", [b"not json", b"{}", b"[1]"])
def test_a_bad_suspicion_is_logged_and_probes_nothing(data: bytes, caplog: pytest.LogCaptureFixture) -> None:
    s = Scenario()
    prober, _ = prober_for(s)
    prober._on_suspect(subjects.suspect("n1"), data)
    assert prober._queue == [] and "bad suspicion from n1" in caplog.text

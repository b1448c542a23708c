"""Node liveness off the log: an agent that states `live_s` beats on core NATS, and the log holds only its mode, the
daemon's liveness monitor's `node.silent` and `node.heard`. The engine takes a `node.silent` as its watchdog takes an
agent whose heartbeats stopped, at once; a sign of life ends the silence; the monitor's own outage is not the
fleet's."""

from __future__ import annotations

from typing import Any

import orjson

from events import subjects
from events.envelope import make_envelope
from events.outputs import Rejection
from recovery.log import MSG_ID
from recovery.service.auth import agent_user
from recovery.service.liveness import LivenessMonitor
from recovery.service.publisher import Outgoing
from recovery.service.seal import Seal
from recovery.testing.scenario import Scenario
from tests.test_node_heartbeat import beat

BOUND_S = 3.0
DETECTION = {"detection": {"name": "default", "params": {"agent_silence_s": BOUND_S, "hang_min_silence_s": 30.0}}}


def live(s: Scenario, nodes: list[str]) -> None:
    """Each node's agent states its mode: its beats go on core NATS from here."""
    for node in nodes:
        s.node_event(node, "node.heartbeat", interval_s=1.0, live_s=1.0)


def live_job(s: Scenario) -> None:
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=DETECTION)
    s.spare("s0")
    live(s, ["n0", "n1", "s0"])


def test_a_live_agent_is_never_silent_for_lacking_heartbeats_in_the_log() -> None:
    s = Scenario()
    live_job(s)
    s.train("j", 40)  # 40 s of steps, not one heartbeat logged
    assert not s.find("fault.confirmed", "j"), s.kinds("j")
    assert not s.engine.cluster.nodes["n0"].gone


def test_the_monitors_silence_moves_the_nodes_ranks_at_once_and_its_heard_brings_the_host_back() -> None:
    s = Scenario()
    live_job(s)
    s.train("j", 5)
    s.node_event("n0", "node.silent", silent_s=BOUND_S + 0.2, bound_s=BOUND_S)
    [confirmed] = s.find("fault.confirmed", "j")  # at the record, not at the next watchdog tick
    assert confirmed.reason.startswith("agent of n0 silent") and confirmed.detail["fault"]["class"] == "node"
    [migrate] = s.outstanding("migrate_ranks")
    assert migrate.from_node == "n0" and migrate.to_node == "s0"  # type: ignore[attr-defined]
    assert s.engine.cluster.nodes["n0"].gone
    s.node_event("n0", "node.heard", silent_s=12.0)
    n0 = s.engine.cluster.nodes["n0"]
    assert not n0.gone and n0.silent is None and n0.usable


def test_a_silence_under_the_policys_bound_is_found_by_the_watchdog_once_past_it() -> None:
    """The engine judges with the job's own policy: a `node.silent` shorter than its bound (a monitor configured
    otherwise) decides nothing now, and the watchdog's tick finds the node once the silence passed the bound."""
    s = Scenario()
    live_job(s)
    s.train("j", 5)
    s.node_event("n1", "node.silent", silent_s=1.0, bound_s=1.0)
    assert not s.find("fault.confirmed", "j")
    s.train("j", 5, ranks=[0, 1])
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n1 silent")


def test_a_report_of_the_silent_nodes_agent_ends_its_silence() -> None:
    s = Scenario()
    live_job(s)
    s.train("j", 5)
    s.node_event("n1", "node.silent", silent_s=1.0, bound_s=1.0)
    s.train("j", 10)  # its agent relays its ranks' steps again: it lives
    assert s.engine.cluster.nodes["n1"].silent is None and not s.find("fault.confirmed", "j")


def test_a_node_whose_heartbeats_are_logged_is_judged_by_them_not_by_a_silence() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=DETECTION)
    beat(s, ["n0", "n1"])
    s.train("j", 2)
    beat(s, ["n0", "n1"])
    s.node_event("n0", "node.silent", silent_s=10.0, bound_s=BOUND_S)
    assert not s.find("fault.confirmed", "j") and s.engine.cluster.nodes["n0"].silent is None


def forged_after_seals(s: Scenario, type_: str, data: dict[str, Any], ident: str) -> list[object]:
    """The effects of an agent's unsealed node `type_` on n0, once the log holds the daemon's seals."""
    seal = Seal(b"secret")

    def append(subject: str, envelope: Any, msg_id: str) -> list[object]:
        appended = s.log.append_sync(subject, envelope, headers={MSG_ID: msg_id})
        assert appended.record is not None
        return [effect for effect, _, _, _ in s.recorder.apply(appended.record)]

    outage = make_envelope("control.outage", {"away_s": 0.5, "bound_s": 300.0}, id="outage:j:1:1", job="j",
                           source="daemon")
    append(subjects.job_event("j", "control.outage"), outage, seal("outage:j:1:1"))  # the daemon seals from here
    forged = make_envelope(type_, data, id=ident, node="n0", source="agent")
    return append(subjects.node_event("n0", type_), forged, ident)


def test_an_unsealed_silence_in_a_sealed_log_is_dead_lettered() -> None:
    """Once the log holds the daemon's seals, a `node.silent` without one (an agent's forgery) moves nothing."""
    s = Scenario()
    live_job(s)
    s.train("j", 3)
    [rejection] = forged_after_seals(s, "node.silent", {"silent_s": 9.0, "bound_s": BOUND_S}, "silent:n0:x")
    assert isinstance(rejection, Rejection) and rejection.code == "silence_unsealed"
    assert not s.find("fault.confirmed", "j") and s.engine.cluster.nodes["n0"].silent is None


# -- the monitor --------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def monitor(s: Scenario, clock: Clock, judge: list[bool]) -> LivenessMonitor:
    async def publish(out: list[Outgoing]) -> None:
        raise AssertionError("not used")

    return LivenessMonitor(lambda: s.engine, publish, lambda ident: ident, lambda: judge[0], clock)


def facts(out: list[Outgoing]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(o.subject.split(".")[3], orjson.loads(o.data)["type"], orjson.loads(o.data)["data"]) for o in out]


def feed(s: Scenario, out: list[Outgoing]) -> None:
    for message in out:
        s.send(message.subject, message.data)


def test_the_monitor_grants_a_full_bound_after_its_own_outage_and_declares_only_past_it() -> None:
    s, clock, judge = Scenario(), Clock(), [True]
    live_job(s)
    watch = monitor(s, clock, judge)
    assert watch.messages() == []  # starts: every node has a bound from now, heard or not
    clock.now += BOUND_S - 0.5
    for node in ("n0", "n1"):
        watch.beat(node)
    judge[0] = False  # cut off (or its lease not fresh): n0 beats unheard meanwhile
    clock.now += 10
    assert watch.messages() == []
    judge[0] = True  # back: n0's silence counts from now, not from its last beat heard
    assert watch.messages() == []
    watch.beat("n1")
    clock.now += BOUND_S
    assert watch.messages() == []
    watch.beat("n1")  # n1 goes on beating; n0 was last heard before the outage
    clock.now += 0.01
    out = watch.messages()
    assert [(node, type_) for node, type_, _ in facts(out)] == [("n0", "node.silent")]
    assert facts(out)[0][2]["silent_s"] > BOUND_S
    assert watch.messages() == [], "declared twice before the engine holds it"
    feed(s, out)
    assert s.engine.cluster.nodes["n0"].gone and s.find("fault.confirmed", "j")
    assert watch.messages() == []  # silent still: nothing more to say
    clock.now += 1
    watch.beat("n0")  # heard again
    [(node, type_, _)] = facts(heard := watch.messages())
    assert (node, type_) == ("n0", "node.heard")
    feed(s, heard)
    assert not s.engine.cluster.nodes["n0"].gone and s.engine.cluster.nodes["n0"].silent is None


def test_an_agent_may_beat_on_its_own_live_subject_and_may_not_publish_the_monitors_word() -> None:
    user = agent_user("n0", "secret")
    assert subjects.live("n0") in user.publish and subjects.live("n1") not in user.publish
    assert {subjects.node_event("n0", "node.silent"), subjects.node_event("n0", "node.heard")} <= set(
        user.publish_deny)

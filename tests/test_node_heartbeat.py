"""The agent's heartbeat (`node.heartbeat`): its absence is a node fault that moves the node's ranks; the heartbeats
themselves decide nothing. A watchdog tick logged late (the control plane's own outage) is not taken for every rank's
and agent's silence."""

from __future__ import annotations

from events import subjects
from events.envelope import make_envelope
from recovery.testing.scenario import Scenario


def beat(s: Scenario, nodes: list[str]) -> None:
    for node in nodes:
        s.node_event(node, "node.heartbeat", interval_s=1.0)


def test_an_agent_that_falls_silent_moves_its_nodes_ranks_to_a_spare() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.spare("s0")
    s.train("j", 5)
    decided = len(s.kinds("j"))
    for _ in range(4):
        s.advance(1)
        beat(s, ["n0", "n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)
    assert len(s.kinds("j")) == decided, "heartbeats decided something"
    for _ in range(30):  # n0's agent is gone; n1's goes on, and (relayed from elsewhere) every rank still reports
        s.advance(1)
        beat(s, ["n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n0 silent") and confirmed.detail["fault"]["class"] == "node"
    [migrate] = s.outstanding("migrate_ranks")
    assert migrate.from_node == "n0" and migrate.to_node == "s0"  # type: ignore[attr-defined]


def test_a_control_plane_outage_is_not_taken_for_the_silence_of_every_rank_and_agent() -> None:
    """NATS away for 10 s: no event and no timer is logged. On its return the overdue watchdog tick lands with some
    agents' buffered events before it and the rest after: nobody is silent."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 5.0, "agent_silence_s": 3.0}}})
    for _ in range(5):
        s.advance(1)
        beat(s, ["n0", "n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)
    s.now += 10 * 10**9
    beat(s, ["n1"])  # n1's agent flushed first
    s.steps("j", s.engine.jobs["j"].step + 1, ranks=[2, 3])
    s.run_until(s.now)  # the tick, 10 s late
    s.advance(0.5)
    beat(s, ["n0"])  # n0's agent flushed after it
    s.steps("j", s.engine.jobs["j"].step, ranks=[0, 1])
    for _ in range(4):
        s.advance(1)
        beat(s, ["n0", "n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)
    assert not s.find("fault.confirmed", "j"), [d.reason for d in s.find("fault.confirmed", "j")]


def test_a_job_that_stays_silent_after_an_outage_is_found_a_silence_window_later() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 5.0}}})
    s.train("j", 5)
    s.now += 10 * 10**9
    s.run_until(s.now)  # the overdue tick: the silence counts from here
    assert not s.find("fault.confirmed", "j")
    s.advance(4)
    assert not s.find("fault.confirmed", "j")
    s.advance(4)  # past the window: a real silence, not an outage
    [confirmed] = s.find("fault.confirmed", "j")
    assert "silent" in confirmed.reason


def _report(s: Scenario, job: str, node: str, ranks: list[int]) -> None:
    """The node's agent's report of its ranks' steps (its sign of life: no heartbeat goes in a period with one)."""
    state = s.engine.jobs[job]
    entries = [{"rank": r, "step": state.steps[r] + 1, "attempt": state.generation} for r in ranks]
    s.send(subjects.job_event(job, "progress.report"),
           make_envelope("progress.report", {"ranks": entries}, id=s._id("report"), job=job, node=node, source="t"))


def test_a_gone_hosts_agent_that_reports_again_brings_it_back() -> None:
    """An agent cut off for longer than agent_silence_s (its NATS server down, say) has its host declared gone; with
    no spare the job waits for nodes. When the agent reports again, the host is back, as a heartbeat would say, and
    the job does not wait for nodes it has."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 30.0, "agent_silence_s": 3.0}}})
    beat(s, ["n0", "n1"])  # each agent's first sign of life; reports after it
    for _ in range(3):
        s.advance(1)
        _report(s, "j", "n0", [0, 1])
        _report(s, "j", "n1", [2, 3])
    for _ in range(6):  # n0's agent is cut off
        s.advance(1)
        _report(s, "j", "n1", [2, 3])
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n0 silent")
    assert s.phase("j") == "waiting" and s.engine.cluster.nodes["n0"].gone
    _report(s, "j", "n0", [0, 1])  # back
    assert not s.engine.cluster.nodes["n0"].gone
    assert s.phase("j") != "waiting", s.kinds("j")[-4:]
    assert s.outstanding(), "the job was not restarted on the nodes it has"


def test_a_gone_hosts_ranks_heard_again_bring_it_back() -> None:
    """An agent that relays its ranks' words one by one (no folded report) and whose heartbeats were lost in a burst:
    the host declared gone is back at its ranks' first heartbeat, not only at a node event or a report."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 30.0, "agent_silence_s": 3.0}}})
    beat(s, ["n0", "n1"])
    for _ in range(6):  # n0's agent's heartbeats stop reaching the log; its ranks had gone quiet for a moment too
        s.advance(1)
        beat(s, ["n1"])
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n0 silent")
    assert s.phase("j") == "waiting" and s.engine.cluster.nodes["n0"].gone
    s.job_event("j", "process.heartbeat", rank=0, attempt=0)
    assert not s.engine.cluster.nodes["n0"].gone
    assert s.phase("j") != "waiting", s.kinds("j")[-4:]


def test_a_gone_host_the_job_left_is_back_in_service_when_its_agent_answers_and_the_move_stands() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.spare("s0")
    beat(s, ["n0", "n1", "s0"])
    for _ in range(8):
        s.advance(1)
        beat(s, ["n1", "s0"])
        s.steps("j", s.engine.jobs["j"].step + 1)
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n0 silent")
    [migrate] = s.outstanding("migrate_ranks")
    s.ack(migrate, node="s0")
    assert s.engine.jobs["j"].nodes == ["s0", "n1"] and s.engine.cluster.nodes["n0"].gone
    s.ack(migrate, node="n0")  # n0's agent was cut off, not dead: it stopped its ranks and says so
    n0 = s.engine.cluster.nodes["n0"]
    assert not n0.gone and n0.usable
    assert s.engine.jobs["j"].nodes == ["s0", "n1"], "the move was undone"
    assert s.state("j") in ("recovering", "running") and not s.find("attempt.failed", "j")

"""The agent's heartbeat (`node.heartbeat`): its absence is a node fault that moves the node's ranks; the heartbeats
themselves decide nothing. A span in which nothing at all is heard of a job (the control plane's own outage) is not
taken for every rank's silence."""

from __future__ import annotations

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


def test_a_job_heard_of_by_nobody_for_a_while_is_not_silent_once_its_events_arrive() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 5.0}}})
    s.train("j", 5)
    # NATS away for 10 s: no event of the job and no timer fires; the overdue watchdog tick lands first on return.
    s.now += 10 * 10**9
    s.run_until(s.now)
    assert s.kinds("j")[-1] != "fault.confirmed", "the control plane's outage taken for every rank's silence"
    s.idle("j", 4)  # the agents' outboxes flush: every rank is heard again
    assert not s.find("fault.confirmed", "j")


def test_a_job_that_stays_silent_is_found_a_silence_window_after_the_quiet_tick() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 5.0}}})
    s.train("j", 5)
    s.now += 10 * 10**9
    s.run_until(s.now)
    assert not s.find("fault.confirmed", "j")
    s.advance(4)  # within the silence window counted from the quiet tick
    assert not s.find("fault.confirmed", "j")
    s.advance(4)  # past it: a real silence, not an outage
    [confirmed] = s.find("fault.confirmed", "j")
    assert "silent" in confirmed.reason

"""The control plane's own outage (`control.outage`, the daemon's record of its lost connection) is not the job's
silence: within the bound the platform sets, no node's or rank's silence counts for the time the daemon was away;
past it, silence counts as any other."""

from __future__ import annotations

from events.names import DecisionKind
from recovery.testing.scenario import Scenario

NS = 10**9
INTERVAL_S = 10.0
"""a watchdog period longer than the outage: its overdue tick is logged less than a period late, so nothing but
the outage record tells the engine that the control plane was away"""


def beat(s: Scenario, nodes: list[str]) -> None:
    for node in nodes:
        s.node_event(node, "node.heartbeat", interval_s=1.0)


def healthy_job(s: Scenario) -> None:
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, watchdog_interval_s=INTERVAL_S, policies={
        "detection": {"name": "default", "params": {"hang_min_silence_s": 3.0, "agent_silence_s": 3.0}}})
    for _ in range(8):  # up to 2 s before the next watchdog tick
        s.advance(1)
        beat(s, ["n0", "n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)


def outage(s: Scenario, away_s: float, bound_s: float = 300.0) -> None:
    """NATS away for `away_s`: nothing is logged; on its return the daemon's record lands first, then the timers
    that fell due meanwhile."""
    s.now += int(away_s * NS)
    s.job_event("j", "control.outage", away_s=away_s, bound_s=bound_s)
    s.run_until(s.now)


def train_on(s: Scenario, seconds: int) -> None:
    for _ in range(seconds):
        s.advance(1)
        beat(s, ["n0", "n1"])
        s.steps("j", s.engine.jobs["j"].step + 1)


def test_an_outage_within_the_bound_counts_in_no_silence_and_restarts_nothing() -> None:
    s = Scenario()
    healthy_job(s)
    outage(s, 8.0)  # the overdue tick, 6 s late: every agent and rank 8 s silent in log time
    [record] = s.find(DecisionKind.CONTROL_OUTAGE, "j")
    assert record.detail["excused"] and "does not count" in record.reason
    s.advance(0.5)  # the agents' outboxes flush after the record
    train_on(s, 30)
    assert not s.find(DecisionKind.FAULT_CONFIRMED, "j"), [d.reason for d in s.find(DecisionKind.FAULT_CONFIRMED)]
    assert s.state("j") == "running"


def test_a_host_silent_before_the_outage_keeps_the_silence_measured_while_the_daemon_was_connected() -> None:
    """n0's agent fell silent 2.5 s before the outage (bound 3 s): those 2.5 s count, the 8.5 s of the outage do
    not, and the first tick after the daemon is back finds n0 lost (had the outage wiped its silence, n0 would be
    found a period later)."""
    s = Scenario()
    healthy_job(s)  # the last heartbeat of n0's agent, 2 s before a tick
    s.advance(1)
    beat(s, ["n1"])
    s.steps("j", s.engine.jobs["j"].step + 1, ranks=[2, 3])
    s.advance(1.5)  # the tick: n0 silent for 2 s, within its bound
    outage(s, 8.5)
    back = s.now
    s.advance(0.5)
    beat(s, ["n1"])
    s.steps("j", s.engine.jobs["j"].step + 1, ranks=[2, 3])
    assert not s.find(DecisionKind.FAULT_CONFIRMED, "j")
    s.advance(1)  # the next tick, 1 s after the daemon is back: 2.5 s + 1 s of measured silence
    [confirmed] = s.find(DecisionKind.FAULT_CONFIRMED, "j")
    assert confirmed.reason.startswith("agent of n0 silent"), confirmed.reason
    assert confirmed.detail["fault"]["ts"] - back == 1 * NS


def test_an_outage_past_the_bound_leaves_silence_counted() -> None:
    s = Scenario()
    healthy_job(s)
    outage(s, 8.0, bound_s=5.0)
    [record] = s.find(DecisionKind.CONTROL_OUTAGE, "j")
    assert not record.detail["excused"] and "longer than the 5s bound" in record.reason
    [confirmed] = s.find(DecisionKind.FAULT_CONFIRMED, "j")
    assert "silent" in confirmed.reason


def test_an_outage_record_replays_to_the_same_decisions() -> None:
    from recovery.core.engine import Engine
    from recovery.log.recorder import replay

    s = Scenario()
    healthy_job(s)
    outage(s, 8.0)
    train_on(s, 12)
    result = replay(s.log.records(), Engine())
    assert result.recorded_decisions, "the scenario recorded no decision"
    assert [d.model_dump() for d in result.decisions] == [d.model_dump() for d in result.recorded_decisions]

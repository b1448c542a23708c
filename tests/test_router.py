"""The one driver loop: the effect router and its timer table, which the daemon, the Recorder (and through it
Scenario and the simulator) share."""

from __future__ import annotations

from typing import Any

import pytest

from events import subjects
from events.commands import Command
from events.envelope import EnvelopeBase, make_envelope
from events.outputs import Decision, Rejection
from policies.base import NS
from recovery.core.engine import Engine
from recovery.core.router import EffectRouter
from recovery.core.timers import REFUSED_RETRY_NS, Firing, TimerTable, next_due
from recovery.log import MemoryLog, Recorder
from recovery.sim import Simulator
from recovery.testing import Scenario
from tests.test_sim import config


def test_timers_due_together_come_out_in_the_order_they_were_armed() -> None:
    table = TimerTable()
    table.arm("b", "j", 10)
    table.arm("a", "j", 10)
    table.arm("c", "j", 5)
    assert table.due(9) == [Firing("c", "j", 5)]
    assert table.due(10) == [Firing("b", "j", 10), Firing("a", "j", 10)]
    assert table.due(100) == []


def test_a_cancelled_timer_is_not_taken_and_a_taken_one_not_twice() -> None:
    table = TimerTable()
    table.arm("a", "j", 10)
    table.arm("b", "j", 10)
    table.cancel("a")
    assert table.due(10) == [Firing("b", "j", 10)]
    assert "b" in table  # taken, not forgotten: the engine still holds it until its firing is applied
    assert table.due(10) == []
    table.retry(Firing("b", "j", 10))  # the event was not delivered
    assert table.due(10) == [Firing("b", "j", 10)]
    table.fired("b", "j", 10, 11)
    assert "b" not in table and len(table) == 0


def test_a_periodic_timer_moves_as_the_engine_moves_it() -> None:
    table = TimerTable()
    table.arm("w", "j", 10 * NS, every=10 * NS)
    [firing] = table.due(10 * NS)
    assert firing.every == 10 * NS
    table.fired("w", "j", 10 * NS, 3_605 * NS)  # applied an hour late: the first period after, not a burst
    assert table.get("w") == ("j", next_due(10 * NS, 10 * NS, 3_605 * NS), 10 * NS) == ("j", 3_610 * NS, 10 * NS)
    table.fired("w", "j", 20 * NS, 3_606 * NS)  # a stale period: ignored, as the engine ignores it
    table.fired("w", "other", 3_610 * NS, 3_610 * NS)  # another job's event naming it: ignored too
    assert table.get("w") == ("j", 3_610 * NS, 10 * NS)
    assert table.due(3_609 * NS) == [] and table.due(3_610 * NS) == [Firing("w", "j", 3_610 * NS, 10 * NS)]


def test_the_table_keeps_what_the_engine_keeps_through_a_scenario() -> None:
    s = Scenario()
    s.spare("s1")
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4, watchdog_interval_s=5)
    s.train("j", 3)
    s.job_event("j", "process.exited", rank=1, exit_code=139)
    s.idle("j", 30)
    s.ack_all()
    s.train("j", 12)
    for timer_id, (job, due, every) in s.engine.timers.items():
        assert s.timers.get(timer_id) == (job, due, every)
    assert len(s.timers) == len(s.engine.timers)


class Routes(EffectRouter):
    def __init__(self) -> None:
        super().__init__(Engine())
        self.seen: list[str] = []

    def commanded(self, command: Command, decision: Decision) -> None:
        self.seen.append(f"command {command.kind} of {decision.kind}")

    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        assert subject == subjects.decision(decision.job) and data
        self.seen.append(f"decision {decision.kind}")

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        assert subject == subjects.dead_letter(rejection.code)
        self.seen.append(f"rejection {rejection.code}")


def test_the_router_sends_each_effect_where_it_goes() -> None:
    routes = Routes()
    log = MemoryLog()
    for subject, envelope in [
        (subjects.job_event("j", "job.submitted"), make_envelope("job.submitted", {"spec": {
            "nodes": ["a"], "ranks_per_node": 2, "layout": {"dp": 2}, "watchdog_interval_s": 5}}, id="1", job="j")),
        (subjects.job_event("j", "job.started"), make_envelope("job.started", {}, id="2", job="j")),
        (subjects.job_event("j", "process.heartbeat"), make_envelope("process.heartbeat", {"rank": 0},
                                                                     id="2b", job="j")),  # its script has the SDK
        (subjects.job_event("j", "process.exited"), make_envelope("process.exited", {"rank": 1, "exit_code": 139},
                                                                  id="3", job="j")),
        (subjects.job_event("nope", "job.started"), make_envelope("job.started", {}, id="4", job="nope")),
    ]:
        record = log.append_sync(subject, envelope).record
        assert record is not None
        routes.apply(record)
    assert routes.seen[:2] == ["decision job.accepted", "decision job.started"]
    # a command goes to the executors before its decision is recorded
    assert routes.seen[-3:] == ["command restart_ranks of ranks.rescheduling", "decision ranks.rescheduling",
                                "rejection unknown_job"]
    assert dict(routes.timers._timers) == routes.engine.timers  # one table, as the engine's


def test_every_driver_fires_timers_from_a_router_table() -> None:
    assert isinstance(Scenario().recorder, EffectRouter)
    assert isinstance(Recorder(MemoryLog()), EffectRouter)
    sim = Simulator(config(days=0.01))
    assert isinstance(sim.recorder, EffectRouter) and sim.timers is sim.recorder.timers


def test_a_refused_periodic_firing_comes_back_at_the_next_period_for_the_due_the_engine_holds() -> None:
    table = TimerTable()
    table.arm("w", "j", 10 * NS, every=10 * NS)
    assert table.due(10 * NS) == [Firing("w", "j", 10 * NS, 10 * NS)]
    table.refused("w", "j", 10 * NS, 11 * NS)  # a policy raised: the engine still holds the timer due at 10 s
    assert table.get("w") == ("j", 10 * NS, 10 * NS)
    assert table.due(19 * NS) == []
    [again] = table.due(20 * NS)
    assert again == Firing("w", "j", 10 * NS, 10 * NS, refired_at=20 * NS)
    table.retry(again)  # not delivered: sent again, still as the refused firing's repeat
    assert table.due(20 * NS) == [again]
    table.fired("w", "j", 10 * NS, 20 * NS)  # accepted this time: the engine moves it on, and so does the table
    assert table.get("w") == ("j", 30 * NS, 10 * NS) and table.due(30 * NS) == [Firing("w", "j", 30 * NS, 10 * NS)]


def test_a_refused_one_shot_firing_comes_back_after_the_retry_delay_unless_cancelled() -> None:
    table = TimerTable()
    table.arm("d", "j", 5 * NS)
    table.arm("e", "j", 5 * NS)
    assert len(table.due(5 * NS)) == 2
    table.refused("d", "j", 5 * NS, 6 * NS)
    table.refused("e", "j", 5 * NS, 6 * NS)
    table.refused("d", "other", 5 * NS, 6 * NS)  # not its job: nothing
    table.cancel("e")  # a later decision ended what it guarded
    assert table.due(6 * NS + REFUSED_RETRY_NS - 1) == []
    again = 6 * NS + REFUSED_RETRY_NS
    assert table.due(again) == [Firing("d", "j", 5 * NS, None, refired_at=again)]


def test_a_watchdog_tick_a_policy_raised_on_does_not_stop_the_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine rejects the firing and keeps its timer; the driver fires it again at the next period, so a hang
    after the policy recovers is still found (before, the table waited forever for a firing it had taken). A
    built-in policy that raises (a plugin's error is answered for by the built-in instead) is the case."""
    from policies.detection import DefaultDetection

    s = Scenario()
    s.submit("j", ["a"], ranks_per_node=2, dp=2, watchdog_interval_s=5)
    s.train("j", 3)
    real = DefaultDetection.check

    def raising(self: DefaultDetection, view: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(DefaultDetection, "check", raising)
    s.advance(5)  # the next watchdog tick meets the raising policy
    assert [r.code for r in s.rejections] == ["policy_error"]
    monkeypatch.setattr(DefaultDetection, "check", real)
    s.advance(120)  # silence: no step, no heartbeat
    assert s.find("fault.suspected", "j") or s.find("fault.confirmed", "j"), s.kinds("j")

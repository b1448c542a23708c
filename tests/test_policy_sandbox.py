"""A plugin's mistakes never wedge a job: the engine checks every answer, the built-in policy of the family answers
for a plugin that raises, answers out of bounds or loops, and after three such errors replaces it for that job;
the context a policy gets tells the truth about a lost host; the policy kit catches each of these mistakes, with a
time budget per call."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import pytest

from events.values import Granularity
from policies import (
    NS,
    Fail,
    Params,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicyBase,
    Settle,
    StartRung,
    Wait,
)
from recovery.core.sandbox import POLICY_STRIKES
from recovery.testing.policy_contract import PolicyTooSlow, ReschedulingPolicyContract
from recovery.testing.scenario import Scenario

G = Granularity
NO_DYING = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}


class Plugin(ReschedulingPolicyBase):
    """A third-party rescheduling policy whose `answer` the tests set."""

    name: ClassVar[str] = "test-plugin"
    version: ClassVar[str] = "1"
    parameters = Params
    seen: ClassVar[list[RescheduleContext]] = []

    def answer(self, ctx: RescheduleContext) -> Any:
        raise NotImplementedError

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        self.seen.append(ctx)
        return self.answer(ctx)  # type: ignore[no-any-return]


def install(s: Scenario, job: str, plugin: type[Plugin]) -> None:
    """What a job spec naming the plugin would have loaded at submission."""
    state = s.engine.jobs[job]
    state.policies = replace(state.policies, rescheduling=plugin(),
                             labels={**state.policies.labels, "rescheduling": f"{plugin.name}@1"})


def crash(s: Scenario, job: str, plugin: type[Plugin]) -> Scenario:
    s.submit(job, ["a0", "a1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train(job, 10)
    s.checkpoint(job, 10, "storage", "storage")
    s.train(job, 2)
    install(s, job, plugin)
    s.job_event(job, "process.exited", rank=1, exit_code=1)
    return s


def recovers(s: Scenario, job: str) -> None:
    """Executors do their part, time passes, the job trains: the incident closes and the job runs on."""
    for _ in range(5):
        s.ack_all()
        s.advance(5)
    s.train(job, 2)
    assert s.state(job) == "running" and s.find("incident.closed", job), s.kinds(job)


@pytest.mark.parametrize(("answer", "problem"), [
    (Wait("wait a moment", deadline_ns=1), "deadline_ns=1 ns: shorter than 1 ms, taken for a unit mistake"),
    (Wait("30 s, meant", deadline_ns=30), "deadline_ns=30 ns: shorter than 1 ms"),
    (StartRung(G.IN_PLACE, "restart", deadline_ns=-5), "deadline_ns=-5 ns: a duration is not negative"),
    (Settle("settle", settle_ns=0), "settle_ns=0 ns: shorter than 1 ms"),
    (StartRung(G.IN_PLACE, ""), "answered StartRung with no reason"),
    ("restart it", "answered 'restart it', not one of StartRung, Wait, Settle, Fail"),
    (None, "answered None, not one of"),
])
def test_an_answer_out_of_bounds_is_answered_for_by_the_ladder_and_named(answer: Any, problem: str) -> None:
    class Bad(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            return answer

    s = crash(Scenario(), "j", Bad)
    [failed] = s.find("policy.failed", "j")
    assert failed.reason.startswith("rescheduling policy test-plugin@1 answered") and problem in failed.reason, \
        failed.reason
    assert failed.detail["policy"] == "test-plugin@1" and failed.detail["by"].startswith("ladder@")
    assert s.find("attempt.started", "j")[0].detail["granularity"] == "in_place"  # the ladder's answer
    recovers(s, "j")
    assert not s.rejections


def test_a_plugin_that_always_settles_is_bounded_then_replaced_and_the_job_recovers() -> None:
    """Settle(1 s) on every call wrote 18,009 settling decisions in 5 simulated hours: now 9 settles in a row is
    a loop, the ladder answers, and the third loop replaces the plugin for the job."""
    class AlwaysSettle(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            return Settle("collect more faults", settle_ns=NS)

    s = crash(Scenario(), "j", AlwaysSettle)
    recovers(s, "j")
    failed = s.find("policy.failed", "j")
    assert len(failed) == 1 and "answered Settle 9 times in a row" in failed[0].reason
    assert len(s.find("attempt.settling", "j")) == 8
    for crashes in range(POLICY_STRIKES - 1):  # two more crashes: the second and third loop
        s.train("j", 20 + 5 * crashes)  # a different step each time: no crash loop of the job's own
        s.job_event("j", "process.exited", rank=1, exit_code=1, attempt=s.engine.jobs["j"].generation)
        recovers(s, "j")
    failed = s.find("policy.failed", "j")
    assert [f.detail["errors"] for f in failed] == [1, 2, 3] and failed[-1].detail["replaced"]
    assert s.engine.jobs["j"].policies.labels["rescheduling"].startswith("ladder@")
    assert len(s.decisions) < 200


def test_a_plugin_that_waits_again_past_every_deadline_is_a_loop() -> None:
    class Waits(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            return Wait("wait for nodes", deadline_ns=NS // 100)  # 10 ms: valid, and expired at once

    s = crash(Scenario(), "j", Waits)
    s.advance(1)
    [failed] = s.find("policy.failed", "j")
    assert "answered Wait 9 times in a row, each after the last one's deadline" in failed.reason
    assert len(s.find("attempt.wait_expired", "j")) == 9
    recovers(s, "j")


def test_a_plugin_that_raises_every_time_leaves_the_job_an_exit() -> None:
    """597 rejections in 5 simulated hours and a job recovering for 7 days: now every fault is recovered by the
    ladder, and the plugin is replaced after its third error."""
    class Raises(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            raise ZeroDivisionError("a plugin bug")

    s = crash(Scenario(), "j", Raises)
    recovers(s, "j")
    for crashes in range(POLICY_STRIKES):
        s.train("j", 20 + 5 * crashes)  # a different step each time: no crash loop of the job's own
        s.job_event("j", "process.exited", rank=1, exit_code=1, attempt=s.engine.jobs["j"].generation)
        recovers(s, "j")
    failed = s.find("policy.failed", "j")
    assert [f.detail["errors"] for f in failed] == [1, 2, 3]
    assert "raised ZeroDivisionError: a plugin bug" in failed[0].reason
    assert len(s.find("incident.closed", "j")) == POLICY_STRIKES + 1 and not s.rejections


def test_a_partial_restart_of_a_stock_script_is_refused_and_the_job_restarts_whole() -> None:
    class InPlace(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            return StartRung(G.IN_PLACE, "restart the dead rank")

    s = Scenario()
    s.submit("stock", ["a0", "a1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.advance(30)
    install(s, "stock", InPlace)
    s.job_event("stock", "process.exited", rank=1, exit_code=1)
    [failed] = s.find("policy.failed", "stock")
    assert "answered in_place for a script whose ranks do not re-form in process" in failed.reason
    assert s.find("attempt.started", "stock")[0].detail["granularity"] == "restart_job"


def test_the_context_tells_the_truth_about_a_lost_host() -> None:
    """Every rank of a node falls silent (the host or its agent is gone): the context says the ranks must move
    (needs_move, scope node), and a policy written like the shipped example moves them to the spare instead of
    restarting them on the dead host."""
    class LikeTheExample(Plugin):
        def answer(self, ctx: RescheduleContext) -> Any:
            if ctx.needs_move:
                if ctx.nodes_to_migrate > ctx.spares_available:
                    return Fail("no spare") if ctx.wait_expired else Wait("no spare", deadline_ns=3600 * NS)
                return StartRung(G.MIGRATE, "the node must be left")
            return StartRung(G.IN_PLACE, "restart where they are")

    Plugin.seen.clear()
    s = Scenario()
    s.spare("sp")
    s.submit("j", ["a0", "a1"], ranks_per_node=2, dp=4, policies=NO_DYING)
    s.train("j", 10)
    s.checkpoint("j", 10, "storage", "storage")
    install(s, "j", LikeTheExample)
    s.idle("j", 15, ranks=[0, 1])  # a1's ranks (2, 3) say nothing more
    [confirmed] = s.find("fault.confirmed", "j")
    assert "all ranks on a1 silent" in confirmed.reason
    ctx = Plugin.seen[0]
    assert ctx.needs_move and ctx.scope == "node" and ctx.nodes_to_replace == 1
    s.ack_all()
    [move] = s.commands_of("migrate_ranks")
    assert (move.from_node, move.to_node) == ("a1", "sp")
    assert s.engine.jobs["j"].nodes == ["a0", "sp"]
    s.node_event("a1", "node.heartbeat", interval_s=1.0)  # the host speaks again: usable once more
    assert s.engine.cluster.usable("a1")


# --- the kit ------------------------------------------------------------------------------------------------------
def kit_for(answer: Any) -> ReschedulingPolicyContract:
    class Bad(Plugin):
        def decide(self, ctx: RescheduleContext) -> Reschedule:
            return answer(ctx)  # type: ignore[no-any-return]

    class TestBad(ReschedulingPolicyContract):
        policy = Bad

    return TestBad()


@pytest.mark.parametrize(("answer", "test", "message"), [
    (lambda ctx: StartRung(G.RESTART_JOB, "restart", deadline_ns=-1), "test_answers_are_of_the_familys_types",
     "not negative"),
    (lambda ctx: Settle("settle", settle_ns=NS), "test_settles_end", "settled 9 times in a row"),
    (lambda ctx: Wait("wait", deadline_ns=NS // 100), "test_waits_end", "waited 9 times in a row"),
    (lambda ctx: StartRung(G.MIGRATE, "move", deadline_ns=60 * NS), "test_answers_are_of_the_familys_types",
     "which the cluster cannot carry out"),
    (lambda ctx: Fail(""), "test_answers_are_of_the_familys_types", "with no reason"),
    (lambda ctx: Wait("wait", deadline_ns=30), "test_answers_are_of_the_familys_types", "unit mistake"),
])
def test_the_kit_catches_each_mistake(answer: Any, test: str, message: str) -> None:
    kit = kit_for(answer)
    with pytest.raises(AssertionError, match=message):
        getattr(kit, test)()


def test_the_kit_bounds_each_call_in_time() -> None:
    def forever(ctx: RescheduleContext) -> Any:
        while True:
            pass

    kit = kit_for(forever)
    with pytest.raises(PolicyTooSlow, match="took more than"):
        kit.test_reads_no_clock_and_does_no_io()

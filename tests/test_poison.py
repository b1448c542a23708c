"""One record must never wedge the engine: a policy that raises, a value that cannot be encoded, a policy whose
answer the cluster cannot carry out. Each is undone (no state half changed), dead-lettered with its reason, and
the job and every other job go on."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.outputs import Decision, Rejection
from events.values import Granularity, JobSpec, Layout
from policies.base import NS, PolicySet, Reschedule, RescheduleContext, ReschedulingPolicyBase, StartRung
from recovery.core.engine import Engine
from recovery.core.job import _JOURNALED, Job
from recovery.testing.scenario import Scenario
from tests.property_plans import JobPlan, Plan, plans
from tests.test_properties import CheckedScenario, Driver, engine_state

ROOT = Path(__file__).resolve().parents[1]


class Boom(RuntimeError):
    pass


class Flaky:
    """Wraps a job's three policies; the `fail_at`-th call to any of them raises. Calls made by a record that is
    then rolled back count too, so a plan meets a failure at every depth of the engine's call tree. The count is
    left out of pickles: the tests compare pickled engines, and the count is the test's, not the engine's."""

    def __init__(self, policies: PolicySet, fail_at: int) -> None:
        self.inner = policies
        self.calls = 0
        self.fail_at = fail_at

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "fail_at": self.fail_at}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, calls=0)

    def call(self, family: str, method: str, argument: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Boom(f"call {self.calls}")
        return getattr(getattr(self.inner, family), method)(argument)

    def policy_set(self) -> PolicySet:
        return PolicySet(FlakyFamily(self, "detection"), FlakyFamily(self, "rescheduling"),  # type: ignore[arg-type]
                         FlakyFamily(self, "checkpoint"), self.inner.labels)


class FlakyFamily:
    def __init__(self, flaky: Flaky, family: str) -> None:
        self.flaky = flaky
        self.family = family

    def classify(self, signal: Any) -> Any:
        return self.flaky.call(self.family, "classify", signal)

    def check(self, view: Any) -> Any:
        return self.flaky.call(self.family, "check", view)

    def decide(self, ctx: Any) -> Any:
        return self.flaky.call(self.family, "decide", ctx)

    def plan(self, ctx: Any) -> Any:
        return self.flaky.call(self.family, "plan", ctx)


def with_policies(s: Scenario, job: str, policies: PolicySet) -> None:
    s.engine.jobs[job].policies = policies  # what a plugin would have loaded at submission
    # Asked in-process, as a replay and `verify` ask a plugin: one `Flaky` counts the calls of all three families.
    # (A host runs each family's plugin in a worker process of its own, with its own copy of the count.)
    s.engine.policy_calls = None


def test_a_plugin_that_raises_half_way_is_answered_for_by_the_builtin_and_named() -> None:
    """The exit that asked the plugin is a valid event: it is not lost to the plugin's bug. The built-in ladder
    answers in its place, a decision names the plugin and its error, the job recovers and the other job never
    notices."""
    s = Scenario()
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4)
    s.submit("b", ["b0"], ranks_per_node=2, dp=2)
    s.train("a", 3)
    s.train("b", 3)
    flaky = Flaky(s.engine.jobs["a"].policies, fail_at=2)  # classify passes, then the ladder raises
    with_policies(s, "a", flaky.policy_set())
    effects = s.job_event("a", "process.exited", rank=1, exit_code=1)
    assert not [e for e in effects if isinstance(e, Rejection)]
    [failed] = s.find("policy.failed", "a")
    assert failed.reason.startswith("rescheduling policy ladder@") and "raised Boom: call 2" in failed.reason
    assert "answers instead (1 of 3 errors" in failed.reason
    assert failed.detail["errors"] == 1 and not failed.detail["replaced"]
    s.train("b", 1)
    s.ack_all()
    s.train("a", 2)
    assert s.find("incident.closed", "a") and s.state("a") == "running"
    assert not s.find("policy.failed", "b") and s.state("b") == "running"


def test_a_plugin_that_keeps_erring_is_replaced_for_its_job_by_the_builtin() -> None:
    s = Scenario()
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4)
    s.train("a", 3)

    class Raising(Flaky):
        def call(self, family: str, method: str, argument: Any) -> Any:
            if family == "rescheduling":
                raise Boom("always")
            return getattr(getattr(self.inner, family), method)(argument)

    with_policies(s, "a", Raising(s.engine.jobs["a"].policies, 0).policy_set())
    for _ in range(3):
        s.job_event("a", "process.exited", rank=1, exit_code=1, attempt=s.engine.jobs["a"].generation)
        s.ack_all()
        s.train("a", 2)
    failures = s.find("policy.failed", "a")
    assert [f.detail["errors"] for f in failures] == [1, 2, 3]
    assert failures[-1].detail["replaced"] and "replaced by ladder@" in failures[-1].reason
    job = s.engine.jobs["a"]
    assert type(job.policies.rescheduling).__name__ == "LadderRescheduling"
    assert job.policies.labels["rescheduling"] == failures[-1].detail["by"]
    assert len(s.find("incident.closed", "a")) == 3 and s.state("a") == "running"


def test_our_own_policys_exception_fails_the_record_and_moves_the_job_to_a_safe_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in policy that raises is a bug of ours, with nothing to fall back on: the record is undone and
    dead-lettered, naming the policy, as before; then the job is moved on to a job-level restart from the newest
    complete checkpoint, in decisions that say so, rather than left where the failed record found it."""
    from policies.rescheduling import LadderRescheduling

    s = Scenario()
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4)
    s.train("a", 3)
    s.checkpoint("a", 3, "storage", "storage")

    def broken(self: Any, ctx: Any) -> Any:
        raise Boom("ours")

    monkeypatch.setattr(LadderRescheduling, "decide", broken)
    effects = s.job_event("a", "process.exited", rank=1, exit_code=1)
    assert isinstance(effects[0], Rejection) and effects[0].code == "policy_error"
    assert "rescheduling policy ladder@" in effects[0].reason and "Boom" in effects[0].reason
    [started] = [e for e in effects if isinstance(e, Decision) and e.kind == "attempt.started"]
    assert started.policy == "engine" and "(contained)" in started.reason and "Boom" in started.reason
    assert started.detail["granularity"] == "restart_job"
    monkeypatch.undo()
    s.ack_all()
    assert s.outstanding() == [] and s.commands_of("restart_job")
    s.train("a", 2)
    assert s.state("a") == "running"


class FlakyDriver(Driver):
    fail_at: int = 0

    def _submit(self, job: JobPlan, name: str) -> None:
        super()._submit(job, name)
        state = self.scenario.engine.jobs.get(name)
        if state is not None and self.fail_at:
            with_policies(self.scenario, name, Flaky(state.policies, self.fail_at).policy_set())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plans(max_ops=60), st.integers(min_value=1, max_value=40))
def test_a_policy_failing_anywhere_leaves_no_state_half_changed(plan: Plan, fail_at: int) -> None:
    """Whichever policy call raises, in whatever state: the record is rejected as a policy error and the engine is
    exactly as before it (CheckedScenario compares the whole pickled engine around every rejection)."""
    driver = FlakyDriver(plan, CheckedScenario())
    driver.fail_at = fail_at
    driver.start()
    for op in plan.ops:
        driver.play(op)
    codes = {r.code for r in driver.scenario.rejections}
    assert "internal_error" not in codes


def spec(**overrides: Any) -> dict[str, Any]:
    """A job spec built without validation: what an older, laxer producer or a bug could put in the log."""
    base = JobSpec(nodes=["x0"], ranks_per_node=2, layout=Layout(dp=2))
    return {**base.model_dump(), **overrides}


def submit_unchecked(s: Scenario, job: str, **overrides: Any) -> list[Any]:
    raw = JobSpec.model_construct(**spec(**overrides))
    s.job_event(job, "job.submitted", spec=JobSpec(nodes=["x0"], ranks_per_node=2, layout=Layout(dp=2)).model_dump())
    s.engine.jobs[job].spec = raw  # the engine only ever reads the spec it was given
    return s.job_event(job, "job.started")


def test_a_timer_past_64_bits_is_refused_and_changes_nothing() -> None:
    s = Scenario()
    s.submit("ok", ["o0"], ranks_per_node=2, dp=2)
    before = engine_state(s.engine)
    effects = submit_unchecked(s, "poison", watchdog_interval_s=1e11)
    assert [type(e) for e in effects] == [Rejection] and effects[0].code == "unencodable"  # type: ignore[union-attr]
    assert "64-bit" in effects[0].reason  # type: ignore[union-attr]
    assert s.state("poison") == "submitted", "the refused start changed the job"
    del s.engine.jobs["poison"]  # compare the rest: the accepted submission is the only change
    assert pickle.loads(engine_state(s.engine)).snapshot()["jobs"] == pickle.loads(before).snapshot()["jobs"]


def test_a_zero_period_timer_is_refused() -> None:
    s = Scenario()
    effects = submit_unchecked(s, "poison", watchdog_interval_s=1e-12)
    assert effects[0].code == "invalid_timer"  # type: ignore[union-attr]
    assert s.state("poison") == "submitted"


def test_revoke_undoes_a_record_whose_effects_could_not_be_written() -> None:
    s = Scenario()
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4)
    s.train("a", 3)
    before = engine_state(s.engine)
    engine: Engine = s.engine
    from events.envelope import Record, make_envelope
    from events.subjects import job_event

    envelope = make_envelope("process.exited", {"rank": 2, "exit_code": 1}, id="exit-2", job="a")
    record = Record(seq=engine.last_seq + 1, ts=s.now, subject=job_event("a", "process.exited"), envelope=envelope)
    effects = engine.apply(record)
    assert effects and s.engine.jobs["a"].incident is not None
    rejection = engine.revoke("encoding failed: test")
    assert rejection.code == "unencodable" and rejection.event_id == "exit-2"
    assert engine_state(engine) == before
    # The id is forgotten with the rest: the same event, sent again, is applied, not taken for a duplicate.
    assert engine.apply(record.model_copy(update={"seq": record.seq + 1}))[0].kind == "fault.confirmed"  # type: ignore[union-attr]


class RestartWhateverTheSpares(ReschedulingPolicyBase):
    """A plugin that restarts the job after a failed first attempt, whatever the spares (as the example plugin once
    did): with a node to replace and no spare, that cannot be placed."""

    name: ClassVar[str] = "restart-whatever"
    version: ClassVar[str] = "1"

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        if ctx.previous:
            return StartRung(Granularity.RESTART_JOB, "the first attempt did not recover: restart the job", 120 * NS,
                             rung=1)
        return StartRung(Granularity.IN_PLACE, "restart the faulty processes where they are", 120 * NS)


def test_a_policy_asking_for_a_restart_the_cluster_cannot_place_makes_the_job_wait() -> None:
    """The engine waits (and says why) instead of superseding, refunding and asking again until the stack runs out;
    a spare that joins lets the job recover."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("j", 5)
    s.checkpoint("j", 5, "storage", "storage")
    job = s.engine.jobs["j"]
    job.policies = PolicySet(job.policies.detection, RestartWhateverTheSpares(), job.policies.checkpoint,
                             {**job.policies.labels, "rescheduling": "restart-whatever@1"})
    s.job_event("j", "process.exited", rank=1, exit_code=1)
    for command in s.outstanding():
        s.ack(command, status="failed" if command.kind == "restart_ranks" else "done", reason="no GPU")
    s.ack_all()
    assert s.find("attempt.failed", "j")
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("j", 25, ranks=[0, 1])
    assert not [r for r in s.rejections if r.code == "internal_error"], s.rejections
    assert s.phase("j") == "waiting"
    waiting = s.find("attempt.waiting", "j")[-1]
    assert "cannot be placed" in waiting.reason and "0 spare" in waiting.reason
    s.spare("spare0")
    s.ack_all()
    s.train("j", 2)
    assert s.state("j") == "running" and "spare0" in job.nodes


def test_the_journal_covers_every_slot_of_a_job_a_record_may_change() -> None:
    """A slot added to Job must be journaled (restored on a failed record) or be one a record never changes: the
    memento names its slots explicitly, so a new one left out would silently survive a rollback."""
    fixed = {"id", "spec", "rpn", "own_nodes", "seen", "catalog_log", "rank_log"}
    assert set(Job.__slots__) == _JOURNALED | fixed

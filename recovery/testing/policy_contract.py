"""The contract every policy passes, built-in or plugin: one pytest test case per family, subclassed once per policy.

    from recovery.testing import ReschedulingPolicyContract

    class TestInPlaceFirst(ReschedulingPolicyContract):
        policy = InPlaceFirst
        params = {"deadline_s": 90}
        entry_point = "example-in-place-first"      # optional: also check it loads by that name

The suite checks what the engine relies on and cannot check itself: the class names its family, name and version;
its parameters refuse an unknown key; the same context gives the same answer, called again, on a fresh instance, in
another order, after a pickle round trip (the daemon's snapshots hold policies) and in a process with another
`PYTHONHASHSEED` (a replay must make the decisions the daemon made); the call reads no clock and does no I/O or
randomness; and the answer is of the family's result type. It runs on hand-made contexts (`sample_calls`, extend
it with your own) and on contexts hypothesis generates (`generated_calls`). Needs pytest and hypothesis (the
`testing` extra).

The clock and I/O guard (`forbid_clock_and_io`) replaces the functions in their modules for the duration of a call:
it sees `time.time()`, `datetime.datetime.now()`, `open()`, `socket.socket()` and the like, not a function a policy
module bound to its own name at import (`from time import time`); determinism across calls, instances and processes
catches what it misses if the answer changes.
"""

from __future__ import annotations

import builtins
import datetime
import io
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from enum import Enum
from typing import Any, ClassVar

import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from events.values import FaultClass, Granularity, Tier
from policies import (
    NS,
    AttemptOutcome,
    CheckpointPlan,
    Family,
    PastIncident,
    PolicyError,
    PolicyRef,
    Reschedule,
    Settle,
    StartRung,
    Verdict,
    Wait,
    available,
    label,
    load,
)
from recovery.core.incidents import LOOP_ANSWERS, MAX_WAIT_NS
from recovery.core.sandbox import answer_problem
from recovery.testing.policy_contexts import (
    NOW,
    SIGNAL_TYPES,
    checkpoint_contexts,
    make_checkpoint_context,
    make_reschedule_context,
    make_signal,
    make_watchdog_view,
    reschedule_contexts,
    signals,
    watchdog_views,
)

Call = tuple[str, Any]
"""a method of the policy and the context it is called with: ("classify", signal)"""


# --- what a call is allowed to touch --------------------------------------------------------------------------------
class ImpureCall(AssertionError):
    """A policy read a clock, did I/O or drew a random number while deciding."""


_CLOCKS = ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time",
           "process_time_ns", "thread_time", "thread_time_ns", "localtime", "gmtime", "ctime", "asctime", "sleep")
_RANDOM = ("random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
           "normalvariate", "lognormvariate", "expovariate", "triangular", "betavariate", "gammavariate",
           "paretovariate", "weibullvariate", "vonmisesvariate", "getrandbits", "randbytes", "seed")
_OS = ("urandom", "getrandom", "open", "system", "popen", "listdir", "scandir", "stat", "remove", "unlink", "rename",
       "mkdir", "makedirs", "getenv")


@contextmanager
def forbid_clock_and_io() -> Iterator[list[str]]:
    """While inside, every clock, random-number, file, socket, subprocess and environment function of the standard
    library raises `ImpureCall`, and is listed in the list this yields (a policy that catches the exception is
    still caught)."""
    touched: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            touched.append(what)
            raise ImpureCall(f"a policy called {what} while deciding: policies read no clock and do no I/O")
        return refused

    class GuardedDateTime(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> GuardedDateTime:
            return refuse("datetime.datetime.now")()  # type: ignore[no-any-return]

        @classmethod
        def utcnow(cls) -> GuardedDateTime:
            return refuse("datetime.datetime.utcnow")()  # type: ignore[no-any-return]

        @classmethod
        def today(cls) -> GuardedDateTime:
            return refuse("datetime.datetime.today")()  # type: ignore[no-any-return]

    class GuardedDate(datetime.date):
        @classmethod
        def today(cls) -> GuardedDate:
            return refuse("datetime.date.today")()  # type: ignore[no-any-return]

    swaps: list[tuple[Any, str, Any]] = [(module, name, refuse(f"{module.__name__}.{name}"))
                                         for module, names in ((time, _CLOCKS), (random, _RANDOM), (os, _OS))
                                         for name in names if hasattr(module, name)]
    swaps += [(builtins, "open", refuse("open")), (io, "open", refuse("io.open")),
              (socket, "socket", refuse("socket.socket")),
              (socket, "create_connection", refuse("socket.create_connection")),
              (subprocess, "Popen", refuse("subprocess.Popen")), (subprocess, "run", refuse("subprocess.run")),
              (datetime, "datetime", GuardedDateTime), (datetime, "date", GuardedDate)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        yield touched
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


CALL_BUDGET_S = 2.0
"""the longest one call of a policy may take here: the engine waits for every answer, within one record"""


class PolicyTooSlow(AssertionError):
    """A policy call ran past `CALL_BUDGET_S` (a loop that never ends, or work the engine cannot wait for)."""


@contextmanager
def time_budget(what: str, seconds: float = CALL_BUDGET_S) -> Iterator[None]:
    """Raise `PolicyTooSlow` inside the block once it has run `seconds` (a `while True:` in `decide` ends the test
    instead of hanging it). A real-time interval timer's signal: only in the main thread, where pytest runs tests;
    elsewhere the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise PolicyTooSlow(f"{what} took more than {seconds:g} s: the engine waits for every policy answer")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_purely(policy: Any, call: Call) -> Any:
    """Call `policy` on one context under `forbid_clock_and_io` and a time budget, and fail if it touched a clock,
    did I/O or ran too long."""
    method, argument = call
    with forbid_clock_and_io() as touched, time_budget(f"{label(policy)}.{method}"):
        try:
            result = getattr(policy, method)(argument)
        except ImpureCall:
            result = None
    if touched:
        raise ImpureCall(f"{label(policy)}.{method} called {', '.join(dict.fromkeys(touched))} while deciding: "
                         f"policies read no clock, do no I/O and draw no random numbers")
    return result


# --- comparing answers ----------------------------------------------------------------------------------------------
def canonical(value: Any) -> Any:
    """A plain form of a policy's answer that compares equal exactly when the answers are the same, in a process with
    any hash seed: dataclasses and models by their fields in order, enums by class and value, sets sorted, and
    mappings in their own order (the order they reach the wire in)."""
    if isinstance(value, Enum):
        return (type(value).__name__, value.value)
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, tuple((f.name, canonical(getattr(value, f.name))) for f in fields(value)))
    if isinstance(value, BaseModel):
        return (type(value).__qualname__, tuple((name, canonical(getattr(value, name)))
                                                for name in type(value).model_fields))
    if isinstance(value, Mapping):
        return ("mapping", tuple((canonical(k), canonical(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted((canonical(item) for item in value), key=repr)))
    if isinstance(value, list | tuple):
        return tuple(canonical(item) for item in value)
    raise TypeError(f"a policy answered with a {type(value).__qualname__}, which is not a value type of the contract")


def answers(policy: Any, calls: Sequence[Call]) -> list[str]:
    """The canonical answer to each call, as text (what crosses a process boundary)."""
    return [repr(canonical(getattr(policy, method)(argument))) for method, argument in calls]


def answers_under_hash_seed(policy: type, params: Mapping[str, Any], calls: Sequence[Call], seed: str) -> list[str]:
    """`answers` of a fresh `policy(params)`, computed in a new interpreter with PYTHONHASHSEED=`seed`. The policy
    class and the contexts travel pickled; the child sees the same import path as this process."""
    payload = pickle.dumps((policy, dict(params), list(calls)))
    env = {**os.environ, "PYTHONHASHSEED": seed,
           "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)}
    child = subprocess.run([sys.executable, "-c", "from recovery.testing.policy_contract import answer_from_stdin; "
                            "answer_from_stdin()"], input=payload, capture_output=True, env=env, timeout=300,
                           check=False)
    if child.returncode != 0:
        raise AssertionError(f"the policy failed under PYTHONHASHSEED={seed}:\n{child.stderr.decode(errors='replace')}")
    result: list[str] = orjson.loads(child.stdout)
    return result


def answer_from_stdin() -> None:
    """The child of `answers_under_hash_seed`: a pickled (class, params, calls) in, the answers as JSON out."""
    policy, params, calls = pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(orjson.dumps(answers(policy(params), calls)))


def draw_examples(strategy: st.SearchStrategy[Any], count: int) -> list[Any]:
    """`count` examples of a strategy, the same ones on every run (hypothesis, derandomized, outside a test)."""
    drawn: list[Any] = []
    if count <= 0:
        return drawn

    @settings(max_examples=count, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(strategy)
    def collect(example: Any) -> None:
        drawn.append(example)

    collect()
    return drawn[:count]


# --- the contract ---------------------------------------------------------------------------------------------------
class PolicyContract:
    """Abstract: subclass one of the family contracts below as `Test...` and set `policy`."""

    family: ClassVar[Family]
    policy: ClassVar[type]
    """the policy class under test"""
    params: ClassVar[Mapping[str, Any]] = {}
    """the parameters it is made with, as a job spec would give them"""
    entry_point: ClassVar[str | None] = None
    """its name under the `recovery.policies` entry points, if it is registered (checked to load as this class)"""
    generated: ClassVar[int] = 60
    """contexts hypothesis generates for each property"""
    hash_seed_examples: ClassVar[int] = 40
    """generated contexts (beside the samples) compared with a process under another hash seed"""

    def make(self) -> Any:
        return self.policy(dict(self.params))

    def sample_calls(self) -> list[Call]:
        """Hand-made contexts every policy of the family must answer: extend it with your policy's own cases."""
        raise NotImplementedError

    def generated_calls(self) -> st.SearchStrategy[Call]:
        """Contexts the engine could hand over, from the strategies of `recovery.testing.policy_contexts`."""
        raise NotImplementedError

    def check_answer(self, call: Call, answer: Any) -> None:
        """The answer is of the family's result type."""
        raise NotImplementedError

    # -- identity and parameters -----------------------------------------------------------------------------------
    def test_names_its_family_name_and_version(self) -> None:
        cls = self.policy
        assert getattr(cls, "family", None) == self.family, f"{cls.__qualname__}.family must be {self.family!r}"
        for attribute in ("name", "version"):
            value = getattr(cls, attribute, None)
            assert isinstance(value, str) and value and "@" not in value, (
                f"{cls.__qualname__}.{attribute} must be a non-empty string without '@' (decisions name a policy "
                f"'name@version')")
        assert label(self.make()) == f"{cls.name}@{cls.version}"  # type: ignore[attr-defined]

    def test_refuses_an_unknown_parameter(self) -> None:
        with pytest.raises((ValidationError, PolicyError)):
            self.policy({**self.params, "no_such_key": 1})

    def test_loads_by_its_entry_point(self) -> None:
        if self.entry_point is None:
            pytest.skip("no entry point named: set `entry_point` to check the policy loads by it")
        assert available().get(self.entry_point) is self.policy, (
            f"entry point {self.entry_point!r} of group recovery.policies does not name {self.policy.__qualname__}")
        loaded = load(PolicyRef(name=self.entry_point, params=dict(self.params)), self.family)
        assert type(loaded) is self.policy
        with pytest.raises(PolicyError, match="no_such_key"):
            load(PolicyRef(name=self.entry_point, params={**self.params, "no_such_key": 1}), self.family)

    # -- pure and deterministic ------------------------------------------------------------------------------------
    def test_answers_are_of_the_familys_types(self) -> None:
        policy = self.make()
        for call in self.sample_calls():
            self.check_answer(call, getattr(policy, call[0])(call[1]))

    def test_reads_no_clock_and_does_no_io(self) -> None:
        policy = self.make()
        for call in self.sample_calls():
            call_purely(policy, call)

    def test_same_context_same_answer(self) -> None:
        """Again on the same instance, on a fresh one, in the other order: a policy keeps no state between calls
        that changes an answer."""
        calls = self.sample_calls()
        policy = self.make()
        first = answers(policy, calls)
        assert answers(policy, calls) == first, "the same instance answered the same contexts differently"
        assert answers(self.make(), calls) == first, "a fresh instance answered the same contexts differently"
        assert answers(self.make(), calls[::-1])[::-1] == first, "the answers depend on the order of the calls"

    def test_same_answer_after_a_pickle_round_trip(self) -> None:
        """The daemon's snapshots hold the policies of every job: a restored one must answer as before."""
        calls = self.sample_calls()
        policy = self.make()
        assert answers(pickle.loads(pickle.dumps(policy)), calls) == answers(policy, calls)

    def test_generated_contexts_answered_purely_and_alike(self) -> None:
        policy, fresh = self.make(), self.make()

        @settings(max_examples=self.generated, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(self.generated_calls())
        def check(call: Call) -> None:
            answer = call_purely(policy, call)
            self.check_answer(call, answer)
            assert repr(canonical(answer)) == answers(policy, [call])[0] == answers(fresh, [call])[0]

        check()

    def test_same_answers_under_another_hash_seed(self) -> None:
        """A replay runs in another process, with another hash seed: iterating a set of strings there goes in
        another order, and an answer built from that order would differ from the daemon's."""
        calls = [*self.sample_calls(), *draw_examples(self.generated_calls(), self.hash_seed_examples)]
        here = answers(self.make(), calls)
        seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
        there = answers_under_hash_seed(self.policy, self.params, calls, seed)
        for call, mine, theirs in zip(calls, here, there, strict=True):
            assert mine == theirs, f"{call[0]}({call[1]!r}) answered differently under PYTHONHASHSEED={seed}"


class DetectionPolicyContract(PolicyContract):
    """The contract of a detection policy: `classify` answers a `Verdict`, `check` a list of them."""

    family: ClassVar[Family] = "detection"

    def sample_calls(self) -> list[Call]:
        view = make_watchdog_view()
        calls: list[Call] = [("classify", make_signal(type_)) for type_ in SIGNAL_TYPES]
        calls += [("classify", make_signal("device.fault", code=xid, device=1)) for xid in ("13", "31", "48", "79",
                                                                                             "94", "999")]
        calls += [("classify", make_signal("device.fault", vendor="ascend", code=code))
                  for code in ("0x80E01801", "0x8C03A000", "0x81A3880C", "RestartRequest", "zz")]
        calls += [("classify", make_signal("device.fault", device=7)),  # a device no rank of the job uses
                  ("classify", make_signal("device.fault", nodes=(), node="idle0")),  # a node no job runs on
                  ("classify", make_signal("device.fault", device_fault_times=(NS, 2 * NS, 3 * NS))),
                  ("classify", make_signal("network.nic_errors", errors=1))]
        endings = ((0, None), (1, None), (137, None), (143, None), (-15, None), (None, 11), (None, None))
        calls += [("classify", make_signal("process.exited", rank=3, exit_code=code, signal=sig))
                  for code, sig in endings]
        calls += [("classify", make_signal("network.collective_timeout", members=[0, 1, 2, 3],
                                           reporters=[0, 1, 2, 3]))]
        calls += [("check", view),
                  ("check", make_watchdog_view(last_seen={5: view.now - 60 * NS})),  # one rank silent
                  ("check", make_watchdog_view(last_seen=dict.fromkeys(range(4, 8), view.now - 60 * NS))),  # a node
                  ("check", make_watchdog_view(last_progress=view.now - 3600 * NS)),  # no rank advances
                  ("check", make_watchdog_view(steps={2: 90}, last_progress={2: view.now - 3600 * NS})),  # one behind
                  ("check", make_watchdog_view(step_time_ns=None, last_progress=view.now - 1200 * NS))]
        return calls

    def generated_calls(self) -> st.SearchStrategy[Call]:
        return signals().map(lambda signal: ("classify", signal)) | watchdog_views().map(lambda view: ("check", view))

    def check_answer(self, call: Call, answer: Any) -> None:
        if call[0] == "classify":
            assert isinstance(answer, Verdict), f"classify answered {answer!r}, not a Verdict"
        else:
            assert isinstance(answer, list) and all(isinstance(v, Verdict) for v in answer), (
                f"check answered {answer!r}, not a list of Verdicts")
        _accepted(self.family, call, answer)


class ReschedulingPolicyContract(PolicyContract):
    """The contract of a rescheduling policy: `decide` answers a `Reschedule`: `StartRung`, `Wait`, `Settle`
    or `Fail`."""

    family: ClassVar[Family] = "rescheduling"
    waits_end: ClassVar[bool] = True
    """False only for a model of a system whose jobs wait for resources without end (the engine still bounds each
    wait and asks again; a plugin that waits forever is replaced)"""

    def sample_calls(self) -> list[Call]:
        contexts = [
            make_reschedule_context(),
            make_reschedule_context(any_lost=False),  # a step retry can help
            make_reschedule_context(previous=[(Granularity.IN_PLACE, AttemptOutcome.FAILED, 0)]),
            make_reschedule_context(previous=[(Granularity.IN_PLACE, AttemptOutcome.TIMED_OUT, 0),
                                              (Granularity.MIGRATE, AttemptOutcome.FAILED, 1)]),
            make_reschedule_context(previous=[(Granularity.IN_PLACE, AttemptOutcome.SUPERSEDED, 0)], widened=True),
            make_reschedule_context(nodes_to_replace=1),  # a node must be left, one spare
            make_reschedule_context(nodes_to_replace=2, spares_available=0),  # ... and no spare
            make_reschedule_context(nodes_to_replace=2, spares_available=0, scale_in_dp=1, dp=4),  # elastic
            make_reschedule_context(max_restarts=3, restarts_used=3),
            make_reschedule_context(forced=Granularity.RESTART_JOB),
            make_reschedule_context(step_time_ns=120 * NS),
            make_reschedule_context(sdk=False, reform=False),  # a stock script: only a job-level restart recovers it
            make_reschedule_context(sdk=False, reform=False, nodes_to_replace=1),
            make_reschedule_context(reform=False),  # steps reported, survivors that do not re-form: the same
            make_reschedule_context(  # the same crash after two recoveries: a crash loop
                now_ns=NOW, fault_step=2000, fault_ranks=(1,), restart_times=(NOW - 200 * NS, NOW - 100 * NS),
                recent=tuple(PastIncident(FaultClass.PROCESS, 2000, 1000, NOW - t * NS, NOW - t * NS + 20 * NS,
                                          "recovered", (1,)) for t in (200, 100))),
        ]
        contexts += [make_reschedule_context(fault_class=fault_class, nodes_to_replace=1) for fault_class in FaultClass]
        return [("decide", ctx) for ctx in contexts]

    def generated_calls(self) -> st.SearchStrategy[Call]:
        return reschedule_contexts().map(lambda ctx: ("decide", ctx))

    def check_answer(self, call: Call, answer: Any) -> None:
        assert isinstance(answer, Reschedule), f"decide answered {answer!r}, not a Reschedule"
        _accepted(self.family, call, answer)
        ctx = call[1]
        if isinstance(answer, StartRung) and ctx.forced is None:
            short = _unplaceable(answer, ctx)
            assert short is None, (f"decide answered {answer.granularity.value}, which the cluster cannot carry out: "
                                   f"{short}; the engine would make the job wait, and ask again the same")

    def test_settles_end(self) -> None:
        """A settle window closes with the incident no longer widened: asked again then, the policy starts
        something, waits or fails; settling again and again would never end (the engine replaces a policy that
        settles more than LOOP_ANSWERS times in a row)."""
        policy = self.make()
        for _, ctx in self.sample_calls():
            settles = 0
            answer = call_purely(policy, ("decide", ctx))
            while isinstance(answer, Settle):
                settles += 1
                assert settles <= LOOP_ANSWERS, f"decide settled {settles} times in a row on {ctx!r}"
                ctx = replace(ctx, widened=False)
                answer = call_purely(policy, ("decide", ctx))

    def test_waits_end(self) -> None:
        """A wait's deadline passes with nodes still missing: asked again (`wait_expired`), the policy falls back;
        waiting again and again would never end (the engine replaces a policy that does so LOOP_ANSWERS times)."""
        policy = self.make()
        for _, ctx in self.sample_calls():
            waits = 0
            answer = call_purely(policy, ("decide", ctx))
            while isinstance(answer, Wait):
                waits += 1
                if not self.waits_end:  # pending without end, one bounded stretch after another
                    assert answer.deadline_ns is None or answer.deadline_ns <= MAX_WAIT_NS
                    break
                assert waits <= LOOP_ANSWERS, f"decide waited {waits} times in a row, each past the last deadline"
                waited = ctx.waited_ns + (answer.deadline_ns or MAX_WAIT_NS)
                ctx = replace(ctx, wait_expired=True, waited_ns=waited)
                answer = call_purely(policy, ("decide", ctx))


class CheckpointPolicyContract(PolicyContract):
    """The contract of a checkpoint-source policy: `plan` answers a `CheckpointPlan`: `Resume`, `SaveDying` or
    `AwaitDying`."""

    family: ClassVar[Family] = "checkpoint"

    def sample_calls(self) -> list[Call]:
        both = {0: ("storage",), 1: ("storage",)}
        contexts = [
            make_checkpoint_context(),
            make_checkpoint_context(catalog={}),  # nothing saved yet
            make_checkpoint_context(alive=[True, False, True, True], restarting=frozenset({1})),
            make_checkpoint_context(alive=[True, False, True, True], restarting=frozenset({1}), peer_allowed=True),
            make_checkpoint_context(alive=[False, False, True, True], dying_allowed=False),
            make_checkpoint_context(catalog={12: {Tier.MEMORY: {0: ("n0",), 1: ("n1",)}}, 10: {Tier.STORAGE: both}},
                                    unreachable=frozenset({"n1"})),
            make_checkpoint_context(catalog={12: {Tier.MEMORY: {0: ("n0",)}}, 10: {Tier.STORAGE: both}}),
            make_checkpoint_context(alive=False, exiting=frozenset(range(4))),  # SIGTERM: dying checkpoints coming
        ]
        return [("plan", ctx) for ctx in contexts]

    def generated_calls(self) -> st.SearchStrategy[Call]:
        return checkpoint_contexts().map(lambda ctx: ("plan", ctx))

    def check_answer(self, call: Call, answer: Any) -> None:
        assert isinstance(answer, CheckpointPlan), f"plan answered {answer!r}, not a CheckpointPlan"
        _accepted(self.family, call, answer)


def _accepted(family: Family, call: Call, answer: Any) -> None:
    """The engine takes the answer as it is: every duration a nanosecond count from 1 ms to 30 days (less is taken
    for seconds given as nanoseconds), a reason that says something, ranks of the job, a job-level restart for a
    script without the SDK. An answer that fails here makes the engine ask the built-in policy instead."""
    problem = answer_problem(family, call[0], answer, call[1])
    assert problem is None, f"{call[0]} {problem}"


def _unplaceable(answer: StartRung, ctx: Any) -> str | None:
    """Why the cluster cannot carry out `answer` in `ctx`, as the engine judges it, or None."""
    g = answer.granularity
    if answer.reset_devices:
        if g is Granularity.IN_PLACE and not ctx.reset_clears:
            return "a device reset does not clear every node the job must leave"
        if g is Granularity.MIGRATE and ctx.nodes_after_reset > ctx.spares_available:
            return f"{ctx.nodes_after_reset} node(s) to move after the reset, {ctx.spares_available} spare(s)"
        return None
    if g is Granularity.MIGRATE and ctx.nodes_to_migrate > ctx.spares_available:
        return f"{ctx.nodes_to_migrate} node(s) to move, {ctx.spares_available} spare(s)"
    if g in (Granularity.RESTART_JOB, Granularity.DUMP) and ctx.nodes_to_replace > ctx.spares_available:
        return f"{ctx.nodes_to_replace} node(s) to replace, {ctx.spares_available} spare(s)"
    if g is Granularity.IN_PLACE and ctx.needs_move:
        return f"{ctx.nodes_to_replace} node(s) cannot run processes now"
    if g is Granularity.SCALE_IN and ctx.scale_in_dp is None:
        return "no smaller data-parallel size fits (or the job is not elastic)"
    if g is Granularity.SCALE_OUT:
        return "scale-out is started by the engine when nodes return, not a recovery"
    return None


CONTRACTS: dict[Family, type[PolicyContract]] = {"detection": DetectionPolicyContract,
                                                 "rescheduling": ReschedulingPolicyContract,
                                                 "checkpoint": CheckpointPolicyContract}
"""the contract of each family"""

__all__ = ["CONTRACTS", "Call", "CheckpointPolicyContract", "DetectionPolicyContract", "ImpureCall", "PolicyContract",
           "ReschedulingPolicyContract", "answers", "answers_under_hash_seed", "call_purely", "canonical",
           "draw_examples", "forbid_clock_and_io"]

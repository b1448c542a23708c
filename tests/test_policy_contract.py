"""Every built-in policy passes its family's contract (recovery.testing.policy_contract), and the contract fails the
policies it is there to catch: one that reads the clock, one whose answer follows a set's hash order, one whose
parameters take any key."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, ClassVar

import pytest

from policies import (
    NS,
    CheckpointPolicyBase,
    DetectionPolicyBase,
    Granularity,
    Ignore,
    Params,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicyBase,
    Signal,
    StartRung,
    Verdict,
    WatchdogView,
    registry,
)
from policies.baselines import (
    MindClusterLikeCheckpoint,
    MindClusterLikeDetection,
    MindClusterLikeRescheduling,
    TorchElasticLikeCheckpoint,
    TorchElasticLikeDetection,
    TorchElasticLikeRescheduling,
)
from policies.checkpoint import NewestCompleteCheckpoint
from policies.detection import DefaultDetection
from policies.rescheduling import LadderRescheduling
from recovery.testing import (
    CheckpointPolicyContract,
    DetectionPolicyContract,
    ImpureCall,
    ReschedulingPolicyContract,
    make_reschedule_context,
    make_signal,
)


# --- the built-ins --------------------------------------------------------------------------------------------------
class TestDefaultDetection(DetectionPolicyContract):
    policy = DefaultDetection
    entry_point = "default"


class TestDefaultDetectionTuned(DetectionPolicyContract):
    policy = DefaultDetection
    entry_point = "default"
    params: ClassVar[dict[str, Any]] = {"link_debounce_s": 0.0, "frequency_threshold": 1, "hang_min_silence_s": 1.0}


class TestLadderRescheduling(ReschedulingPolicyContract):
    policy = LadderRescheduling
    entry_point = "ladder"


class TestLadderReschedulingWithoutWaiting(ReschedulingPolicyContract):
    policy = LadderRescheduling
    entry_point = "ladder"
    params: ClassVar[dict[str, Any]] = {"elastic": False, "wait": False, "settle_s": 0.0,
                                        "ladders": {"process": [{"granularity": "in_place", "budget": 1},
                                                                {"granularity": "fail"}]}}


class TestNewestCompleteCheckpoint(CheckpointPolicyContract):
    policy = NewestCompleteCheckpoint
    entry_point = "newest-complete"


class TestTorchElasticLikeDetection(DetectionPolicyContract):
    policy = TorchElasticLikeDetection
    entry_point = "torchelastic-like-detection"


class TestTorchElasticLikeRescheduling(ReschedulingPolicyContract):
    policy = TorchElasticLikeRescheduling
    entry_point = "torchelastic-like-rescheduling"
    waits_end = False  # a job without resources stays pending, as under torchrun
    params: ClassVar[dict[str, Any]] = {"max_restarts": 2}


class TestTorchElasticLikeCheckpoint(CheckpointPolicyContract):
    policy = TorchElasticLikeCheckpoint
    entry_point = "torchelastic-like-checkpoint"


class TestMindClusterLikeDetection(DetectionPolicyContract):
    policy = MindClusterLikeDetection
    entry_point = "mindcluster-like-detection"


class TestMindClusterLikeRescheduling(ReschedulingPolicyContract):
    policy = MindClusterLikeRescheduling
    entry_point = "mindcluster-like-rescheduling"


class TestMindClusterLikeCheckpoint(CheckpointPolicyContract):
    policy = MindClusterLikeCheckpoint
    entry_point = "mindcluster-like-checkpoint"


def test_every_installed_built_in_has_a_contract_test_here() -> None:
    tested = {cls.entry_point for cls in globals().values()
              if isinstance(cls, type) and cls.__name__.startswith("Test") and getattr(cls, "entry_point", None)}
    built_in = {name for name, cls in registry.available().items() if cls.__module__.startswith("policies.")}
    assert built_in <= tested, sorted(built_in - tested)


# --- what the contract catches --------------------------------------------------------------------------------------
class ClockReading(ReschedulingPolicyBase):
    name = "clock-reading"
    version = "1"

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        late = time.time() > 0  # the engine's log time is the only time a policy may see
        return StartRung(Granularity.IN_PLACE, f"late: {late}")


class HashOrdered(DetectionPolicyBase):
    name = "hash-ordered"
    version = "1"

    def classify(self, signal: Signal) -> Verdict:
        nodes = {f"node-{rank}" for rank in range(signal.world)}
        return Ignore(", ".join(nodes))  # a set's order is its strings' hashes: another seed, another order

    def check(self, view: WatchdogView) -> list[Verdict]:
        return []


class AnyParams(Params, extra="allow"):
    pass


class Lax(CheckpointPolicyBase):
    name = "lax"
    version = "1"
    parameters = AnyParams

    def plan(self, ctx: Any) -> Any:
        raise NotImplementedError


class Counting(ReschedulingPolicyBase):
    name = "counting"
    version = "1"

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.asked = 0

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        self.asked += 1  # state kept between calls: a replay that starts from a snapshot would answer otherwise
        return StartRung(Granularity.IN_PLACE, f"asked {self.asked} times", 60 * NS)


def test_a_policy_that_reads_the_clock_fails_the_contract() -> None:
    class Contract(ReschedulingPolicyContract):
        policy = ClockReading

    with pytest.raises(ImpureCall, match=r"clock-reading@1\.decide called time\.time"):
        Contract().test_reads_no_clock_and_does_no_io()


def test_a_policy_answering_in_hash_order_fails_under_another_seed() -> None:
    class Contract(DetectionPolicyContract):
        policy = HashOrdered
        hash_seed_examples = 0

    with pytest.raises(AssertionError, match="answered differently under PYTHONHASHSEED"):
        Contract().test_same_answers_under_another_hash_seed()


def test_parameters_that_take_any_key_fail_the_contract() -> None:
    class Contract(CheckpointPolicyContract):
        policy = Lax

    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        Contract().test_refuses_an_unknown_parameter()


def test_a_policy_whose_answers_depend_on_earlier_calls_fails_the_contract() -> None:
    class Contract(ReschedulingPolicyContract):
        policy = Counting

    with pytest.raises(AssertionError, match="same instance answered the same contexts differently"):
        Contract().test_same_context_same_answer()


def test_factories_derive_what_the_engine_derives() -> None:
    fault = make_signal("device.fault", node="n1", device=2)
    assert fault.ranks == (6,) and fault.node_ranks == (4, 5, 6, 7) and fault.device_fault_times == (fault.ts,)
    assert make_signal("process.exited", rank=3).ranks == (3,)
    assert make_signal("device.fault", device=6).ranks == ()  # a device beyond the job's ranks on the node
    ctx = make_reschedule_context(previous=[(Granularity.IN_PLACE, "failed", 0),
                                            (Granularity.MIGRATE, "superseded", 1)])
    assert ctx.used == {"process/in_place": 1, "in_place": 1} and ctx.restarts_used == 1
    assert make_reschedule_context(nodes_to_replace=2).needs_move


def test_the_test_tools_load_pytest_and_hypothesis_only_with_the_policy_kit() -> None:
    """`Scenario` users need neither: the kit is exported from recovery.testing but loaded when first used."""
    script = ("import sys, recovery.testing as t; before = {'pytest', 'hypothesis'} & set(sys.modules); "
              "t.ReschedulingPolicyContract, t.make_signal; print(sorted(before), sorted({'pytest', 'hypothesis'} & "
              "set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["[]", "['hypothesis',", "'pytest']"]

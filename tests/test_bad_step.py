"""Bad steps on the engine: a NaN, infinite or spiking loss rolls every rank back to the newest checkpoint before it,
and every later resume plan skips its data (the end-to-end run is tests/test_e2e_bad_step.py)."""

from __future__ import annotations

import math

import pytest

from events.commands import RestartJob
from events.values import FaultClass
from policies.base import Fault, Ignore, LossSample, Signal
from policies.detection import DefaultDetection
from recovery.core.sandbox import answer_problem
from recovery.testing.policy_contexts import LOSS_SIGNAL, make_signal
from recovery.testing.scenario import Scenario


def _loss(policy: DefaultDetection, loss: float, losses: tuple[float, ...] = ()) -> object:
    return policy.classify(Signal("progress.loss", LossSample(2, 40, loss), 0, None, (2,), world=4, losses=losses))


@pytest.mark.parametrize(("loss", "word"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_a_non_finite_loss_is_a_bad_step_of_the_whole_job(loss: float, word: str) -> None:
    verdict = _loss(DefaultDetection(), loss)
    assert isinstance(verdict, Fault)
    assert verdict.reason == f"loss {word} at step 40 on rank 2"
    assert verdict.fault_class is FaultClass.BAD_STEP and verdict.bad_step == 40
    assert verdict.scope == "job" and verdict.ranks == (0, 1, 2, 3) and not verdict.lost


def test_a_spike_is_measured_against_the_median_of_the_window_once_enough_losses_are_known() -> None:
    policy = DefaultDetection({"loss_spike_factor": 3.0, "loss_window": 4, "loss_min_samples": 4})
    assert isinstance(_loss(policy, 50.0, (1.0, 1.0, 1.0)), Ignore)  # three known: too few to judge a spike
    assert isinstance(_loss(policy, 2.9, (1.0,) * 4), Ignore)
    spike = _loss(policy, 3.5, (1.0,) * 4)
    assert isinstance(spike, Fault) and "a spike, 3.5 times the median 1" in spike.reason
    # Only the last `loss_window` count: an old high loss no longer hides a spike.
    assert isinstance(_loss(policy, 3.5, (9.0, 9.0, 9.0, 9.0, 1.0, 1.0, 1.0, 1.0)), Fault)
    assert isinstance(_loss(DefaultDetection({"loss_checks": False}), math.nan), Ignore)


def _training(s: Scenario, first: int, last: int, attempt: int = 0, loss: float = 1.0) -> None:
    for step in range(first, last + 1):
        s.advance(1)
        for rank in range(2):
            s.job_event("j", "progress.step", rank=rank, step=step, attempt=attempt, loss=loss)


def test_a_spike_skips_its_step_by_default_and_a_later_restart_still_skips_it() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=1, dp=2)
    _training(s, 1, 12)
    s.checkpoint("j", 10, "storage", "storage")
    s.advance(1)
    s.job_event("j", "progress.step", rank=0, step=13, loss=42.0)  # no data named: the step itself is skipped
    [confirmed] = s.find("fault.confirmed")
    assert confirmed.reason.startswith("loss 42 at step 13 on rank 0: a spike, 42 times the median 1")
    s.ack_all()
    [restart] = s.commands_of("restart_ranks")
    assert restart.ranks == [0, 1] and restart.plan.checkpoint_step == 10 and restart.plan.skip_steps == [13]
    _training(s, 11, 14, attempt=1)
    assert s.engine.jobs["j"].incident is None and s.engine.jobs["j"].skip_steps == (13,)
    s.checkpoint("j", 14, "storage", "storage")
    s.job_event("j", "process.exited", rank=1, exit_code=1, attempt=1)  # a crash later: its plan skips 13 too
    s.ack_all()
    restarts = s.commands_of("restart_ranks")
    assert len(restarts) == 2 and restarts[1].plan.skip_steps == [13] and restarts[1].ranks == [1]


def test_a_bad_step_of_the_rolled_back_processes_fails_the_attempt_and_the_ladder_goes_on() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=1, dp=2)
    _training(s, 1, 6)
    s.checkpoint("j", 5, "storage", "storage")
    s.job_event("j", "progress.step", rank=1, step=7, loss="inf", skip=["b7"])
    s.ack_all()
    s.advance(1)
    s.job_event("j", "progress.step", rank=0, step=6, attempt=1, loss="nan", skip=["b6"])
    assert [d.reason for d in s.find("attempt.failed")] == [
        "attempt 1 (in_place) failed: loss nan at step 6 on rank 0"]
    s.ack_all()
    [first, second] = s.commands_of("restart_ranks") + s.commands_of("restart_job")
    assert first.plan.checkpoint_step == 5 and first.plan.skip_data == ["b7"]
    # The next rung of the ladder (the whole job); both bad steps are skipped, and it rolls back before the earlier one.
    assert isinstance(second, RestartJob) and second.attempt == 2
    assert second.plan.checkpoint_step == 5 and second.plan.skip_data == ["b7", "b6"]
    s.advance(1)
    s.steps("j", 6)
    assert s.engine.jobs["j"].incident is None and len(s.find("incident.closed")) == 1


def test_a_plugins_bad_step_that_is_no_step_is_its_error_and_the_kit_makes_loss_signals() -> None:
    signal = make_signal(LOSS_SIGNAL, rank=1, step=7, loss=math.inf)
    assert signal.data == LossSample(1, 7, math.inf) and len(signal.losses) == 16
    assert answer_problem("detection", "classify", Fault("bad", bad_step=-1), signal) == (
        "answered a fault whose bad_step is -1, not a step (an integer, 0 or more)")
    assert answer_problem("detection", "classify", DefaultDetection().classify(signal), signal) is None


def test_of_a_reports_nans_the_earliest_steps_is_rolled_back_and_its_later_ones_decide_nothing() -> None:
    s = Scenario()
    s.submit("j", ["n0"], ranks_per_node=2, dp=2)
    _training(s, 1, 8)
    s.checkpoint("j", 6, "storage", "storage")
    s.job_event("j", "progress.report", ranks=[{"rank": 0, "step": 10, "loss": "nan", "loss_step": 10},
                                               {"rank": 1, "step": 9, "loss": "nan", "loss_step": 9, "skip": ["b"]}])
    s.job_event("j", "progress.report", ranks=[{"rank": 1, "step": 11, "loss": "nan", "loss_step": 11}])
    [confirmed] = s.find("fault.confirmed")
    assert confirmed.reason == "loss nan at step 9 on rank 1" and not s.find("fault.added")
    s.ack_all()
    [restart] = s.commands_of("restart_ranks")
    assert restart.plan.checkpoint_step == 6 and restart.plan.skip_data == ["b"] and restart.plan.skip_steps == []

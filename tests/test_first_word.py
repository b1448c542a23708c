"""A rank whose process has not spoken yet is not a hang by the silence bound: at a job's start its peers may report
(heartbeats from the SDK) while it is still importing its framework, seconds later on a loaded host and minutes on a
cold shared filesystem. It is judged by the bound the job's first steps get (`first_steps_s`, or the stall bound once
the step time is known), as its peers waiting in their first collective would be; a rank that spoke once and then fell
silent is found at the silence bound as before, and a restarted process is new: it has not spoken until it does."""

from __future__ import annotations

from policies.base import NS
from policies.detection import DefaultDetection
from recovery.log.recorder import replay
from recovery.testing.policy_contexts import make_watchdog_view
from recovery.testing.scenario import Scenario

SILENCE_S = 5.0
FIRST_STEPS_S = 60.0


def _started(importing: int) -> Scenario:
    """Job j (4 ranks on two nodes, a 5 s silence bound, 60 s for the first steps): every process started, every rank
    but `importing` heartbeating each second from then on."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], 2, dp=4, watchdog_interval_s=1.0,
             policies={"detection": {"name": "default", "params": {"hang_min_silence_s": SILENCE_S,
                                                                   "first_steps_s": FIRST_STEPS_S}}})
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0)
    return s


def _heartbeats(s: Scenario, seconds: int, ranks: list[int]) -> None:
    for _ in range(seconds):
        s.advance(1)
        for rank in ranks:
            s.job_event("j", "process.heartbeat", rank=rank, attempt=0)


def test_a_rank_still_importing_while_its_peers_heartbeat_is_no_hang_until_the_first_steps_bound() -> None:
    s = _started(importing=3)
    _heartbeats(s, 30, [0, 1, 2])  # six silence bounds: the peers speak, rank 3 has said nothing
    assert s.find("fault.confirmed", "j") == [] and s.state("j") == "running"
    assert s.engine.jobs["j"].spoke == bytearray([1, 1, 1, 0])
    _heartbeats(s, 32, [0, 1, 2])  # past 60 s: a process that never spoke is found, alone
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [3], hang.detail
    assert hang.detail["fault"]["scope"] == "rank", hang.detail
    assert "not heard since their processes started, more than 60.0s" in hang.reason, hang.reason


def test_a_rank_that_spoke_and_fell_silent_is_found_at_the_silence_bound() -> None:
    s = _started(importing=-1)
    _heartbeats(s, 2, [0, 1, 2, 3])
    _heartbeats(s, 7, [0, 1, 2])  # rank 3 spoke, then nothing: a hang after 5 s, not 60
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [3], hang.detail


def test_a_restarted_process_has_not_spoken_until_it_does_and_the_replay_agrees() -> None:
    s = _started(importing=-1)
    _heartbeats(s, 2, [0, 1, 2, 3])
    s.job_event("j", "process.started", rank=2, pid=200, attempt=0)  # the agent started it again (its own restart)
    assert s.engine.jobs["j"].spoke == bytearray([1, 1, 0, 1])
    _heartbeats(s, 1, [0, 1, 2, 3])
    assert s.engine.jobs["j"].spoke == bytearray([1, 1, 1, 1])
    again = replay(list(s.log.records()))
    assert again.engine.jobs["j"].spoke == s.engine.jobs["j"].spoke
    assert again.decisions == again.recorded_decisions == s.decisions


def test_the_policy_judges_an_unspoken_rank_by_the_first_steps_bound_and_the_stall_bound_after() -> None:
    policy = DefaultDetection({"hang_min_silence_s": SILENCE_S, "first_steps_s": FIRST_STEPS_S, "stall_min_s": 20.0})
    now = 1_000 * NS
    quiet = {3: now - 15 * NS}  # 15 s without a word: past the silence bound, within the first steps' and the stall
    for step_time in (None, NS):
        view = make_watchdog_view(now=now, step_time_ns=step_time, last_seen=quiet, unspoken=[3])
        assert policy.check(view) == [], step_time
        assert policy.next_check(view) == now + int(SILENCE_S) * NS + 1  # the spoken ranks' silence comes first
        starting = make_watchdog_view(now=now, step_time_ns=step_time, last_seen=quiet, unspoken=range(8))
        assert policy.next_check(starting) == now - 15 * NS + (60 if step_time is None else 20) * NS + 1
        spoken = make_watchdog_view(now=now, step_time_ns=step_time, last_seen=quiet)
        [fault] = policy.check(spoken)
        assert fault.ranks == (3,)
    late = make_watchdog_view(now=now, step_time_ns=NS, last_seen={3: now - 21 * NS}, unspoken=[3])
    [fault] = policy.check(late)
    assert fault.ranks == (3,)

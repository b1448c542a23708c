"""A progress summary that stands for its job's watchdog tick (`ProgressSummary.watch`): the check runs at the summary,
and the watchdog's next tick moves to when the check could first find anything (`DefaultDetection.next_check`). A
healthy job whose summaries come logs no tick at all; a rank that falls silent is found at its bound, not a watchdog
interval after it; summaries written before (no `watch`) leave the periodic watchdog as it was."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from policies.base import NS, WatchdogView
from policies.detection import DefaultDetection
from recovery.core.sandbox import knows_deadlines
from recovery.log.recorder import replay
from recovery.service.summaries import ProgressSummaries
from recovery.testing.policy_contexts import make_watchdog_view
from recovery.testing.scenario import Scenario


def _running(**spec: Any) -> Scenario:
    s = Scenario()
    s.submit("j", ["n0", "n1"], 2, dp=4, watchdog_interval_s=2.0, **spec)
    s.train("j", 3)
    return s


def _summary(s: Scenario, ranks: range | list[int], step: int, heard_s: float = 0.5, watch: bool = True,
             period_s: float = 4.0) -> None:
    entries = [{"rank": r, "step": step, "attempt": 0, "heard_s": heard_s} for r in ranks]
    s.job_event("j", "progress.summary", ranks=entries, period_s=period_s, **({"watch": True} if watch else {}))


def _ticks(s: Scenario, since: int = 0) -> list[int]:
    """Log times of the watchdog's firings of job j after `since`."""
    return [r.ts for r in s.log.records() if r.seq > since and r.subject.endswith("timer.fired")
            and "/watchdog/" in r.envelope.data.timer_id]


def test_a_healthy_job_whose_summaries_come_logs_no_watchdog_tick() -> None:
    """Every rank summarized every 4 s for a minute (a 2 s watchdog interval, a 10 s silence bound): not one tick,
    and the driver's timer table holds the watchdog where the engine moved it, past the next summary."""
    s = _running()
    job = s.engine.jobs["j"]
    _summary(s, range(4), 3)  # from the first on, the summaries pace the watchdog
    start = len(list(s.log.records()))
    for k in range(15):
        s.advance(4)
        _summary(s, range(4), 4 + k)
        due = s.engine.timers[job.watchdog][1]
        assert due > s.now + 4 * NS  # the next summary moves it again before it is due
        assert s.recorder.timers.get(job.watchdog) == s.engine.timers[job.watchdog]
    assert _ticks(s, start) == []
    assert s.find("fault.confirmed", "j") == [] and s.state("j") == "running"


def test_a_rank_missing_from_the_summaries_is_found_at_the_first_summary_past_its_bound() -> None:
    """Rank 3 is summarized no more: the summary after its silence passed the 10 s bound finds it (11 s), before the
    tick moved to its deadline and an interval (12 s), and no tick was logged; the hang names rank 3 alone."""
    s = _running()
    _summary(s, range(4), 4, heard_s=0.0)
    start, last_heard = len(list(s.log.records())), s.now
    found = None
    for k, gap in enumerate((3, 4, 4, 4), start=1):
        s.advance(gap)
        _summary(s, range(3), 4 + k)
        if found is None and s.find("fault.confirmed", "j"):
            found = s.now
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [3], hang.detail
    assert found == last_heard + 11 * NS
    assert _ticks(s, start) == []


def test_a_rank_whose_summaries_are_late_is_found_by_the_tick_at_its_deadline_and_an_interval() -> None:
    """Rank 3 was last heard at the summary; the next summaries come 8 s apart (later than its deadline): the tick the
    first one moved to the deadline and an interval (12 s) finds it, between two summaries."""
    s = _running()
    _summary(s, range(4), 4, heard_s=0.0, period_s=8.0)
    last_heard = s.now
    s.advance(8)
    _summary(s, range(3), 5, period_s=8.0)
    s.advance(5)
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [3]
    assert _ticks(s)[-1] == last_heard + 10 * NS + 1 + 2 * NS


def test_a_job_whose_summaries_stop_is_excused_once_then_found_a_bound_later() -> None:
    """No word of any rank after the last summary: the watchdog, moved by it a period and an interval on (4 + 2 s),
    ticks there once; that tick cannot tell a daemon away or replaced from a job gone silent, so it does not count
    the silence so far (`watchdog.resumed`), and the watchdog ticks every interval again. The job found silent a
    bound after: 18 s after its ranks' last word (the deadline's tick would have been at 12)."""
    s = _running()
    _summary(s, range(4), 4, heard_s=0.0)
    start, last_heard = len(list(s.log.records())), s.now
    found = None
    for _ in range(48):
        s.advance(0.5)
        if found is None and s.find("fault.confirmed", "j"):
            found = s.now
    assert _ticks(s, start)[0] == last_heard + 6 * NS
    assert len(s.find("watchdog.resumed", "j")) == 1
    assert found == last_heard + 18 * NS


def test_a_summary_that_comes_when_the_tick_is_overdue_excuses_the_silence_as_the_late_tick_would() -> None:
    """The control plane was away 30 s (nothing logged, not the tick either); its first summary after hears two ranks
    of four. The watchdog's tick was due long before: the summary is that late tick, and the silence up to it is the
    control plane's, not the ranks'. No fault; ranks 2 and 3 are found only if they stay unheard a bound after."""
    s = _running()
    _summary(s, range(4), 4, heard_s=0.0)
    back = s.now + 30 * NS
    s.now = back  # nothing fired meanwhile: the daemon could not log anything
    _summary(s, range(2), 5)
    assert s.find("fault.confirmed", "j") == []
    assert s.engine.jobs["j"].last_seen[2:] == [back, back]
    for _ in range(4):
        s.advance(4)
        _summary(s, range(2), 5)
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [2, 3]


def test_summaries_without_watch_leave_the_periodic_watchdog_ticking() -> None:
    """A log written before (its summaries carry no `watch`): the watchdog ticks every interval, as it always did."""
    s = _running()
    start = len(list(s.log.records()))
    for k in range(5):
        s.advance(4)
        _summary(s, range(4), 4 + k, watch=False)
    assert len(_ticks(s, start)) == 10  # 20 s of a 2 s interval


def test_a_policy_whose_check_is_not_the_ladders_ticks_an_interval_after_each_summary() -> None:
    """A check of its own and the ladder's `next_check` inherited: the deadlines are not its check's, so none are
    used; its watchdog ticks an interval after each summary, and between summaries as its interval says."""

    class Strict(DefaultDetection):
        def check(self, view: WatchdogView) -> list[Any]:
            return []

    Strict.__module__ = DefaultDetection.__module__  # as a policy of ours, so that only the rule below decides
    assert knows_deadlines(DefaultDetection()) and not knows_deadlines(Strict())
    s = _running()
    job = s.engine.jobs["j"]
    job.policies = type(job.policies)(**{**{f: getattr(job.policies, f) for f in ("rescheduling", "checkpoint",
                                                                                   "labels")},
                                         "detection": Strict()})
    s.advance(1)
    _summary(s, range(4), 4)
    assert s.engine.timers[job.watchdog][1] == s.now + 2 * NS


def test_the_moved_watchdog_replays_to_the_same_state_and_decisions() -> None:
    """The log of summaries, a silence and its recovery replays into the same decisions and the same timer table."""
    s = _running()
    for k in range(1, 5):
        s.advance(4)
        _summary(s, range(3) if k > 1 else range(4), 4 + k)
    s.ack_all()
    assert s.find("fault.confirmed", "j")
    again = replay(list(s.log.records()))
    assert again.decisions == again.recorded_decisions == s.decisions
    assert again.engine.timers == s.engine.timers


@settings(max_examples=500, deadline=None)
@given(st.data(), st.sampled_from([1, 10, 100]), st.sampled_from([1, 20, 60]), st.one_of(st.none(), st.integers(1, 3)),
       st.booleans())
def test_the_check_finds_nothing_before_next_check_says(data: st.DataObject, silence_s: int, stall_s: int,
                                                        step_s: int | None, sdk: bool) -> None:
    """Soundness of the deadlines: where the check finds nothing at `now`, it finds nothing at any time before
    `next_check`, and the deadline is after `now`. The ranks' ages are drawn within the bounds, so that each rule
    (silence, stall, ranks behind, a silent agent) is the first to fall due in some draws."""
    now = 1_000 * NS
    first_steps_s = stall_s * 2
    policy = DefaultDetection({"hang_min_silence_s": float(silence_s), "stall_min_s": float(stall_s),
                               "first_steps_s": float(first_steps_s)})
    silence_ms = max(silence_s, 5 * (step_s or 0)) * 1000  # each rule's bound, as the policy's parameters make it
    stall_ms = (first_steps_s if step_s is None else max(stall_s, 10 * step_s)) * 1000
    # Some ranks' processes have not spoken yet: judged by the first steps' (or the stall) bound, so drawn that far.
    unspoken = data.draw(st.sets(st.integers(0, 3)))
    seen_ms = data.draw(st.lists(st.integers(0, (max(silence_ms, stall_ms) if unspoken else silence_ms) + 1000),
                                 min_size=4, max_size=4))
    progress_ms = data.draw(st.lists(st.integers(0, stall_ms + 1000), min_size=4, max_size=4))
    behind = data.draw(st.lists(st.integers(0, 2), min_size=4, max_size=4))
    heard_ms = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 6000)), min_size=2, max_size=2))
    moment = now + data.draw(st.integers(1, 2 * first_steps_s * 1000)) * NS // 1000

    def at(t: int) -> WatchdogView:
        return make_watchdog_view(now=t, nodes=("a", "b"), ranks_per_node=2,
                                  step_time_ns=None if step_s is None else step_s * NS,
                                  last_seen=[now - a * NS // 1000 for a in seen_ms],
                                  last_progress=[now - a * NS // 1000 for a in progress_ms],
                                  steps=[100 - b for b in behind],
                                  agents_heard=[None if h is None else now - h * NS // 1000 for h in heard_ms],
                                  sdk=sdk, unspoken=unspoken)

    if policy.check(at(now)):
        return
    deadline = policy.next_check(at(now))
    if deadline is None or moment < deadline:
        assert policy.check(at(moment)) == []
    if deadline is not None:
        assert deadline > now


def test_what_the_daemon_hears_while_it_may_not_write_goes_into_its_first_summary() -> None:
    """The daemon heard node n1's report while it could not write (cut off, behind the log): its first summary after
    holds n1's ranks beside n0's, on the job's one record, marked `watch`."""

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    def report(node: str, ranks: list[int], step: int) -> tuple[str, bytes]:
        env = make_envelope("progress.report", {"ranks": [{"rank": r, "step": step, "attempt": 0} for r in ranks]},
                            id=f"{node}-{step}", job="j", node=node, source="agent")
        return subjects.reports(node), encode_envelope(env)

    s, clock = _running(), Clock()
    summaries = ProgressSummaries(lambda: s.engine, 4.0, clock=clock)
    summaries.hear(*report("n0", [0, 1], 4))
    clock.now += 1
    summaries.hear(*report("n1", [2, 3], 4))
    clock.now += 4
    assert summaries.look(may_write=False) == []  # due, but not the daemon's to write: kept
    clock.now += 6
    summaries.hear(*report("n0", [0, 1], 5))
    [message] = summaries.look(may_write=True)
    data = orjson.loads(message.data)["data"]
    assert sorted(e["rank"] for e in data["ranks"]) == [0, 1, 2, 3] and data["watch"] is True
    assert summaries.look(may_write=True) == []

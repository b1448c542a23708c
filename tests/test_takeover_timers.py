"""A daemon that takes a partition from an old snapshot fires no timer before it has caught up with the log: the
backlog moves timers with no decision (a watch summary moves its job's watchdog), so the snapshot's table is stale,
and a firing made from it would be refused as early, a dead letter for each of the partition's jobs."""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from recovery.core.timers import Firing
from recovery.log import MSG_ID
from recovery.service.processor import Processor
from recovery.service.publisher import Outgoing
from recovery.service.summaries import ProgressSummaries
from recovery.service.timers import HOLD_S, TimerService
from recovery.testing.nats import NatsServer
from recovery.testing.scenario import Scenario
from tests.daemon_support import async_wait_for, check_log, connect, read_stream, running_daemon
from tests.test_daemon import ctl, spec

NS = 1_000_000_000


def summary(step: int, period_s: float) -> bytes:
    """A watch summary of job j's four ranks, all at `step` and heard just now."""
    ranks = [{"rank": r, "step": step, "attempt": 0, "heard_s": 0.0} for r in range(4)]
    return encode_envelope(make_envelope("progress.summary", {"ranks": ranks, "period_s": period_s, "watch": True},
                                         id=f"summary-{step}", job="j", source="recovery-daemon/summaries"))


async def test_a_takeover_from_an_old_snapshot_fires_no_timer_its_backlog_moved(nats_server: NatsServer,
                                                                              tmp_path: Path) -> None:
    url, period_s = nats_server.url, 1.0
    subject = subjects.job_event("j", "progress.summary")
    nc, js = await connect(url)
    try:
        async with running_daemon(url, tmp_path / "a", snapshot_every_s=3600.0) as first:
            await ctl(url, "submit", job="j", spec=spec(["a", "b"], watchdog_interval_s=0.5))
            await ctl(url, "inject", type="job.started", job="j")
            first_summary = await js.publish(subject, summary(1, period_s), headers={MSG_ID: "summary-1"})
            await first.wait_applied(first_summary.seq, 10)
            watchdog = first.engine.jobs["j"].watchdog
            assert watchdog is not None
            stale = first.engine.timers[watchdog][1]  # where the final snapshot holds it: a period and an interval on
        # While no daemon runs, a summary comes past the snapshot's due time (a takeover's backlog): it moves the
        # watchdog after it.
        await async_wait_for(lambda: time.time_ns() > stale + NS // 2, 10, "the snapshot's due time to pass")
        last = await js.publish(subject, summary(2, period_s), headers={MSG_ID: "summary-2"})
        async with running_daemon(url, tmp_path / "b", snapshot_every_s=3600.0) as second:
            assert second.restored_seq < last.seq  # it took the partition from the old snapshot, and replayed the rest

            # The summaries stopped: the watchdog's one tick at the moved due time is the first firing of the run.
            async def resumed() -> bool:
                return any(isinstance(r, Record) and r.envelope.type == "decision"
                           and r.envelope.data.kind == "watchdog.resumed" for r in await read_stream(url))

            await async_wait_for(resumed, 30, "the watchdog's tick at its moved due time")
    finally:
        await nc.close()
    records = await read_stream(url)
    dead = [r.envelope.data for r in records if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]
    assert dead == []
    [moving] = [r for r in records if isinstance(r, Record) and r.envelope.id == "summary-2"]
    firings = [r for r in records if isinstance(r, Record) and r.envelope.type == "timer.fired" and r.seq > moving.seq]
    # The first firing after that summary is the moved tick's (a period and an interval after it), none the snapshot's.
    assert firings and firings[0].envelope.data.due == moving.ts + int((0.5 + period_s) * NS), firings[0]
    assert firings[0].envelope.data.due > stale and firings[0].ts >= firings[0].envelope.data.due
    check_log(records)


def test_a_watchdog_tick_waits_for_the_watch_summary_on_its_way_and_fires_if_it_never_comes() -> None:
    """A watch summary made for job j (`ProgressSummaries.watching`): j's watchdog tick due meanwhile is not sent
    until the summary is applied, which moves it (then the moved tick alone fires, when due), or until the hold is
    over (then it fires, under its re-fire id), or another watch summary of the job was applied, or the summary's
    publish failed; another job's tick is not held."""
    s = Scenario()
    for job in ("j", "k"):
        s.submit(job, [f"{job}0"], 2, dp=2, watchdog_interval_s=2.0)
    processor = Processor(s.engine)
    processor.timers.load(s.engine.timers)
    clock = [0]
    service = TimerService(processor, _never, lambda: clock[0])
    [j_watchdog, k_watchdog] = (s.engine.jobs[job].watchdog for job in ("j", "k"))
    summaries = ProgressSummaries(lambda: s.engine, 10.0, clock=lambda: clock[0] / NS, watching=service)

    def summarize(step: int) -> Outgoing:
        """j's watch summary, made a second before its watchdog's tick is due."""
        clock[0] = s.engine.timers[j_watchdog][1] - NS
        summaries.hear("recovery.progress.j0", orjson.dumps({"type": "progress.report", "job": "j", "node": "j0",
                                                             "data": {"ranks": [{"rank": r, "step": step, "attempt": 0}
                                                                                for r in range(2)]}}))
        [summary] = summaries.messages(force=True)
        assert orjson.loads(summary.data)["data"]["watch"] is True and summaries.watched == ["j"]
        return summary

    summary = summarize(1)
    due, until = s.engine.timers[j_watchdog][1], clock[0] + int(HOLD_S * NS)
    clock[0] = max(due, s.engine.timers[k_watchdog][1])
    assert [f.timer_id for f in service.due(clock[0])] == [k_watchdog]  # j's waits for its summary
    # Applied, the summary moves j's watchdog: the held tick is not sent, the moved one is, when due.
    s.now = clock[0]
    processor.apply(s.log.append_sync(summary.subject, summary.data).record)  # type: ignore[arg-type]
    moved = s.engine.timers[j_watchdog][1]
    assert due < moved < until
    assert service.due(moved - 1) == []
    [tick] = service.due(moved)
    assert (tick.timer_id, tick.due, tick.refired_at) == (j_watchdog, moved, None)
    s.now = moved
    fired = make_envelope("timer.fired", {"timer_id": j_watchdog, "due": moved}, id="tick", job="j")
    processor.apply(s.log.append_sync(subjects.job_event("j", "timer.fired"), fired).record)  # type: ignore[arg-type]
    j_watchdog = s.engine.jobs["j"].watchdog  # the summaries stopped, as far as the engine knows: it ticks on
    assert j_watchdog is not None and s.engine.timers[j_watchdog][1] > moved
    # A summary that never comes: the tick goes once the hold is over, for the same due time.
    summarize(2)
    later, until = s.engine.timers[j_watchdog][1], clock[0] + int(HOLD_S * NS)
    assert service.due(later) == [] and service.due(until - 1) == []
    [late] = service.due(until)
    assert (late.timer_id, late.due, late.refired_at) == (j_watchdog, later, until)
    s.now = until
    fired = make_envelope("timer.fired", {"timer_id": j_watchdog, "due": later}, id="late", job="j")
    processor.apply(s.log.append_sync(subjects.job_event("j", "timer.fired"), fired).record)  # type: ignore[arg-type]
    # A watch summary applied that left the tick where it was (its check opened an incident, and the watchdog goes on
    # watching the agents): the tick waits no more either.
    summarize(3)
    clock[0] = s.engine.timers[j_watchdog][1]
    assert service.due(clock[0]) == []
    processor.watches["j"] += 1  # as `EffectRouter.route` counts a watch summary it applied
    [after] = service.due(clock[0] + int(HOLD_S * NS) // 2)
    assert after.timer_id == j_watchdog
    s.now = after.refired_at  # type: ignore[assignment]
    fired = make_envelope("timer.fired", {"timer_id": j_watchdog, "due": after.due}, id="after", job="j")
    processor.apply(s.log.append_sync(subjects.job_event("j", "timer.fired"), fired).record)  # type: ignore[arg-type]
    # A summary whose publish failed: the tick waits no more.
    summarize(4)
    clock[0] = s.engine.timers[j_watchdog][1]
    assert service.due(clock[0]) == []
    service.release(summaries.watched)
    [released] = service.due(clock[0])
    assert (released.timer_id, released.due) == (j_watchdog, clock[0])


async def _never(fired: list[Firing]) -> None:
    raise AssertionError("nothing is fired through the service here")

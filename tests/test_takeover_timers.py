"""A daemon that takes a partition from an old snapshot fires no timer before it has caught up with the log: the
backlog moves timers with no decision (a watch summary moves its job's watchdog), so the snapshot's table is stale,
and a firing made from it would be refused as early, a dead letter for each of the partition's jobs."""

from __future__ import annotations

import time
from pathlib import Path

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from recovery.log import MSG_ID
from recovery.testing.nats import NatsServer
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
            moved = second.engine.timers[watchdog][1]
            assert moved > stale
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
    firings = [r for r in records if isinstance(r, Record) and r.envelope.type == "timer.fired"]
    assert firings and firings[0].envelope.data.due == moved  # the first, and none from the snapshot's table
    check_log(records)

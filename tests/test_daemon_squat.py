"""Ids a publisher of inputs can predict cannot suppress what the daemon writes: a decision, a dead letter and a
watchdog firing each still reach the log after an input took their plain id first (`recovery.service.seal`)."""

from __future__ import annotations

from pathlib import Path

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from recovery.testing.nats import NatsServer
from tests.daemon_support import async_wait_for, check_log, connect, read_stream, running_daemon, stream_last_seq
from tests.test_daemon import ctl, spec

GARBAGE = b"{not json"


async def squat(url: str, job: str, ids: list[str]) -> int:
    """Store one garbage input under each of `ids`, as a hostile publisher would; the last sequence after them."""
    nc, js = await connect(url)
    try:
        seq = 0
        for ident in ids:
            ack = await js.publish(subjects.job_event(job, "process.exited"), GARBAGE, headers={"Nats-Msg-Id": ident})
            assert not ack.duplicate
            seq = ack.seq
        return seq
    finally:
        await nc.close()


async def test_squatted_decision_and_dead_letter_ids_do_not_suppress_them(nats_server: NatsServer,
                                                                          tmp_path: Path) -> None:
    url = nats_server.url
    async with running_daemon(url, tmp_path / "data", timers_enabled=False):
        await ctl(url, "submit", job="j", spec=spec(["a", "b"]))
        assert (await ctl(url, "inject", type="job.started", job="j"))["applied"]  # and its effects published
    # With no daemon writing, the sequences are known: the crash will be input last+6, the forgery dead-lettered
    # before it last+5 (rej:<seq> is a dead letter's id, dec:<job>:<seq>:<i> a decision's). Squat all five first.
    last = await stream_last_seq(url)
    crash_seq, bad_seq = last + 6, last + 5
    taken = await squat(url, "j", [*(f"dec:j:{crash_seq}:{i}" for i in range(3)), f"rej:{bad_seq}"])
    assert taken == last + 4
    nc, js = await connect(url)
    try:
        forged = await js.publish(subjects.job_event("j", "process.exited"), b"[]", headers={"Nats-Msg-Id": "bad"})
        assert forged.seq == bad_seq
        crash = make_envelope("process.exited", {"rank": 1, "exit_code": 1}, id="crash", job="j", source="test")
        ack = await js.publish(subjects.job_event("j", "process.exited"), encode_envelope(crash),
                               headers={"Nats-Msg-Id": crash.id})
        assert ack.seq == crash_seq
    finally:
        await nc.close()
    async with running_daemon(url, tmp_path / "data", timers_enabled=False) as d:
        await async_wait_for(lambda: d.engine.last_seq >= crash_seq, 20, "the daemon to apply the crash")
        assert d.engine.jobs["j"].incident is not None
        await d.quiesce()  # its effects published
    records = await read_stream(url)
    outputs = [r for r in records if isinstance(r, Record) and subjects.is_output(r.subject)]
    decisions = [r.envelope.id for r in outputs if r.envelope.type == "decision"
                 and r.envelope.data.cause_seq == crash_seq]
    assert decisions[:3] == [f"dec:j:{crash_seq}:{i}" for i in range(3)]
    letters = [r.envelope.id for r in outputs if r.envelope.type == "rejection"]
    assert f"rej:{bad_seq}" in letters
    result = check_log(records)  # the log holds every decision the replay makes, no more
    assert len(result.recorded_decisions) == len(result.decisions)


async def test_a_squatted_timer_id_does_not_suppress_the_watchdog(nats_server: NatsServer, tmp_path: Path) -> None:
    url = nats_server.url
    async with running_daemon(url, tmp_path / "data", timers_enabled=True) as d:
        quick = {"detection": {"name": "default", "params": {"hang_min_silence_s": 60}}}
        await ctl(url, "submit", job="w", spec=spec(["w0"], watchdog_interval_s=2.0, policies=quick))
        await ctl(url, "inject", type="job.started", job="w")
        await async_wait_for(lambda: any("watchdog" in t for t in d.engine.timers), 10, "the watchdog's timer")
        timer_id = next(t for t in sorted(d.engine.timers) if "watchdog" in t)
        entry = d.engine.timers[timer_id]
        assert entry is not None
        due = entry[1]
        await squat(url, "w", [f"timer:{timer_id}:{due}"])  # the firing's plain id, taken before it is due

        def fired() -> bool:
            now = d.engine.timers.get(timer_id)
            return now is None or now[1] != due

        await async_wait_for(fired, 15, "the squatted watchdog timer to fire anyway")
        await d.quiesce()
    records = await read_stream(url)
    firings = [r.envelope for r in records if isinstance(r, Record) and r.envelope.type == "timer.fired"
               and r.envelope.data.timer_id == timer_id and r.envelope.data.due == due]
    assert len(firings) == 1

"""A `timer.fired` that the timer service did not send, or that comes before the timer's due time in log time, fires
nothing: it is dead-lettered, the job goes on, and `recovery-replay verify` reports it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from events.outputs import Rejection
from recovery.core.timers import Firing, TimerTable
from recovery.log import MSG_ID, write_file
from recovery.log.pull import Delivery
from recovery.log.verify import first_divergence, forged_timers, rejection_divergence, replay_log
from recovery.service.processor import Processor
from recovery.service.seal import Seal
from recovery.service.timers import timer_messages
from recovery.testing import Scenario
from recovery.testing.nats import NatsServer
from tests.daemon_support import async_wait_for, check_log, connect, dumps, read_stream, running_daemon
from tests.test_daemon import ctl, spec
from tests.test_replay_cli import run_cli

NS = 1_000_000_000
SEAL = Seal(b"the deployment's secret")


def link_down(s: Scenario) -> tuple[str, int]:
    """A running job whose node's link went down: the id and due time of the debounce timer its decision lists."""
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    effects = s.node_event("b", "network.link_down", link="mlx5_0", switch="leaf1")
    [timer] = [t for d in effects if not isinstance(d, Rejection) for t in d.timers]
    assert timer.due > s.now + NS  # a debounce of seconds, not one already due
    return timer.id, timer.due


def fire(s: Scenario, timer_id: str, due: int, msg_id: str | None = None, ident: str = "forged") -> list[object]:
    """Publish a `timer.fired` for `timer_id` as anyone allowed to publish the job's events could."""
    envelope = make_envelope("timer.fired", {"timer_id": timer_id, "due": due}, id=ident, job="j", source="agent")
    appended = s.log.append_sync(subjects.job_event("j", "timer.fired"), envelope,
                                 headers={MSG_ID: msg_id or ident})
    assert appended.record is not None
    return [effect for effect, _, _, _ in s.recorder.apply(appended.record)]


def sealed(s: Scenario, timer_id: str, due: int) -> None:
    """The timer service's own firing of `timer_id`, sealed as the daemon publishes it."""
    [out] = timer_messages([Firing(timer_id, "j", due)], SEAL)
    appended = s.log.append_sync(out.subject, out.data, headers={MSG_ID: out.msg_id})
    assert appended.record is not None
    s.recorder.apply(appended.record)


def test_a_firing_before_the_due_time_is_dead_lettered_and_the_timer_fires_when_due(tmp_path: Path) -> None:
    s = Scenario()
    timer_id, due = link_down(s)
    s.advance(0.5)
    [rejection] = fire(s, timer_id, due)  # names the timer and its due time exactly, 0.5 s after it was asked for
    assert isinstance(rejection, Rejection) and rejection.code == "timer_early"
    assert "early" in rejection.reason and timer_id in rejection.reason
    assert not s.find("fault.confirmed", "j") and s.state("j") == "running"
    assert timer_id in s.engine.timers
    s.advance((due - s.now) / NS)  # the real firing, at its due time, still confirms the fault
    assert s.find("fault.confirmed", "j")

    log = tmp_path / "forged.jsonl"
    write_file(log, s.log.records())
    result = replay_log((f"LOG:{r.seq}", r) for r in s.log.records())
    assert first_divergence(result) is None and rejection_divergence(result) is None  # the replay agrees...
    [line] = forged_timers(result)  # ...and says a firing was forged all the same
    assert "timer_early" in line
    cli = run_cli("verify", str(log))
    assert cli.returncode == 1 and cli.stdout.startswith("FORGED TIMER FIRINGS: 1"), cli.stdout


def test_a_forged_firing_naming_a_passed_due_time_fires_nothing_before_the_timers_own() -> None:
    s = Scenario()
    timer_id, _ = link_down(s)
    s.advance(1)
    [rejection] = fire(s, timer_id, s.now - NS)  # a due time already passed: the engine's own due time counts
    assert isinstance(rejection, Rejection) and rejection.code == "timer_early"
    assert not s.find("fault.confirmed", "j")


def test_once_the_log_holds_sealed_firings_an_unsealed_one_is_dead_lettered() -> None:
    s = Scenario()
    s.submit("j", ["a"], ranks_per_node=2, dp=2)
    watchdog = s.engine.jobs["j"].watchdog
    assert watchdog is not None
    _, due, _ = s.engine.timers[watchdog]
    s.now = due
    sealed(s, watchdog, due)  # the daemon's firing: from here on every firing must be sealed
    assert s.engine.firings_sealed and s.engine.timers[watchdog][1] > due
    timer_id, due = link_down_on(s)
    s.now = due + NS  # due: only the seal is missing
    [rejection] = fire(s, timer_id, due)
    assert isinstance(rejection, Rejection) and rejection.code == "timer_unsealed"
    assert not s.find("fault.confirmed", "j")
    [rejection] = fire(s, timer_id, due, msg_id=f"forged~{'0' * 24}", ident="forged-2")  # the form of a seal...
    assert isinstance(rejection, Rejection) and rejection.code == "timer_unsealed"  # ...on another id
    sealed(s, timer_id, due)
    assert s.find("fault.confirmed", "j")


def link_down_on(s: Scenario) -> tuple[str, int]:
    effects = s.node_event("a", "network.link_down", link="mlx5_0", switch="leaf1")
    [timer] = [t for d in effects if not isinstance(d, Rejection) for t in d.timers]
    return timer.id, timer.due


def test_the_daemons_engine_checks_the_seals_digest(caplog: pytest.LogCaptureFixture) -> None:
    s = Scenario()
    s.engine.firing_seal = SEAL
    timer_id, due = link_down(s)
    s.now = due
    ident = f"timer:{timer_id}:{due}"
    [rejection] = fire(s, timer_id, due, msg_id=f"{ident}~{'0' * 24}", ident=ident)  # a seal's form, not its digest
    assert isinstance(rejection, Rejection) and rejection.code == "timer_forged"
    assert not s.find("fault.confirmed", "j")
    assert "firing_seal" not in s.engine.__getstate__()  # a snapshot never holds the secret
    # A verify without the secret cannot check the digest: it fires the timer, and says the daemon called it forged.
    offline = replay_log((f"LOG:{r.seq}", r) for r in s.log.records())
    divergence = first_divergence(offline)
    assert divergence is not None and divergence.recorded is None
    assert "forged timer firing [timer_forged]" in divergence.verdict
    assert [line.split(" [")[1][:12] for line in forged_timers(offline)] == ["timer_forged"]
    # The daemon logs such a dead letter as a warning, with its reason.
    processor = Processor(s.engine)
    processor.seal = SEAL
    envelope = make_envelope("timer.fired", {"timer_id": timer_id, "due": due}, id=ident + ":x", job="j")
    delivery = Delivery(s.engine.last_seq + 1, due, 0, 1, subjects.job_event("j", "timer.fired"),
                        {MSG_ID: f"{ident}:x~{'1' * 24}"}, encode_envelope(envelope), "")
    with caplog.at_level(logging.INFO, logger="recovery.daemon"):
        processor.process([delivery])
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.fields["code"] == "timer_forged"  # type: ignore[attr-defined]


async def test_the_daemon_dead_letters_forged_firings_and_fires_the_real_one_when_due(
        nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = nats_server.url
    quick = {"detection": {"name": "default", "params": {"link_debounce_s": 2.0}}}
    caplog.set_level(logging.INFO, logger="recovery.daemon")
    async with running_daemon(url, tmp_path / "data", snapshot_every_s=0.2) as daemon:
        await ctl(url, "submit", job="j", spec=spec(["a", "b"], watchdog_interval_s=3600.0, policies=quick))
        await ctl(url, "inject", type="job.started", job="j")
        await ctl(url, "inject", type="network.link_down", node="b", data={"link": "mlx5_0"})
        [timer] = [{"id": t, "due": due} for t, (job, due, every) in daemon.engine.timers.items() if every is None]
        nc, js = await connect(url)
        try:
            async def forge(ident: str, msg_id: str) -> int:
                envelope = make_envelope("timer.fired", {"timer_id": timer["id"], "due": timer["due"]}, id=ident,
                                         job="j", source="agent")
                ack = await js.publish(subjects.job_event("j", "timer.fired"), encode_envelope(envelope),
                                       headers={MSG_ID: msg_id})
                return ack.seq

            await forge("forged-1", "forged-1")  # at once: 2 s early
            early = await forge("forged-2", f"forged-2~{'0' * 24}")  # the form of a seal does not help
            await daemon.wait_applied(early, 10)

            async def confirmed() -> bool:
                return any(isinstance(r, Record) and r.envelope.type == "decision"
                           and r.envelope.data.kind == "fault.confirmed" for r in await read_stream(url))

            await async_wait_for(confirmed, 30, "the real firing of the debounce, when due")
            late = await forge("forged-3", "forged-3")  # after a sealed firing, an unsealed one is not the service's
            await daemon.wait_applied(late, 10)
        finally:
            await nc.close()
    records = await read_stream(url)
    dead = [r.envelope.data for r in records if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]
    assert [(d.event_id, d.code) for d in dead] == [("forged-1", "timer_early"), ("forged-2", "timer_early"),
                                                    ("forged-3", "timer_unsealed")]
    [fault] = [r for r in records if isinstance(r, Record) and r.envelope.type == "decision"
               and r.envelope.data.kind == "fault.confirmed"]
    cause = next(r for r in records if r.seq == fault.envelope.data.cause_seq)
    assert cause.headers[MSG_ID].startswith(f"timer:{timer['id']}:{timer['due']}~")  # sealed by the service
    assert cause.ts >= timer["due"]
    result = check_log(records)  # the offline replay dead-letters them as the daemon did...
    assert len(forged_timers(result)) == 3  # ...and verify reports them
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage() == "rejected"]
    assert len(warnings) == 3


def test_a_refused_early_firing_is_sent_again_no_sooner_than_its_due_time() -> None:
    table = TimerTable()
    table.arm("j/deadline/3", "j", 600 * NS)  # a deadline ten minutes away
    table.refused("j/deadline/3", "j", 600 * NS, 1 * NS)  # a firing the engine found early, at 1 s
    assert table.due(599 * NS) == []  # not a minute after the refusal, as a refused on-time firing is
    assert [f.timer_id for f in table.due(600 * NS)] == ["j/deadline/3"]
    # The service's own firing, found early (a server clock behind the service's): fired again, under another id.
    table.refused("j/deadline/3", "j", 600 * NS, 590 * NS)
    assert table.due(649 * NS) == []
    [again] = table.due(650 * NS)
    assert again.refired_at == 650 * NS and again.due == 600 * NS


def test_from_the_logs_sealed_from_on_an_unsealed_firing_is_dead_lettered_before_any_sealed_one() -> None:
    """The daemon knows from the log stream's metadata where seals begin: no sealed firing needs to come first. What
    the log held before that sequence (written before daemons recorded it) is judged as it always was."""
    s = Scenario()
    timer_id, due = link_down(s)
    s.now = due + NS
    envelope = make_envelope("timer.fired", {"timer_id": timer_id, "due": due}, id="old", job="j", source="agent")
    appended = s.log.append_sync(subjects.job_event("j", "timer.fired"), envelope, headers={MSG_ID: "old"})
    assert appended.record is not None
    s.engine.sealed_from = appended.record.seq + 1  # what the log held before it: judged as it always was
    effects = [effect for effect, _, _, _ in s.recorder.apply(appended.record)]
    assert not [e for e in effects if isinstance(e, Rejection)] and s.find("fault.confirmed", "j")
    timer_id, due = link_down_on(s)
    s.now = due + NS
    assert not s.engine.firings_sealed
    [rejection] = fire(s, timer_id, due, ident="forged-later")
    assert isinstance(rejection, Rejection) and rejection.code == "timer_unsealed"
    assert "sealed_from" not in s.engine.__getstate__()  # the daemon's to set again, never a snapshot's


def test_an_unsealed_overrun_fact_is_dead_lettered_and_skips_no_call_in_a_replay() -> None:
    """A forged `policy.overran` after the log's seals began is dead-lettered, and the replay's reading of the facts
    before it applies anything (`overruns_in`) leaves it out: verify finds no divergence where there is none."""
    from events.kinds import PolicyOverran
    from recovery.core.overruns import fact_message, overruns_in

    s = Scenario()
    s.submit("j", ["a"], ranks_per_node=2, dp=2)
    s.engine.sealed_from = 1
    fact = PolicyOverran(seq=2, policy="third-party@1", family="rescheduling", method="decide", call=0,
                         budget_s=1.0)
    subject, envelope = fact_message("j", fact)
    appended = s.log.append_sync(subject, envelope, headers={MSG_ID: envelope.id})
    assert appended.record is not None
    [rejection] = [e for e, _, _, _ in s.recorder.apply(appended.record)]
    assert isinstance(rejection, Rejection) and rejection.code == "overrun_unsealed"
    assert overruns_in(s.log.records(), sealed_from=1) == {}
    assert overruns_in(s.log.records()) == {}  # the daemon's dead letter says so, without the log's metadata too
    legacy = Scenario()  # a log that needs no seal (written before seals): the fact counts, as it always did
    legacy.submit("j", ["a"], ranks_per_node=2, dp=2)
    appended = legacy.log.append_sync(subject, envelope, headers={MSG_ID: envelope.id})
    assert appended.record is not None and not [e for e, _, _, _ in legacy.recorder.apply(appended.record)]
    assert len(overruns_in(legacy.log.records())) == 1


async def test_a_forged_daemon_fact_right_after_the_job_starts_is_dead_lettered_with_no_firing_before_it(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A new log is sealed from its first record: a `node.silent` for a healthy node and a `policy.overran` published
    by anyone right after `job.started`, before any timer fired, are dead-lettered and change nothing (they used to
    confirm a node fault and move its ranks); an offline replay judges them as the daemon did."""
    from events.kinds import PolicyOverran
    from recovery.core.overruns import fact_message

    url = nats_server.url
    async with running_daemon(url, tmp_path / "data") as daemon:
        await ctl(url, "submit", job="j", spec=spec(["a", "b"], watchdog_interval_s=3600.0))
        await ctl(url, "inject", type="job.started", job="j")
        assert daemon.engine.sealed_from == 1 and not daemon.engine.firings_sealed
        nc, js = await connect(url)
        try:
            silent = make_envelope("node.silent", {"silent_s": 30.0, "bound_s": 5.0}, id="forged-silence", node="b",
                                   source="recovery-daemon/liveness")
            await js.publish(subjects.node_event("b", "node.silent"), encode_envelope(silent),
                             headers={MSG_ID: "forged-silence"})
            subject, overran = fact_message("j", PolicyOverran(seq=1, policy="x@1", family="rescheduling",
                                                               method="decide", call=0, budget_s=1.0))
            ack = await js.publish(subject, encode_envelope(overran), headers={MSG_ID: overran.id})
            await daemon.wait_applied(ack.seq, 10)
        finally:
            await nc.close()
        assert daemon.engine.jobs["j"].state == "running" and daemon.engine.jobs["j"].incident is None
    records = await read_stream(url)
    dead = [r.envelope.data for r in records if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]
    assert sorted((d.event_id, d.code) for d in dead) == [("forged-silence", "silence_unsealed"),
                                                         (overran.id, "overrun_unsealed")]
    assert not [r for r in records if isinstance(r, Record) and r.envelope.type == "decision"
                and r.envelope.data.kind in ("fault.confirmed", "ranks.rescheduling")]
    check_log(records)  # the replay, without the stream's metadata, takes where seals began from the dead letters


async def test_a_log_written_before_seals_were_recorded_is_sealed_after_its_last_record_and_keeps_it(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A log stream an older version made (no metadata) is sealed from the record after its last: what it held is
    judged as it was decided. The value stays through every later start, whatever updates the stream."""
    from recovery.log.jetstream import ensure_stream
    from recovery.service import config as config_mod
    from recovery.service.streams import SEALED_FROM, ensure_streams, log_config, sealed_from

    cfg = config_mod.load(nats_url=nats_server.url, http_port=-1, data_dir=tmp_path / "d")
    nc, js = await connect(nats_server.url)
    try:
        await ensure_stream(js, log_config(cfg))  # as an older version made it
        for i in range(3):
            envelope = make_envelope("node.heartbeat", {}, id=f"old-{i}", node="a", source="agent")
            await js.publish(subjects.node_event("a", "node.heartbeat"), encode_envelope(envelope),
                             headers={MSG_ID: f"old-{i}"})

        async def once(op: object, what: str) -> object:
            return await op()  # type: ignore[operator]

        assert await sealed_from(js, cfg) == 4
        assert await ensure_streams(js, cfg, once) == 4  # the stream brought to the configuration again: kept
        assert (await js.stream_info(cfg.stream)).config.metadata[SEALED_FROM] == "4"
    finally:
        await nc.close()


async def test_a_node_that_never_joined_cannot_be_invented_and_a_slice_of_the_log_replays_as_the_daemon_judged(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A `device.fault` from a node nobody placed a job on and whose agent never started (`ä`) is dead-lettered
    `unknown_node` and adds no node to the cluster view; once the node's agent says it is ready, its events count. A
    replay of the whole log, or of a slice that starts after the node's start, judges each as the daemon did."""
    from recovery.log.recorder import replay

    url = nats_server.url
    async with running_daemon(url, tmp_path / "data") as daemon:
        nc, js = await connect(url)
        try:
            async def node_event(node: str, kind: str, data: dict[str, object], ident: str) -> int:
                envelope = make_envelope(kind, data, id=ident, node=node, source="agent")
                return (await js.publish(subjects.node_event(node, kind), encode_envelope(envelope),
                                         headers={MSG_ID: ident})).seq

            fault = {"device": 0, "vendor": "nvidia", "code": "79"}
            await node_event("ä", "device.fault", fault, "invented")
            await node_event("n9", "node.ready", {}, "n9-ready")
            last = await node_event("n9", "device.fault", fault, "n9-fault")
            await daemon.wait_applied(last, 10)
        finally:
            await nc.close()
        assert "ä" not in daemon.engine.cluster.nodes and "n9" in daemon.engine.cluster.nodes
        assert daemon.engine.cluster.nodes["n9"].bad_devices == {0}
    records = await read_stream(url)
    dead = [r.envelope.data for r in records if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]
    assert [(d.event_id, d.code) for d in dead] == [("invented", "unknown_node")]
    check_log(records)
    ready_at = next(r.seq for r in records if isinstance(r, Record) and r.envelope.id == "n9-ready")
    sliced = replay([r for r in records if r.seq > ready_at])  # n9's start is not in it: its fault still counts
    assert [(r.event_id, r.code) for r in sliced.rejections] == []


FORGERIES = [
    ("timer.fired", "job", {"timer_id": "j/watchdog/0", "due": 1}, "timer_unsealed"),
    ("node.silent", "node", {"silent_s": 30.0, "bound_s": 5.0}, "silence_unsealed"),
    ("node.heard", "node", {"silent_s": 1.0}, "heard_unsealed"),
    ("control.outage", "job", {"away_s": 60.0, "bound_s": 30.0}, "outage_unsealed"),
    ("device.fault", "stranger", {"device": 0, "vendor": "nvidia", "code": "79"}, "unknown_node"),
    ("network.link_down", "stranger", {"link": "mlx5_0"}, "unknown_node"),
]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(FORGERIES) - 1), st.sampled_from(["a", "b", "z9", "ä"])),
                min_size=1, max_size=12),
       st.integers(0, 3))
def test_hostile_daemon_records_and_invented_nodes_from_a_logs_first_record_change_nothing(
        forgeries: list[tuple[int, str]], started_after: int) -> None:
    """A log sealed from its first record: forged daemon-only records and events of nodes that never joined, before
    and after a job starts, are each dead-lettered with its code, change no state, and a replay that reads the log
    without its metadata judges every one as the daemon did."""
    from recovery.log.recorder import replay

    s = Scenario()
    s.engine.sealed_from = s.engine.nodes_from = 1

    def state() -> dict[str, object]:
        return {k: v for k, v in s.engine.snapshot().items() if k != "last_seq"}  # a rejection is a record too

    before = state()
    for index, (which, node) in enumerate(forgeries):
        if index == started_after:
            s.submit("j", ["a", "b"], ranks_per_node=2, dp=4)
            before = state()
        kind, scope, data, code = FORGERIES[which]
        if kind == "control.outage" and "j" not in s.engine.jobs:
            continue  # a job event of no job is refused as unknown first
        if scope == "job" and "j" in s.engine.jobs:
            envelope = make_envelope(kind, data, id=f"forged-{index}", job="j", source="agent")
            subject = subjects.job_event("j", kind)
        elif scope == "job":
            continue
        else:
            target = node if scope == "node" else f"stranger-{node}"  # a daemon fact's seal is judged first
            envelope = make_envelope(kind, data, id=f"forged-{index}", node=target, source="agent")
            subject = subjects.node_event(target, kind)
        appended = s.log.append_sync(subject, envelope, headers={MSG_ID: envelope.id})
        assert appended.record is not None
        effects = [effect for effect, _, _, _ in s.recorder.apply(appended.record)]
        assert [(type(e).__name__, getattr(e, "code", None)) for e in effects] == [("Rejection", code)], effects
        assert state() == before
    replayed = replay(s.log.records())
    assert [dumps(r) for r in replayed.rejections] == [dumps(r) for r in replayed.recorded_rejections]
    assert replayed.engine.snapshot() == s.engine.snapshot()

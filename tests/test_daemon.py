"""The daemon in-process against a real nats-server: configuration, dead letters, recovery-ctl, metrics, timers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from events.values import JobSpec
from recovery.cli.ctl import request
from recovery.cli.daemon import build_parser
from recovery.core.engine import Engine
from recovery.core.router import EffectRouter
from recovery.core.timers import Firing
from recovery.log import MSG_ID
from recovery.service import config as config_mod
from recovery.service.config import ConfigError, DaemonConfig
from recovery.service.daemon import Daemon
from recovery.service.timers import ServerClock, TimerService
from recovery.testing.nats import NatsServer
from tests.daemon_support import ROOT, async_wait_for, check_log, connect, read_stream, running_daemon

NS = 1_000_000_000


# -- configuration -------------------------------------------------------------------------------------------
def _load(argv: list[str]) -> DaemonConfig:
    return config_mod.load(build_parser().parse_args(argv))


def test_config_flags_win_over_environment_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "d.toml"
    toml.write_text('batch_size = 10\nhttp_port = 9000\nstream = "FROMFILE"\ntimers_enabled = false\n')
    monkeypatch.setenv("RECOVERY_HTTP_PORT", "9100")
    monkeypatch.setenv("RECOVERY_BATCH_SIZE", "20")
    cfg = _load(["--config", str(toml), "--batch-size", "30"])
    assert (cfg.batch_size, cfg.http_port, cfg.stream, cfg.timers_enabled) == (30, 9100, "FROMFILE", False)
    assert _load(["--config", str(toml), "--timers-enabled"]).timers_enabled is True
    assert _load(["--duration", "5"]).duration_s == 5.0


@pytest.mark.parametrize(("argv", "env", "toml", "expected"), [
    (["--http-port", "abc"], {}, "", "http_port: Input should be a valid integer"),
    ([], {"RECOVERY_BATCH_SIZE": "0"}, "", "batch_size: Input should be greater than or equal to 1"),
    ([], {}, "snapshot_evry = 3\n", "unknown key 'snapshot_evry'"),
    ([], {}, 'stream = "A.B"\n', "stream: Value error, 'A.B' is not a valid JetStream name"),
    ([], {}, "duplicate_window_s = 100\ncommand_max_age_s = 10\n", "exceeds command_max_age_s"),
    ([], {}, "log_level = 'LOUD'\n", "log_level: Input should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
])
def test_bad_configuration_names_the_key_and_its_origin(argv: list[str], env: dict[str, str], toml: str,
                                                       expected: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if toml:
        path = tmp_path / "d.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ConfigError) as info:
        _load(argv)
    assert expected in str(info.value)
    origin = "flag --http-port" if argv[:1] == ["--http-port"] else (
        "environment variable RECOVERY_BATCH_SIZE" if env else str(tmp_path / "d.toml"))
    assert origin in str(info.value)


def test_daemon_cli_exits_2_on_bad_configuration() -> None:
    result = subprocess.run([sys.executable, "-m", "recovery.cli.daemon", "--snapshot-every-records", "-1"],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 2
    assert "snapshot_every_records: Input should be greater than or equal to 1" in result.stderr


# -- the timer service ---------------------------------------------------------------------------------------
def test_timer_service_fires_what_the_engine_still_holds() -> None:
    engine = Engine()
    fired: list[Firing] = []

    async def fire(items: list[Firing]) -> None:
        fired.extend(items)

    router = EffectRouter(engine)
    timers = TimerService(router, fire)
    engine.timers = {"a/watchdog/3": ("a", 10, 5), "a/confirm/x/4": ("a", 20, None), "b/ack/b:1:0/9": ("b", 15, None)}
    assert router.timers.load(engine.timers) == 3
    assert timers.due(9) == []
    assert timers.due(15) == [Firing("a/watchdog/3", "a", 10, 5), Firing("b/ack/b:1:0/9", "b", 15, None)]
    engine.timers["a/watchdog/3"] = ("a", 15, 5)  # the engine applied the firing: the period moved on
    router.timers.fired("a/watchdog/3", "a", 10, 12)
    del engine.timers["a/confirm/x/4"]  # cancelled by a decision
    router.timers.cancel("a/confirm/x/4")
    assert timers.due(100) == [Firing("a/watchdog/3", "a", 15, 5)]
    router.timers.arm("gone", "a", 1)  # armed but not in the engine's table: never fired, and forgotten
    assert timers.due(200) == [] and "gone" not in router.timers and fired == []


@given(st.integers(min_value=1, max_value=16),
       st.lists(st.integers(min_value=-90 * NS, max_value=90 * NS), min_size=1, max_size=80))
def test_the_server_clock_offset_is_the_largest_sample_of_its_window(window: int, samples: list[int]) -> None:
    clock = ServerClock(window=window, local=lambda: 0)
    for i, sample in enumerate(samples):
        clock.observe(sample)
        best = max(samples[max(i + 1 - window, 0): i + 1])
        assert clock.offset_ns == max(-ServerClock.LIMIT_NS, min(ServerClock.LIMIT_NS, best))


def test_the_server_clock_follows_the_least_delayed_sample_and_ignores_old_backlog() -> None:
    local = [1_000 * NS]
    clock = ServerClock(window=4, local=lambda: local[0])
    assert clock() == 1_000 * NS  # no sample yet: the local clock
    # this host runs 5 s fast; transits of 3, 1 and 2 ms
    for transit_ms in (3, 1, 2):
        clock.observe(local[0] - 5 * NS - transit_ms * 1_000_000)
    assert clock.offset_ns == -5 * NS - 1_000_000
    assert clock() == 995 * NS - 1_000_000
    # the best sample leaves the window: the offset follows what is left
    for _ in range(3):
        clock.observe(local[0] - 5 * NS - 4_000_000)
    assert clock.offset_ns == -5 * NS - 2_000_000
    for _ in range(4):
        clock.observe(local[0] - 5 * NS - 4_000_000)
    assert clock.offset_ns == -5 * NS - 4_000_000
    # a backlog an hour old, read after an outage, holds the timers back a minute at most
    for _ in range(4):
        clock.observe(local[0] - 3_600 * NS)
    assert clock.offset_ns == -ServerClock.LIMIT_NS


# -- the daemon in-process -----------------------------------------------------------------------------------
@pytest.fixture
async def daemon(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(nats_server.url, tmp_path / "data", timers_enabled=False, snapshot_every_s=0.2) as d:
        yield d


def spec(nodes: list[str], **extra: Any) -> dict[str, Any]:
    return JobSpec.model_validate({"nodes": nodes, "ranks_per_node": 2, "layout": {"dp": len(nodes) * 2}, **extra}
                                  ).model_dump(mode="json")


async def ctl(url: str, verb: str, **body: Any) -> dict[str, Any]:
    return await request(url, verb, body)


async def test_bad_input_goes_to_the_dead_letter_subject_and_other_jobs_keep_going(daemon: Daemon,
                                                                                   nats_server: NatsServer) -> None:
    url = nats_server.url
    submitted = await ctl(url, "submit", job="good", spec=spec(["g0", "g1"]), id="submit-good")
    assert submitted["ok"] and submitted["applied"] and submitted["decisions"][0]["kind"] == "job.accepted"
    assert (await ctl(url, "inject", type="job.started", job="good"))["decisions"][0]["state"] == "running"
    nc, js = await connect(url)
    bad: list[tuple[str, bytes, str]] = [
        (subjects.job_event("good", "process.heartbeat"), b"{not json", "malformed_json"),
        (subjects.job_event("good", "process.teleported"), orjson.dumps({"id": "t1", "type": "process.teleported",
                                                                         "job": "good", "data": {}}), "unknown_type"),
        (subjects.job_event("ghost", "process.exited"), encode_envelope(make_envelope(
            "process.exited", {"rank": 0, "exit_code": 1}, id="ghost-1", job="ghost")), "unknown_job"),
        (subjects.job_event("good", "process.exited"), orjson.dumps({"id": "w1", "type": "process.exited",
                                                                     "job": "bad job", "data": {"rank": 0}}),
         "bad_subject_token"),
        (subjects.job_event("other", "process.exited"), encode_envelope(make_envelope(
            "process.exited", {"rank": 0, "exit_code": 1}, id="mismatch-1", job="good")), "subject_mismatch"),
        (subjects.job_event("good", "process.heartbeat"), b'{"id":"big","pad":"' + b"x" * 300_000 + b'"}',
         "oversized"),
        (subjects.job_event("good", "process.heartbeat"), encode_envelope(make_envelope(
            "process.heartbeat", {"rank": 99}, id="rank-99", job="good")), "unknown_rank"),
    ]
    try:
        for n, (subject, payload, _) in enumerate(bad):
            await js.publish(subject, payload, headers={MSG_ID: f"bad-{n}"})
        crash = make_envelope("process.exited", {"rank": 1, "exit_code": 139}, id="crash-1", job="good")
        ack = await js.publish(subjects.job_event("good", "process.exited"), encode_envelope(crash),
                               headers={MSG_ID: crash.id})
    finally:
        await nc.close()
    await daemon.wait_applied(ack.seq, 10)
    assert daemon.readiness()[0]
    records = await read_stream(url)
    dead = [r for r in records if r.subject.startswith("recovery.dlq.")]
    codes = [r.envelope.data.code for r in dead if isinstance(r, Record)]
    assert codes == [code for _, _, code in bad]
    assert [r.subject for r in dead] == [f"recovery.dlq.{code}" for _, _, code in bad]
    assert all(isinstance(r, Record) and r.envelope.data.reason for r in dead)
    kinds = [r.envelope.data.kind for r in records if isinstance(r, Record) and r.envelope.type == "decision"
             and r.envelope.data.cause_seq == ack.seq]
    assert kinds[:2] == ["fault.confirmed", "attempt.started"]  # the good job was served after the bad input
    check_log(records)
    metrics = daemon.metrics.render().decode()
    assert 'recovery_rejections_total{reason="malformed_json"} 1.0' in metrics
    assert 'recovery_rejections_total{reason="oversized"} 1.0' in metrics


async def test_ctl_verbs_and_the_cli(daemon: Daemon, nats_server: NatsServer, tmp_path: Path) -> None:
    url = nats_server.url
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"job": "train", "spec": spec(["t0", "t1"], elastic={"min_dp": 2, "max_dp": 4})}))
    cli = [sys.executable, "-m", "recovery.cli.ctl", "--nats", url]
    result = await asyncio.to_thread(subprocess.run, [*cli, "submit", str(job_file)], capture_output=True,
                                     text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert "job.accepted" in result.stdout
    assert (await ctl(url, "inject", type="job.started", job="train"))["ok"]
    jobs = await asyncio.to_thread(subprocess.run, [*cli, "--json", "jobs"], capture_output=True, text=True,
                                   cwd=ROOT, check=False)
    rows = orjson.loads(jobs.stdout)["jobs"]
    assert [(r["job"], r["state"], r["alive"], r["world"]) for r in rows] == [("train", "running", 4, 4)]
    table = await asyncio.to_thread(subprocess.run, [*cli, "jobs"], capture_output=True, text=True, cwd=ROOT,
                                    check=False, env={**os.environ, "COLUMNS": "160"})
    assert "train" in table.stdout and "running" in table.stdout
    assert rows[0]["no_agent"] == ["t0", "t1"]  # no agent ever ran there: said, not left to guess from 0 alive
    nodes = await asyncio.to_thread(subprocess.run, [*cli, "nodes"], capture_output=True, text=True, cwd=ROOT,
                                    check=False, env={**os.environ, "COLUMNS": "160"})
    assert nodes.returncode == 0, nodes.stderr
    assert "t0" in nodes.stdout and "train" in nodes.stdout and "(running)" in nodes.stdout and "none" in nodes.stdout
    paused = await ctl(url, "pause", job="train", reason="maintenance")
    assert (paused["ok"] and "job.paused" in [d["kind"] for d in paused["decisions"]]) or paused["decisions"]
    incidents = await ctl(url, "incidents")
    assert [i["cause"] for i in incidents["incidents"]] == ["operator"]
    refused = await ctl(url, "scale", job="train", dp=9)
    assert refused["ok"] and refused["rejections"][0]["code"] in ("invalid_request", "invalid_state")
    unknown = await ctl(url, "resume", job="nope")
    assert unknown == {"ok": False, "error": "no job 'nope'"}
    bad_spec = await ctl(url, "submit", job="x", spec={"nodes": ["a"], "ranks_per_node": 2, "layout": {"dp": 1}})
    assert not bad_spec["ok"] and "invalid job spec" in bad_spec["error"]
    assert await ctl(url, "partitions") == {"ok": True, "partitions": 1}  # one daemon: recovery-ctl asks it alone
    status = await ctl(url, "status")
    assert status["status"]["ready"] is True and status["status"]["jobs"] == 1
    refused_cli = await asyncio.to_thread(subprocess.run, [*cli, "cancel", "nope"], capture_output=True, text=True,
                                          cwd=ROOT, check=False)
    assert refused_cli.returncode == 1 and "no job 'nope'" in refused_cli.stderr
    release = await asyncio.to_thread(subprocess.run, [*cli, "release", "train", "t1", "--device", "1", "--reason",
                                                       "swapped"], capture_output=True, text=True, cwd=ROOT,
                                      check=False, env={**os.environ, "COLUMNS": "200"})
    # the node and device reach the engine, which says they are not isolated (it releases only what is)
    assert release.returncode == 1 and "device 1 of t1 is not isolated" in release.stdout, release.stdout
    assert "operator.release" in release.stdout
    graceful = await asyncio.to_thread(subprocess.run, [*cli, "--json", "cancel", "train", "--grace", "30",
                                                        "--signal", "SIGINT"], capture_output=True, text=True,
                                       cwd=ROOT, check=False)
    assert graceful.returncode == 0, graceful.stdout + graceful.stderr
    said = orjson.loads(graceful.stdout)
    assert [d["commands"] for d in said["decisions"] if d["kind"] == "job.cancelled"] == [["stop_ranks"]], said
    [stop] = [c for e in daemon.recent[said["seq"]] for c in getattr(e, "commands", ())]
    assert (stop.mode, stop.grace_s, stop.signal) == ("graceful", 30.0, "SIGINT")  # what the agents are sent


async def test_http_endpoints_and_metrics(daemon: Daemon, nats_server: NatsServer) -> None:
    url = nats_server.url
    await ctl(url, "submit", job="m", spec=spec(["m0"]))
    await ctl(url, "inject", type="job.started", job="m")
    out = await ctl(url, "inject", type="process.exited", job="m", data={"rank": 0, "exit_code": 1})
    assert out["decisions"][0]["kind"] == "fault.confirmed"
    await async_wait_for(lambda: daemon.snapshot_seq >= out["seq"], 10, "a snapshot")

    def get(path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}{path}", timeout=2) as response:
            return response.status, response.read().decode()

    assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
    code, body = await asyncio.to_thread(get, "/readyz")
    assert code == 200 and json.loads(body)["ready"] is True
    _, body = await asyncio.to_thread(get, "/status")
    status = json.loads(body)
    assert status["role"] == "active"
    # one host, one clock: the estimate is the transit of a message, below zero and far below a second
    assert -1.0 < status["server_clock_offset_s"] < 0.0
    _, metrics = await asyncio.to_thread(get, "/metrics")
    command = next(c for d in out["decisions"] for c in d["commands"])
    state = out["decisions"][-1]["state"]
    for needle in ('recovery_events_total{type="process.exited"} 1.0',
                   'recovery_decisions_total{kind="fault.confirmed"} 1.0', "recovery_open_incidents 1.0",
                   "recovery_consumer_lag 0.0", "recovery_decision_latency_seconds_bucket",
                   "recovery_snapshot_age_seconds", f'recovery_commands_total{{kind="{command}"}} 1.0',
                   f'recovery_jobs{{state="{state}"}} 1.0', "recovery_ready 1.0", "recovery_active 1.0",
                   "recovery_server_clock_offset_seconds -"):
        assert needle in metrics, needle
    daemon.request_stop()
    code, body = await asyncio.to_thread(_status_of, daemon.http_port, "/readyz")
    assert code == 503 and json.loads(body)["stopping"] is True


def _status_of(port: int | None, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_timer_service_fires_on_the_wall_clock(nats_server: NatsServer, tmp_path: Path) -> None:
    """A job whose ranks fall silent is caught by the watchdog: its periodic timer fires as `timer.fired` events
    with deterministic ids, and the engine confirms the hang from them; nothing else drives time."""
    cfg = config_mod.load(nats_url=nats_server.url, http_port=-1, data_dir=tmp_path / "d", timers_enabled=True)
    d = Daemon(cfg)
    async with d.running():
        quick = {"detection": {"name": "default", "params": {"hang_min_silence_s": 0.3}}}
        await ctl(nats_server.url, "submit", job="w", spec=spec(["w0"], watchdog_interval_s=0.1, policies=quick))
        await ctl(nats_server.url, "inject", type="job.started", job="w")
        # its ranks speak through the SDK once, then fall silent (a script that never does is watched by its exits)
        await ctl(nats_server.url, "inject", type="process.heartbeat", job="w", data={"rank": 0})
        await async_wait_for(lambda: d.engine.jobs["w"].incident is not None, 10, "the watchdog to catch the hang")
        await d.quiesce()
    records = await read_stream(nats_server.url)
    fired = [r for r in records if isinstance(r, Record) and r.envelope.type == "timer.fired"]
    assert len(fired) >= 3
    for r in fired:
        assert r.envelope.id == f"timer:{r.envelope.data.timer_id}:{r.envelope.data.due}"
        assert r.ts >= r.envelope.data.due  # fired when due by the wall clock, never early
    result = check_log(records)
    assert "fault.confirmed" in [x.kind for x in result.recorded_decisions]


async def test_replay_cli_reads_the_live_log(daemon: Daemon, nats_server: NatsServer, tmp_path: Path) -> None:
    url = nats_server.url
    for job, nodes in (("a", ["a0"]), ("b", ["b0"])):
        await ctl(url, "submit", job=job, spec=spec(nodes))
        await ctl(url, "inject", type="job.started", job=job)
    await ctl(url, "inject", type="process.exited", job="a", data={"rank": 1, "exit_code": 1})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                              cwd=ROOT, check=False)

    out = tmp_path / "a.jsonl"
    exported = await asyncio.to_thread(cli, "export", "--nats", url, "--job", "a", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    header, *lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert header["export"]["job"] == "a" and header["export"]["inputs"] == "all"
    # Every input (b's too: a's decisions depend on the whole cluster); of the decisions, a's and every acceptance.
    assert {line["envelope"]["job"] for line in lines if line["subject"].startswith("recovery.ev.")} == {"a", "b"}
    assert all(line["envelope"]["data"]["job"] == "a" or line["envelope"]["data"]["kind"] == "job.accepted"
               for line in lines if line["subject"].startswith("recovery.dec."))
    everything = await asyncio.to_thread(cli, "export", "--nats", url, "--since", "1h")
    assert len(everything.stdout.splitlines()) == len(await read_stream(url))
    future = await asyncio.to_thread(cli, "export", "--nats", url, "--since", "2999-01-01T00:00:00Z")
    assert future.returncode == 0 and future.stdout == ""
    verified = await asyncio.to_thread(cli, "verify", "--nats", url)
    assert verified.returncode == 0 and verified.stdout.startswith("ok:"), verified.stdout + verified.stderr
    timeline = await asyncio.to_thread(cli, "timeline", "--nats", url, "--job", "a", "--json")
    assert "decision fault.confirmed" in [row["what"] for row in orjson.loads(timeline.stdout)]
    both = await asyncio.to_thread(cli, "verify", str(out), "--nats", url)
    assert both.returncode == 2 and "either a LOG file or --nats" in both.stderr
    missing = await asyncio.to_thread(cli, "export", "--nats", url, "--stream", "NOPE")
    assert missing.returncode == 2 and "no stream 'NOPE'" in missing.stderr


def test_since_accepts_nanoseconds_iso_times_and_ages() -> None:
    from recovery.cli.replay import parse_since

    assert parse_since("1767225600000000000") == 1_767_225_600 * NS
    assert parse_since("2026-01-01T00:00:00Z") == 1_767_225_600 * NS
    assert parse_since("2026-01-01T01:00:00+01:00") == 1_767_225_600 * NS
    assert parse_since("15m", now_ns=1_767_225_600 * NS) == (1_767_225_600 - 900) * NS
    with pytest.raises(ValueError, match="--since 'yesterday'"):
        parse_since("yesterday")


async def test_snapshot_store_alternates_slots_and_checks_its_chunks(nats_server: NatsServer) -> None:
    from recovery.service.snapshots import SnapshotStore

    nc, js = await connect(nats_server.url)
    try:
        store = SnapshotStore(js, "SNAPS", "p1", 1024, 1)
        await store.ensure()
        await store.ensure()  # idempotent
        assert await store.load() is None
        blobs = [os.urandom(5000 + 1000 * n) for n in range(4)]  # incompressible: several chunks each
        for n, blob in enumerate(blobs):
            manifest = await store.save(blob, seq=10 * (n + 1), ts=n)
            assert manifest["slot"] == "ab"[n % 2] and manifest["chunks"] > 1
            loaded = await store.load()
            assert loaded is not None and loaded[0] == blob and loaded[1]["seq"] == 10 * (n + 1)
        # The bucket's keys as its stream's subjects: one request (nats-py's `kv.keys()` reads them through a
        # watcher, which on a busy host has ended before the first key and raised NoKeysError).
        info = await js.stream_info("KV_SNAPS", subjects_filter="$KV.SNAPS.>")
        keys = list(info.state.subjects or {})
        assert keys and len(keys) <= 1 + 2 * max(-(-len(b) // 1024) + 1 for b in blobs)  # bounded: two slots
        await store.kv.put(f"p1.{manifest['slot']}.0", b"torn write")
        assert await store.load() is None  # a checksum mismatch is no snapshot, not a wrong one
    finally:
        await nc.close()


async def test_a_restore_scans_what_was_published_after_the_manifest_while_it_opens_the_snapshot(
        nats_server: NatsServer) -> None:
    from recovery.log.snapshot import dump_snapshot
    from recovery.service.publisher import Outgoing
    from recovery.service.restore import StoredIds, restore_newest
    from recovery.service.snapshots import SnapshotStore

    scans: list[tuple[int, int]] = []
    aheads: list[int] = []  # where the backlog's read began: with the manifest, before the snapshot is opened

    async def scan(seq: int, ts: int) -> set[str]:
        scans.append((seq, ts))
        return {f"after-{seq}"}

    async def retry(op: Any, what: str) -> Any:
        return await op()

    async def ids(stored: StoredIds) -> set[str]:
        settled = await stored.settle()
        assert settled is not None and await stored.settle() is None  # settled once
        return settled[0]

    nc, js = await connect(nats_server.url)
    try:
        store = SnapshotStore(js, "SNAPS", "p1", 1024, 1)
        await store.ensure()
        newest, stored = await restore_newest(store, retry, None, scan, aheads.append)
        assert newest is None and await ids(stored) == {"after-0"} and aheads == [1]  # none: the whole log
        engine = Engine()
        engine.last_seq = 40
        manifest = await store.save(dump_snapshot(engine), seq=40, ts=7)
        scans.clear()
        newest, stored = await restore_newest(store, retry, None, scan, aheads.append)
        assert newest is not None and newest[0].last_seq == 40 and newest[1]["id"] == manifest["id"]
        assert aheads == [1, 41]
        # what the backlog makes while the scan runs is held, and what the scan found stored is not published
        made = [Outgoing("s", b"", "after-40", "decision"), Outgoing("s", b"", "sealed", "decision", "after-40"),
                Outgoing("s", b"", "new", "command")]
        assert stored.hold(made) and stored.pending
        settled = await stored.settle()
        assert settled is not None and settled[1] == [made[2]] and not stored.pending and not stored.hold(made)
        assert (scans, settled[0]) == ([(40, 7)], {"after-40"})  # one scan, from the manifest's own place
        scans.clear()
        await store.kv.put(f"p1.{manifest['slot']}.0", b"torn write")
        newest, stored = await restore_newest(store, retry, None, scan, aheads.append)
        assert newest is None and await ids(stored) == {"after-0"}  # replayed whole: scanned whole
        assert aheads == [1, 41, 41, 1]  # read from the manifest's place, then again from the log's start
        assert scans[-1] == (0, 0)
    finally:
        await nc.close()


async def test_the_ids_published_after_a_snapshot_are_the_logs_outputs_after_it_and_the_commands(
        nats_server: NatsServer) -> None:
    """The log's outputs come from one consumer of every subject, kept by subject: an input's or a fence claim's id
    after the snapshot, or an output's before it, is not among them."""
    from nats.js.api import StreamConfig

    from recovery.service.restore import published_after

    nc, js = await connect(nats_server.url)
    try:
        await js.add_stream(StreamConfig(name="LOG", subjects=["recovery.ev.>", "recovery.dec.>", "recovery.dlq.>",
                                                                "recovery.fence.>"]))
        await js.add_stream(StreamConfig(name="CMD", subjects=["recovery.cmd.>"]))
        mix = ["recovery.ev.job.a.progress.report", "recovery.dec.a", "recovery.dlq.b", "recovery.fence.log.p-0"]
        outputs: set[str] = set()
        for i in range(80):
            subject = mix[i % len(mix)]
            ack = await js.publish(subject, b"{}", headers={MSG_ID: f"log-{i}"})
            if subjects.is_output(subject) and ack.seq > 30:
                outputs.add(f"log-{i}")
        await js.publish("recovery.cmd.n0.a.restart", b"{}", headers={MSG_ID: "cmd-0@n0"})
        found = await published_after(nc, js, "LOG", "CMD", 30, 0)
        assert found == outputs | {"cmd-0@n0"} and len(outputs) == 25
    finally:
        await nc.close()

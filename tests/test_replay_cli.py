"""recovery-replay: run, verify (with a divergence) and timeline, in text and JSON."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from policies.rescheduling import LadderRescheduling
from recovery.cli.replay import main
from recovery.log import iter_numbered
from recovery.report import build_report, iter_file
from tests.golden.scenarios import path


def report_of_file(log: Path) -> dict[str, Any]:
    return build_report(iter_file(log))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                          check=False)


def test_verify_passes_on_a_recorded_log(capsys) -> None:  # type: ignore[no-untyped-def]
    log = path("pod_level_reschedule")
    recorded = sum(1 for line in log.read_bytes().splitlines()
                   if (orjson.loads(line).get("envelope") or {}).get("type") == "decision")
    assert recorded > 5
    assert main(["verify", str(log)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {recorded} decisions")


def test_verify_exits_1_at_the_first_divergence_and_names_the_policy(tmp_path: Path) -> None:
    lines = path("step_retry").read_bytes().splitlines()
    tampered = []
    changed = False
    for line in lines:
        obj = orjson.loads(line)
        env = obj.get("envelope") or {}
        if not changed and env.get("type") == "decision" and env["data"]["kind"] == "attempt.started":
            env["data"]["policy"] = "ladder@0"
            env["data"]["reason"] = "an older policy"
            changed = True
        tampered.append(orjson.dumps(obj))
    log = tmp_path / "tampered.jsonl"
    log.write_bytes(b"\n".join(tampered) + b"\n")
    result = run_cli("verify", str(log))
    assert result.returncode == 1
    installed = f"ladder@{LadderRescheduling.version}"
    assert "DIVERGENCE" in result.stdout and f"changed policy: recorded ladder@0, replayed {installed}" in result.stdout
    as_json = run_cli("verify", str(log), "--json")
    assert as_json.returncode == 1
    assert orjson.loads(as_json.stdout)["divergence"]["recorded"]["policy"] == "ladder@0"


def test_run_json_gives_final_states_and_incidents() -> None:
    result = run_cli("run", str(path("elastic_scale")), "--json")
    assert result.returncode == 0
    out = orjson.loads(result.stdout)
    job = out["jobs"]["ela"]
    assert job["state"] == "running" and job["layout"]["dp"] == 2
    assert [i["cause"] for i in job["incidents"]] == ["fault", "scale", "operator"]


def test_timeline_shows_events_states_and_decisions() -> None:
    result = run_cli("timeline", str(path("pod_level_reschedule")), "--job", "llm", "--json")
    rows = orjson.loads(result.stdout)
    whats = [r["what"] for r in rows]
    assert "device.fault" in whats and "decision ranks.rescheduling" in whats
    assert not any(w == "progress.step" for w in whats)
    text = run_cli("timeline", str(path("pod_level_reschedule")), "--job", "llm")
    assert text.returncode == 0 and "ranks.rescheduling" in text.stdout and "[migrate_ranks]" in text.stdout


def test_unreadable_log_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = run_cli("run", str(bad))
    assert result.returncode == 2 and "bad.jsonl:1" in result.stderr


def test_verify_of_an_empty_log_or_an_unknown_job_fails_instead_of_saying_ok(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    result = run_cli("verify", str(empty))
    assert result.returncode == 1
    assert result.stdout.startswith("EMPTY: nothing to verify")
    result = run_cli("verify", str(empty), "--json")
    assert result.returncode == 1
    assert orjson.loads(result.stdout)["empty"] is True
    result = run_cli("verify", str(path("pod_level_reschedule")), "--job", "no-such-job")
    assert result.returncode == 1
    assert "job no-such-job was never submitted" in result.stdout
    assert run_cli("verify", str(path("pod_level_reschedule")), "--job", "llm").returncode == 0


def test_verify_fails_on_a_timer_the_daemon_never_fired(tmp_path: Path) -> None:
    """The daemon wrote into the log 5 minutes after the job's watchdog was due and never fired it (a timer
    service that lost it, or a firing dropped as the duplicate of a squatted id): the decisions still match, and
    verify says what is wrong instead of 'ok'."""
    from recovery.log import write_file
    from recovery.testing.scenario import Scenario

    scenario = Scenario()
    scenario.submit("w", ["a"], ranks_per_node=2, dp=2)
    scenario.job_event("w", "job.started")
    scenario.advance(10)  # fired as due: nothing to say
    log = tmp_path / "fired.jsonl"
    write_file(log, scenario.log.records())
    assert run_cli("verify", str(log)).returncode == 0
    scenario.now += 300 * 1_000_000_000  # time passes and nothing fires the watchdog
    scenario.send("recovery.ev.job.w.progress.step", b"{garbage")  # the daemon writes its dead letter
    write_file(log, scenario.log.records())
    result = run_cli("verify", str(log))
    assert result.returncode == 1
    assert result.stdout.startswith("TIMERS NEVER FIRED: 1")
    assert "w/watchdog" in result.stdout and "never fired" in result.stdout
    assert orjson.loads(run_cli("verify", str(log), "--json").stdout)["unfired_timers"]


def _servers_of(directory: Path) -> list[str]:
    """Processes whose command line names `directory`: a nats-server left behind on a copy made under it."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(directory).encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


async def test_every_command_reads_a_stopped_runs_data_directory_and_stops_the_server_it_started(
        tmp_path: Path) -> None:
    """A `recovery-run --standalone` data directory after the run: its daemon's JetStream store under
    daemon/jetstream, nothing serving it. Every command takes the directory (or the daemon's, inside it) as its log,
    reads it through a nats-server of its own on a copy, and stops that server whether the command succeeded or not;
    the directory itself is not written."""
    from recovery.log.jetstream import JetStreamLog
    from recovery.log.nats_server import NatsProcess, free_port

    data = tmp_path / "run"
    server = NatsProcess(data / "daemon" / "jetstream", port=free_port(), log_file=tmp_path / "nats-server.log")
    server.start()
    try:
        log = await JetStreamLog.connect(server.url)
        try:
            for _, record in iter_numbered(path("pod_level_reschedule")):
                await log.append(record.subject, record.envelope)
        finally:
            await log.close()
    finally:
        server.stop()
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*")}
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        # TMPDIR: the copy and its server live under `scratch`, where a server left running would be found
        return subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                              check=False, timeout=180, env={**os.environ, "TMPDIR": str(scratch)})

    expected = report_of_file(path("pod_level_reschedule"))
    report = await asyncio.to_thread(cli, "report", str(data), "--json")
    assert report.returncode == 0, report.stderr
    assert orjson.loads(report.stdout)["summary"]["incidents"] == expected["summary"]["incidents"]
    # a nats-server's own store directory (`-sd`, a platform's server or a test's) is read as well
    store = await asyncio.to_thread(cli, "report", str(data / "daemon" / "jetstream"), "--json")
    assert store.returncode == 0, store.stderr
    assert orjson.loads(store.stdout)["summary"]["incidents"] == expected["summary"]["incidents"]
    for args in (("run", str(data)), ("timeline", str(data / "daemon"), "--job", "llm"), ("verify", str(data)),
                 ("export", str(data), "-o", str(tmp_path / "run.jsonl")),
                 ("diff", str(data), str(tmp_path / "run.jsonl")),
                 ("whatif", str(data), "--policy", "rescheduling=torchelastic-like-rescheduling", "--tail-s", "60")):
        done = await asyncio.to_thread(cli, *args)
        assert done.returncode in (0, 1), f"{args}: {done.stderr}"  # verify may differ: the stream's own clock
        assert "Is a directory" not in done.stderr
        assert not _servers_of(scratch), f"{args[0]} left its nats-server running"
    assert sum(1 for _ in iter_numbered(tmp_path / "run.jsonl")) == sum(1 for _ in iter_numbered(
        path("pod_level_reschedule")))
    # a directory that holds no log: said, exit 2, nothing left running
    wrong = await asyncio.to_thread(cli, "report", str(tmp_path / "scratch"))
    assert wrong.returncode == 2 and "not a daemon's or a `recovery-run --standalone` data directory" in wrong.stderr
    no_stream = await asyncio.to_thread(cli, "report", str(data), "--stream", "NOPE")
    assert no_stream.returncode == 2 and "no stream 'NOPE'" in no_stream.stderr
    assert not _servers_of(scratch)
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*")} == before, "the run's directory was written"

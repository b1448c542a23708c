"""`recovery-replay` tells the truth about a replay: a per-job export re-derives its job's decisions, verify names
a changed or missing policy instead of calling it a bug, hostile input is input whatever its type, and no log line
ends the CLI with a traceback (exit 2 for an unreadable log, 1 for a divergence)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from events import subjects
from events.envelope import Record, make_envelope
from events.outputs import Decision
from policies import registry
from policies.rescheduling import LadderRescheduling
from recovery.cli.replay import main
from recovery.core.engine import Engine
from recovery.log import ExportHeader, FileLog, export_filter, iter_file, read_header
from recovery.log.verify import first_divergence, replay_log
from recovery.testing.scenario import Scenario
from tests.golden.scenarios import path as golden

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                          check=False, cwd=ROOT)


def shared_spare_pool(s: Scenario) -> None:
    """Jobs a and b share a pool of one spare. b's device fault takes the spare; a's fault then finds none and
    a waits; a spare joining (a node event about no node of a's) starts a's attempt. a's decisions follow from
    node events and from b's events: an export of a without them cannot re-derive them."""
    s.spare("spare0")
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4)
    s.submit("b", ["b0", "b1"], ranks_per_node=2, dp=4)
    for job in ("a", "b"):
        s.steps(job, 1)
        s.checkpoint(job, 1, "storage", "storage")
    s.advance(1)
    s.node_event("b1", "device.fault", device=1, vendor="nvidia", code="79")
    for command in s.outstanding():
        s.ack(command)
    s.advance(1)
    s.node_event("a1", "device.fault", device=0, vendor="nvidia", code="79")
    s.advance(1)
    s.spare("spare1")


@pytest.fixture
def two_jobs(tmp_path: Path) -> Iterator[tuple[Path, Scenario]]:
    log = FileLog(tmp_path / "full.jsonl")
    s = Scenario(log)
    shared_spare_pool(s)
    for subject in (subjects.job_event("a", "process.heartbeat"), subjects.job_event("b", "process.heartbeat"),
                    subjects.node_event("a1", "device.fault")):
        s.send(subject, b"{junk")  # a dead letter of each job's and one of a node's
    yield log.path, s  # a FileLog writes line by line: the file is complete while the log stays open
    log.close_sync()


def node_driven(s: Scenario, job: str) -> list[Decision]:
    """The job's decisions caused by a node event."""
    causes = {r.seq: r for r in s.log.records() if isinstance(r, Record)}
    return [d for d in s.decisions if d.job == job and causes[d.cause_seq].envelope.node is not None]


# -- 1. a per-job export re-derives its job's decisions --------------------------------------------------------
def test_the_scenario_makes_node_driven_decisions_that_depend_on_the_other_job(two_jobs: tuple[Path, Scenario]) -> None:
    full, s = two_jobs
    kinds = [d.kind for d in node_driven(s, "a")]
    assert "attempt.waiting" in kinds  # the spare was b's by then
    assert "attempt.started" in kinds  # spare1 joined
    assert main(["verify", str(full)]) == 0
    # Node events alone are not enough: without b's events the spare stays free and a's decisions differ.
    without_b = [r for r in iter_file(full) if not r.subject.startswith("recovery.ev.job.b.")]
    assert first_divergence(replay_log(((str(r.seq), r) for r in without_b), job="a")) is not None


def test_a_job_export_keeps_every_input_and_verifies(two_jobs: tuple[Path, Scenario], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    full, s = two_jobs
    out = tmp_path / "a.jsonl"
    count = asyncio.run(s.log.export(out, job="a", replayable=True))
    records = list(iter_file(out))
    assert count == len(records)
    assert read_header(out) == ExportHeader(job="a", inputs="all")
    everything = list(iter_file(full))
    # Every input (b's and the nodes' too), a's decisions and every job's acceptance; b's other decisions go.
    inputs = [r.seq for r in everything if not subjects.is_output(r.subject)]
    assert [r.seq for r in records if not subjects.is_output(r.subject)] == inputs
    kept = [r.envelope.data for r in records if isinstance(r, Record) and r.envelope.type == "decision"]
    assert {d.job for d in kept if d.kind != "job.accepted"} == {"a"}
    assert {d.job for d in kept if d.kind == "job.accepted"} == {"a", "b"}
    assert any(d.job == "b" and d.kind != "job.accepted" for d in s.decisions)  # something was left out
    letters = [r.envelope.data.subject for r in records if isinstance(r, Record) and r.envelope.type == "rejection"]
    assert letters == [subjects.job_event("a", "process.heartbeat"), subjects.node_event("a1", "device.fault")]
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith("ok: ") and "job a's" in said and "cannot be exact" not in said
    # The header says the export keeps the job's dead letters: one gone is a divergence, even with none left.
    kept = [line for line in out.read_bytes().splitlines() if b'"recovery.dlq.' not in line]
    out.write_bytes(b"\n".join(kept) + b"\n")
    assert main(["verify", str(out)]) == 1
    assert "DIVERGENCE in rejections: the replay rejects seq" in capsys.readouterr().out


def test_the_export_filter_is_one_function_for_files_and_standard_output(two_jobs: tuple[Path, Scenario]) -> None:
    full, _ = two_jobs
    keep = export_filter("a", None, replayable=True)
    node_events = [r for r in iter_file(full) if r.subject.startswith("recovery.ev.node.")]
    b_events = [r for r in iter_file(full) if r.subject.startswith("recovery.ev.job.b.")]
    assert node_events and b_events
    assert all(keep(r) for r in node_events + b_events)


def test_verify_job_checks_one_job_of_a_whole_log_and_refuses_another_jobs_export(
        two_jobs: tuple[Path, Scenario], tmp_path: Path) -> None:
    full, s = two_jobs
    assert main(["verify", str(full), "--job", "b"]) == 0
    out = tmp_path / "a.jsonl"
    asyncio.run(s.log.export(out, job="a", replayable=True))
    assert main(["verify", str(out), "--job", "b"]) == 2


def test_a_narrow_or_cut_export_says_it_cannot_be_exact(two_jobs: tuple[Path, Scenario], tmp_path: Path) -> None:
    _, s = two_jobs
    narrow = tmp_path / "narrow.jsonl"
    asyncio.run(s.log.export(narrow, job="a"))  # the log API's own-records filter
    result = run_cli("verify", str(narrow))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot be exact" in result.stdout and "only job a's own records" in result.stdout
    assert "same policies" not in result.stdout
    cut = tmp_path / "cut.jsonl"
    fault = next(r for r in s.log.records() if isinstance(r, Record) and r.envelope.type == "device.fault")
    asyncio.run(s.log.export(cut, job="a", since_ns=fault.ts, replayable=True))
    result = run_cli("verify", str(cut))
    assert result.returncode == 1
    assert f"the log starts at seq {fault.seq}, not 1" in result.stdout and "--since" in result.stdout
    assert "same policies" not in result.stdout


# -- 2. a policy's version bump is a changed policy, whatever the diverging decision's own policy field -----------
ORIGINAL_LADDER_VERSION = LadderRescheduling.version  # what the golden logs were recorded with


def test_a_version_bump_is_a_changed_policy_not_a_bug(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(LadderRescheduling, "version", "99")
    assert main(["verify", str(golden("pod_level_reschedule"))]) == 1
    said = capsys.readouterr().out
    recorded = f"ladder@{ORIGINAL_LADDER_VERSION}"
    assert "changed policy for job llm" in said and f"rescheduling {recorded} -> ladder@99" in said
    assert "a bug" not in said
    assert main(["verify", str(golden("pod_level_reschedule")), "--json"]) == 1
    verdict = orjson.loads(capsys.readouterr().out)["divergence"]["verdict"]
    assert verdict.startswith("changed policy")


def test_same_policies_and_a_different_decision_without_a_policy_is_still_a_bug(tmp_path: Path) -> None:
    lines = []
    for line in golden("pod_level_reschedule").read_bytes().splitlines():
        obj = orjson.loads(line)
        data = (obj.get("envelope") or {}).get("data") or {}
        if obj["subject"].startswith("recovery.dec.") and data.get("kind") == "incident.closed":
            assert data["policy"] is None
            data["reason"] = "edited"
        lines.append(orjson.dumps(obj))
    log = tmp_path / "edited.jsonl"
    log.write_bytes(b"\n".join(lines) + b"\n")
    result = run_cli("verify", str(log))
    assert result.returncode == 1 and "same policies, different decision" in result.stdout


def test_a_changed_policy_of_a_job_sharing_the_cluster_shows_in_a_job_export(
        two_jobs: tuple[Path, Scenario], tmp_path: Path) -> None:
    _, s = two_jobs
    out = tmp_path / "a.jsonl"
    asyncio.run(s.log.export(out, job="a", replayable=True))
    lines = []
    for line in out.read_bytes().splitlines():  # b ran an older ladder (as a log recorded before a bump would say)
        obj = orjson.loads(line)
        data = (obj.get("envelope") or {}).get("data") or {}
        if obj.get("subject") == "recovery.dec.b" and data.get("kind") == "job.accepted":
            data["detail"]["policies"]["rescheduling"] = "ladder@2"
        lines.append(orjson.dumps(obj))
    out.write_bytes(b"\n".join(lines) + b"\n")
    result = run_cli("verify", str(out))
    assert result.returncode == 1
    installed = f"ladder@{LadderRescheduling.version}"
    assert f"changed policy for job b (recorded -> installed): rescheduling ladder@2 -> {installed}" in result.stdout


# -- 3. a policy whose plugin is not installed is named ----------------------------------------------------------
class AcmeLadder(LadderRescheduling):
    name: ClassVar[str] = "acme-ladder"
    version: ClassVar[str] = "7"


def test_a_policy_whose_plugin_is_gone_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    installed = registry.available()
    registry._instance.cache_clear()
    monkeypatch.setattr(registry, "available", lambda: {**installed, "acme-ladder": AcmeLadder})
    log = FileLog(tmp_path / "acme.jsonl")
    s = Scenario(log)
    s.spare("spare0")
    s.submit("llm", ["n0", "n1"], ranks_per_node=2, dp=4,
             policies={"rescheduling": {"name": "acme-ladder", "params": {}}})
    s.steps("llm", 1)
    s.checkpoint("llm", 1, "storage", "storage")
    s.job_event("llm", "process.exited", rank=1, exit_code=1)
    log.close_sync()
    assert "acme-ladder@7" in {d.policy for d in s.decisions}
    monkeypatch.undo()
    registry._instance.cache_clear()  # the plugin is uninstalled: a fresh process would not know it either
    result = run_cli("verify", str(log.path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "policy not installed" in result.stdout and "rescheduling policy 'acme-ladder'" in result.stdout
    assert "acme-ladder@7" in result.stdout and "a bug" not in result.stdout


# -- 4. a record on an input subject is an input, whatever its type -------------------------------------------------
def test_a_decision_typed_message_on_an_event_subject_is_input(tmp_path: Path) -> None:
    log = FileLog(tmp_path / "hostile.jsonl")
    s = Scenario(log)
    s.submit("a", ["a0"], ranks_per_node=2, dp=2)
    forged = Decision(job="a", cause_seq=1, index=5, kind="job.completed", previous="running", state="completed")
    for subject in (subjects.job_event("a", "decision"), subjects.node_event("a0", "decision")):
        s.send(subject, make_envelope("decision", forged, id=f"forged-{subject}", job="a", source="mallory"))
    s.send(subjects.job_event("a", "rejection"), b'{"id": "r", "type": "rejection", "data": {}}')
    s.steps("a", 1)
    log.close_sync()
    assert [r.code for r in s.rejections] == ["unknown_type", "unknown_type", "schema_violation"]
    result = run_cli("verify", str(log.path))
    assert result.returncode == 0, result.stdout
    rows = orjson.loads(run_cli("timeline", str(log.path), "--job", "a", "--json").stdout)
    assert [r["what"] for r in rows if r["what"].startswith("decision")] == ["decision job.accepted",
                                                                            "decision job.started"]
    assert "input typed decision" in [r["what"] for r in rows]


# -- 5. no log line ends the CLI with a traceback ------------------------------------------------------------------
def write_lines(path: Path, lines: list[bytes], newline_at_end: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline_at_end else b""))
    return path


def golden_lines() -> list[bytes]:
    return golden("step_retry").read_bytes().splitlines()


@pytest.mark.parametrize("command", ["run", "verify", "timeline"])
def test_a_last_line_cut_short_is_unreadable_and_named(command: str, tmp_path: Path) -> None:
    lines = golden_lines()
    log = write_lines(tmp_path / "cut.jsonl", [*lines[:-1], lines[-1][:-30]], newline_at_end=False)
    result = run_cli(command, str(log), *(["--job", "net"] if command == "timeline" else []))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"cut.jsonl:{len(lines)}: the last line is cut short" in result.stderr


@pytest.mark.parametrize("line", [b'{"hello": "world"}', b"[1, 2, 3]", b'{"seq": -1, "ts": 5, "subject": "x"}',
                                  b'{"seq": 18446744073709551616, "ts": 5, "subject": "recovery.ev.node.n.x"}'])
def test_a_line_that_is_not_a_record_is_unreadable_and_named(line: bytes, tmp_path: Path) -> None:
    lines = golden_lines()
    log = write_lines(tmp_path / "bad.jsonl", [*lines[:3], line, *lines[3:]])
    for command in ("run", "verify"):
        result = run_cli(command, str(log))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "bad.jsonl:4: not a log record" in result.stderr
        assert "\n" not in result.stderr.strip()  # one line, not a pydantic report


def test_a_recorded_decision_of_an_unknown_schema_is_unreadable_not_a_divergence(tmp_path: Path) -> None:
    lines, where = [], 0
    for number, line in enumerate(golden_lines(), 1):
        obj = orjson.loads(line)
        if obj["subject"].startswith("recovery.dec.") and not where:  # as a newer daemon would write it
            obj["envelope"]["schema"] = 2
            where = number
        lines.append(orjson.dumps(obj))
    log = write_lines(tmp_path / "newer.jsonl", lines)
    result = run_cli("verify", str(log))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"newer.jsonl:{where}: a recorded decision this version cannot read: decision schema 2" in result.stderr
    assert run_cli("run", str(log)).returncode == 0  # the replay itself does not need the recorded outputs


def test_an_input_of_an_unknown_schema_is_input_the_daemon_rejected(tmp_path: Path) -> None:
    log = FileLog(tmp_path / "schema.jsonl")
    s = Scenario(log)
    s.submit("a", ["a0"], ranks_per_node=2, dp=2)
    s.send(subjects.job_event("a", "process.heartbeat"),
           b'{"id": "h", "type": "process.heartbeat", "job": "a", "schema": 9, "data": {"rank": 0}}')
    log.close_sync()
    assert [r.code for r in s.rejections] == ["schema_violation"]
    result = run_cli("verify", str(log.path))
    assert result.returncode == 0, result.stdout


def test_an_unknown_export_header_format_is_unreadable(tmp_path: Path) -> None:
    log = write_lines(tmp_path / "future.jsonl", [b'{"export": {"format": 9, "job": "net"}}', *golden_lines()])
    result = run_cli("verify", str(log))
    assert result.returncode == 2 and "future.jsonl:1: export header of format 9" in result.stderr


def test_a_number_beyond_64_bits_in_a_line_is_a_rejection_not_a_traceback(tmp_path: Path) -> None:
    # A checkpoint at a step beyond 64 bits (a hand-made or foreign-written line), then a crash: either the engine
    # refuses the checkpoint, or the plan resuming from that step cannot be written and the crash is refused.
    lines = []
    for line in golden("power_off_no_replica").read_bytes().splitlines():
        obj = orjson.loads(line)
        env = obj.get("envelope") or {}
        if env.get("type") == "checkpoint.saved" and env["data"]["step"] == 10:
            env["data"]["step"] = 2**70
        lines.append(json.dumps(obj).encode())  # orjson cannot write it either
    log = write_lines(tmp_path / "huge.jsonl", lines)
    for args in (["run"], ["run", "--json"], ["verify"], ["verify", "--json"]):
        result = run_cli(*args, str(log))
        assert "Traceback" not in result.stderr and result.stderr == "", result.stderr
        assert result.returncode == (0 if args[0] == "run" else 1), result.stdout
    assert re.search(r"rejected seq \d+ \[(unencodable|schema_violation)\]", run_cli("run", str(log)).stdout)


def test_effects_that_cannot_be_encoded_are_a_rejection(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    apply = Engine.apply
    crash = next(r.seq for r in iter_file(golden("step_retry"))
                 if isinstance(r, Record) and r.envelope.type == "network.collective_timeout")

    def beyond_the_wire(self: Engine, record: Any) -> Any:
        effects = apply(self, record)
        if record.seq == crash:  # what no encoder writes: the daemon could not have recorded these effects
            effects[0] = effects[0].model_copy(update={"detail": {"step": 2**70}})
        return effects

    monkeypatch.setattr(Engine, "apply", beyond_the_wire)
    assert main(["run", str(golden("step_retry")), "--json"]) == 0
    rejected = orjson.loads(capsys.readouterr().out)["rejections"]
    assert (rejected[0]["seq"], rejected[0]["code"]) == (crash, "unencodable")
    assert "its effects cannot be encoded" in rejected[0]["reason"]
    # The rejected record never made the retry's generation: the steps reported in it are refused as ahead.
    assert rejected[1:] and {r["code"] for r in rejected[1:]} == {"unknown_attempt"}
    assert main(["verify", str(golden("step_retry"))]) == 1
    said = capsys.readouterr().out
    assert said.startswith("DIVERGENCE at decision")
    assert f"the replay rejects seq {crash} [unencodable]: its effects cannot be encoded" in said


def test_a_record_whose_handling_raises_is_a_rejection(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    apply = Engine.apply

    def failing(self: Engine, record: Any) -> Any:
        if record.seq == 7:
            raise RuntimeError("a bug outside the engine's own guard")
        return apply(self, record)

    monkeypatch.setattr(Engine, "apply", failing)
    assert main(["run", str(golden("step_retry"))]) == 0
    assert "rejected seq 7 [internal_error]: its handling raised RuntimeError" in capsys.readouterr().out
    assert main(["verify", str(golden("step_retry"))]) == 1
    said = capsys.readouterr().out
    assert "DIVERGENCE in rejections: the replay rejects seq 7 [internal_error]" in said

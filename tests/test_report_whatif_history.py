"""`recovery-replay whatif` on a log of several jobs: which job it replays, and the cluster's history before that
job (the node events the engine counted under earlier jobs), which the simulated engine hears first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recovery.cli.replay import main
from recovery.log import EPOCH, ExportHeader, write_file
from recovery.report.job_choice import choose_job, exported_job
from recovery.report.recorded import history_of, read_recorded
from recovery.report.source import iter_file
from recovery.report.whatif import whatif
from recovery.sim.config import NS
from recovery.testing.scenario import Scenario

GOLDEN = Path(__file__).parent / "golden"
WINDOW_120_S = {"detection": {"name": "default", "params": {"frequency_window_s": 120.0}}}


def _isolation_reasons(path: Path) -> list[str]:
    return [r["envelope"]["data"]["reason"] for r in iter_file(path) if r["envelope"]["type"] == "decision"
            and r["envelope"]["data"]["kind"] == "fault.confirmed" and "lemon" in r["envelope"]["data"]["reason"]]


def test_whatif_of_two_jobs_replays_the_one_with_the_incidents_and_the_device_faults_before_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lemon_isolated_with_spare: job prev meets XID 48 on l1 device 2 and ends; job lem, on l0 and l1, meets it twice
    more and the frequency rule isolates the device at the fourth fault it counts (prev's, two 48s and a 63). The
    what-if replays lem (two incidents to prev's one) and prev's fault and repair go to the simulated engine before
    lem is submitted: it counts four, as recorded, and the night reproduces."""
    log = GOLDEN / "lemon_isolated_with_spare.jsonl"
    result = whatif(log, [], keep_logs=tmp_path, tail_s=60)
    assert result["job"] == "lem"
    assert result["job_choice"] == {"why": "2 incident(s), the most of the log's 2 jobs",
                                    "left_out": [{"job": "prev", "incidents": 1, "alongside": False}]}
    assert result["other_jobs"] == []
    assert result["inputs"]["history"] == {"events": 2, "by_kind": {"device.fault": 1, "device.recovered": 1},
                                           "left": []}
    rep = result["reproduction"]
    assert rep["reproduced"], rep
    assert [d["decision"] for d in rep["simulated"]] == [
        "attempt.started in_place", "incident.closed", "attempt.started migrate", "incident.closed"]
    [recorded] = _isolation_reasons(log)
    [simulated] = _isolation_reasons(tmp_path / "recorded-policies.jsonl")
    assert "4 faults of the device within 86400s" in recorded and "4 faults of the device within 86400s" in simulated
    # the history comes first in the simulated log, before the job's submission, on the simulated name of l1
    records = [r for r in iter_file(tmp_path / "recorded-policies.jsonl")]
    first = [(r["envelope"]["type"], r["envelope"]["node"]) for r in records[:2]]
    assert first == [("device.fault", "n00001"), ("device.recovered", "n00001")]
    assert main(["whatif", str(log), "--tail-s", "60"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "job lem: 2 incident(s), the most of the log's 2 jobs" in out
    assert "prev (1 incident(s))" in out and "2 node events of its nodes" in out and "reproduced:" in out


def _history_before_the_job() -> Scenario:
    """XID 63 on f1 device 2 at 0 s and 50 s, before any job; job freq (window 120 s) submitted at 100 s; the same
    code at 130 s (two in the window: 50 s and 130 s) and at 135 s (three: a lemon, isolated onto the spare)."""
    s = Scenario()
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.advance(50)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.advance(50)
    s.spare("spare0")
    s.submit("freq", ["f0", "f1"], ranks_per_node=4, dp=8, policies=WINDOW_120_S)
    s.train("freq", 10)
    s.checkpoint("freq", 10, "storage", "storage")
    s.train("freq", 20)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.train("freq", 5)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.ack_all()
    s.advance(20)
    s.train("freq", 2)
    return s


def test_the_history_is_heard_at_its_recorded_times_before_the_job(tmp_path: Path) -> None:
    """The history's offsets count: within a 120 s window the fault at 0 s has left it by 130 s, so the lemon is the
    one at 135 s (35 s into the job), not at 130 s, as it would be had the history been heard at the job's start."""
    log = tmp_path / "history.jsonl"
    write_file(log, list(_history_before_the_job().log.records()))
    cluster = read_recorded(iter_file(log))
    assert [(r.before_ns, r.node, r.kind) for r in history_of(cluster)] == [
        (100 * NS, "n00001", "device.fault"), (50 * NS, "n00001", "device.fault")]
    result = whatif(log, [], keep_logs=tmp_path / "whatif", tail_s=60)
    rep = result["reproduction"]
    assert rep["reproduced"], rep
    assert rep["recorded"][0] == {"decision": "attempt.started migrate", "at_s": 35.0}
    simulated = [r for r in iter_file(tmp_path / "whatif" / "recorded-policies.jsonl")]
    assert [r["ts"] - EPOCH for r in simulated[:2]] == [-100 * NS, -50 * NS]
    [submitted] = [r for r in simulated if r["envelope"]["type"] == "job.submitted"]
    assert submitted["ts"] == EPOCH


def test_a_fault_still_open_at_the_submission_is_said_not_replayed_as_one(tmp_path: Path) -> None:
    """An XID 48 on n1 device 1 before the job, never recovered: its event is history, and what it left (a device out
    of service) is named, since the simulated node joins healthy."""
    s = Scenario()
    s.node_event("n1", "device.fault", device=1, vendor="nvidia", code="48")
    s.advance(10)
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    log = tmp_path / "open.jsonl"
    write_file(log, list(s.log.records()))
    cluster = read_recorded(iter_file(log))
    assert [past.kind for past in cluster.history] == ["device.fault"]
    assert cluster.history_left == {"n1": ["n1 device 1 broken (XID 48, device.fault (seq 1))"]}
    assert not cluster.drafts  # no fault of the job's


def _job(seq: int, job: str, incident: str | None = None) -> dict[str, Any]:
    if incident is None:
        envelope = {"type": "job.submitted", "job": job, "data": {}}
    else:
        envelope = {"type": "decision", "job": job, "data": {"job": job, "kind": "fault.confirmed",
                                                              "incident": incident}}
    return {"seq": seq, "ts": seq, "subject": "x", "envelope": envelope}


def test_the_job_chosen_is_the_one_a_postmortem_is_about(tmp_path: Path) -> None:
    """The most incidents; of a tie, the last submitted; with none, the first; a per-job export's own job; --job."""
    records = [_job(1, "a"), _job(2, "a", "a#1"), _job(3, "b"), _job(4, "b", "b#1"), _job(5, "c")]
    assert choose_job(records).job == "b"
    assert "the last submitted of the 2 with as many" in choose_job(records).why
    assert choose_job(records[:2] + records[2:3]).job == "a"
    assert choose_job([_job(1, "a"), _job(2, "b")]).job == "a"
    assert choose_job(records, given="c").job == "c" and choose_job(records, given="c").others == ["a", "b"]
    assert choose_job(records, exported="a").why == "the export is of this job (its header names it)"
    assert choose_job([]).job is None
    export = tmp_path / "a.jsonl"
    export.write_bytes(ExportHeader(job="a").encode() + b"\n")
    assert exported_job(export) == "a" and exported_job(GOLDEN / "pod_level_reschedule.jsonl") is None

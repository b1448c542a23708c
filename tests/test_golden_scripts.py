"""Golden logs of real training scripts' ways (`tests/golden/scenarios_scripts.py`): each fails on an engine that reads
its own stop as a preemption, drops a new generation's crash, declares a stock script silent or kills it at an
attempt's deadline, or restarts a crash loop without end."""

from __future__ import annotations

import pytest

from events.outputs import Decision
from recovery.log import iter_file
from recovery.log.recorder import Replay, replay
from tests.golden.scenarios import path


def load(name: str) -> Replay:
    return replay(iter_file(path(name)))


def kinds(result: Replay, kind: str) -> list[Decision]:
    return [d for d in result.decisions if d.kind == kind]


def test_the_engines_own_sigterm_is_no_preemption_and_the_new_generations_crash_is_a_fault() -> None:
    result = load("engine_stop_not_preemption")
    reasons = [d.reason for d in result.decisions]
    assert not any("SIGTERM" in r or "preempt" in r for r in reasons), reasons
    assert not kinds(result, "fault.absorbed")
    [added] = kinds(result, "fault.added")
    assert added.reason == "rank 0: exited with status 1"
    [failed] = kinds(result, "attempt.failed")
    assert "rank 0: exited with status 1" in failed.reason
    assert len(kinds(result, "attempt.started")) == 2
    job = result.engine.jobs["ddp"]
    assert job.state == "running" and job.incident is None
    assert [c["outcome"] for c in job.snapshot()["incidents"]] == ["recovered"]


def test_an_older_generations_exit_is_explained_not_dropped() -> None:
    result = load("stale_exit_explained")
    [ignored] = [d for d in kinds(result, "signal.ignored") if d.detail.get("signal") == "process.exited"]
    assert ignored.detail == {"signal": "process.exited", "rank": 2, "attempt": 0}
    assert "generation 0" in ignored.reason and "generation 1 replaced it" in ignored.reason
    assert result.engine.jobs["old"].state == "running"


def test_a_stock_script_is_never_silent_restarts_whole_and_recovers_after_the_grace_period() -> None:
    result = load("stock_script_restarts_whole")
    job = result.engine.jobs["stock"]
    assert not job.sdk
    confirmed = kinds(result, "fault.confirmed")
    assert [d.reason for d in confirmed] == ["rank 1: exited with status 1"], "silence is no fault of a stock script"
    started = kinds(result, "attempt.started")
    assert [d.detail["granularity"] for d in started] == ["restart_job", "restart_job"]
    assert kinds(result, "attempt.failed") and not kinds(result, "attempt.timed_out")
    [closed] = kinds(result, "incident.closed")
    assert "ran 30 s without exiting" in closed.reason and closed.detail["lost_steps"] is None
    restoring = kinds(result, "ranks.restoring")
    assert all(d.timers and d.timers[0].id.split("/")[1] == "grace" for d in restoring)
    assert job.state == "running" and job.incident is None and len(job.closed) == 1


def test_a_crash_at_the_same_step_after_each_recovery_fails_the_job_as_a_loop() -> None:
    result = load("crash_loop")
    assert len(kinds(result, "incident.closed")) == 2
    [failed] = kinds(result, "job.failed")
    assert failed.reason.startswith("crash loop: the job crashed at step 14")
    assert "[14, 14]" in failed.reason
    assert result.engine.jobs["loop"].state == "failed"


def test_the_report_names_the_crash_loop_and_a_stock_scripts_unknown_lost_steps(
        capsys: pytest.CaptureFixture[str]) -> None:
    from recovery.cli.replay import main
    from recovery.report import build_report
    from recovery.report import iter_file as report_records
    from recovery.report.html import render_html

    report = build_report(report_records(path("crash_loop")))
    [job] = report["jobs"]
    assert job["state"] == "failed" and job["end_reason"].startswith("crash loop: the job crashed at step 14")
    assert main(["report", str(path("crash_loop"))]) == 0
    assert "failed: crash loop: the job crashed at step 14" in capsys.readouterr().out
    assert "failed: crash loop: the job crashed at step 14" in render_html(report)
    stock = build_report(report_records(path("stock_script_restarts_whole")))
    [incident] = stock["jobs"][0]["incidents"]
    assert incident["lost_steps"] is None and incident["outcome"] == "recovered"
    assert main(["report", str(path("stock_script_restarts_whole"))]) == 0


def test_a_widened_incident_is_planned_for_its_worst_fault() -> None:
    result = load("widened_for_worst_fault")
    started = kinds(result, "attempt.started")
    assert [d.detail["granularity"] for d in started] == ["in_place", "migrate"]
    assert started[1].reason.startswith("node fault"), started[1].reason
    assert started[1].detail["vacate"] == ["w1"]
    assert not kinds(result, "attempt.waiting")
    assert len(kinds(result, "incident.closed")) == 1
    assert result.engine.jobs["wide"].snapshot()["incidents"][0]["fault_class"] == "node"


def test_a_second_fault_carries_the_restart_under_way_over_and_restarts_only_its_own_rank() -> None:
    result = load("double_fault_carries_restart")
    restarted = [list(c.ranks) for d in result.decisions for c in d.commands if c.kind == "restart_ranks"]
    # two ranks killed together start 2 processes, a survivor killed during the recovery 1 more; then rank 0 and 1
    assert restarted[:3] == [[1], [2], [3]], restarted
    started = [d.detail for d in kinds(result, "attempt.started")]
    assert [d.get("carried") for d in started[:3]] == [None, [1], [1, 2]]
    assert not kinds(result, "attempt.settling"), "two or three faults restart at once, no settle window"
    # the restart a carried rank depended on failed: the attempt that carried it fails rather than waiting for it
    [failed] = kinds(result, "attempt.failed")
    assert failed.reason == "the restart of rank(s) 0 it carried over failed: exec format error"
    job = result.engine.jobs["twice"]
    assert job.state == "running" and [c["outcome"] for c in job.closed] == ["recovered", "recovered"]

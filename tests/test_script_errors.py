"""A script that fails by itself: its ranks' error, read from torch's error file or from their output by the agent,
travels with the exit; every rank failing the same way before the first step, twice, fails the job after one retry
with that error quoted, and a crash loop names the script's exception rather than the SIGABRT that followed it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from recovery.agent import errors
from recovery.cli.replay import main
from recovery.log import write_file
from recovery.report import build_report
from recovery.report import iter_file as report_records
from recovery.testing.scenario import Scenario

NO_DYING: dict[str, Any] = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}
IMPORT_ERROR = {"type": "ModuleNotFoundError", "message": "No module named 'trainer_utils'",
                "place": "train.py:3 in <module>", "source": "error_file"}
QUOTED = "ModuleNotFoundError: No module named 'trainer_utils' (train.py:3 in <module>)"


def fail_everywhere(s: Scenario, job: str, world: int, error: dict[str, Any], spread_s: float = 0.2) -> None:
    generation = s.engine.jobs[job].generation
    for rank in range(world):
        s.job_event(job, "process.exited", rank=rank, exit_code=1, attempt=generation, error=error)
        s.advance(spread_s)


def typo() -> Scenario:
    """A script that cannot start: both ranks fail at import, the retry's too."""
    s = Scenario()
    s.submit("typo", ["t0"], ranks_per_node=2, dp=2, policies=NO_DYING)
    fail_everywhere(s, "typo", 2, IMPORT_ERROR)
    s.ack_all()
    s.advance(3)
    fail_everywhere(s, "typo", 2, IMPORT_ERROR)
    s.advance(10)  # the settle window for the other ranks' exits ends
    s.ack_all()
    return s


def test_every_rank_failing_the_same_way_before_the_first_step_fails_the_job_after_one_retry() -> None:
    s = typo()
    assert s.state("typo") == "failed"
    assert len(s.find("attempt.started", "typo")) == 1, "one retry, not the whole budget"
    [failed] = s.find("job.failed", "typo")
    assert failed.reason.startswith("deterministic error: every rank failed the same way"), failed.reason
    assert QUOTED in failed.reason
    [confirmed] = s.find("fault.confirmed", "typo")
    assert confirmed.reason.endswith(QUOTED), "the fault names the script's error"


def test_a_second_rank_killed_by_the_restart_before_it_failed_still_counts_once_the_next_generation_fails_whole(
        ) -> None:
    s = Scenario()
    s.submit("race", ["r0"], ranks_per_node=2, dp=2, policies=NO_DYING)
    s.job_event("race", "process.exited", rank=0, exit_code=1, attempt=0, error=IMPORT_ERROR)
    s.ack_all()  # the restart stops rank 1 before its own import failed
    s.job_event("race", "process.exited", rank=1, exit_code=None, signal=9, attempt=0)
    s.advance(3)
    s.job_event("race", "process.exited", rank=0, exit_code=1, attempt=1, error=IMPORT_ERROR)
    [settling] = s.find("attempt.settling", "race")
    assert "wait for the others' exits" in settling.reason
    s.advance(1)
    s.job_event("race", "process.exited", rank=1, exit_code=1, attempt=1, error=IMPORT_ERROR)
    s.advance(10)
    s.ack_all()
    assert s.state("race") == "failed" and QUOTED in s.find("job.failed", "race")[0].reason
    assert len(s.find("attempt.started", "race")) == 1


def test_ranks_failing_differently_or_without_a_word_are_retried_as_before() -> None:
    for second in ({**IMPORT_ERROR, "message": "No module named 'other'"}, None):
        s = Scenario()
        s.submit("flaky", ["f0"], ranks_per_node=2, dp=2, policies=NO_DYING)
        fail_everywhere(s, "flaky", 2, IMPORT_ERROR)
        s.ack_all()
        s.advance(3)
        generation = s.engine.jobs["flaky"].generation
        for rank in range(2):
            extra = {"error": second} if second is not None else {}
            s.job_event("flaky", "process.exited", rank=rank, exit_code=1, attempt=generation, **extra)
        s.advance(10)
        s.ack_all()
        assert s.state("flaky") != "failed", [d.reason for d in s.find("job.failed", "flaky")]
        assert len(s.find("attempt.started", "flaky")) == 2


def test_a_crash_loop_names_the_scripts_exception_not_the_sigabrt_of_the_rank_that_died_after_it() -> None:
    raised = {"type": "ValueError", "message": "bad batch", "place": "train.py:88 in step", "source": "output"}
    s = Scenario()
    s.submit("loop", ["l0"], ranks_per_node=4, dp=4, policies=NO_DYING)
    s.train("loop", 10)
    s.checkpoint("loop", 10, "storage", "storage")
    for _ in range(3):
        s.train("loop", 4)
        generation = s.engine.jobs["loop"].generation
        s.job_event("loop", "process.exited", rank=1, exit_code=1, attempt=generation, error=raised)
        s.job_event("loop", "process.exited", rank=2, exit_code=None, signal=6, attempt=generation)
        s.ack_all()
        s.advance(5)
    [failed] = s.find("job.failed", "loop")
    assert failed.reason.startswith("crash loop"), failed.reason
    assert "the script's error: ValueError: bad batch (train.py:88 in step)" in failed.reason


def test_the_report_quotes_the_scripts_error_in_the_fault_and_the_jobs_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "typo.jsonl"
    write_file(log, typo().log.records())
    [job] = build_report(report_records(log))["jobs"]
    assert job["state"] == "failed" and QUOTED in job["end_reason"]
    assert any(QUOTED in fault["reason"] for incident in job["incidents"] for fault in incident["faults"])
    assert main(["report", str(log)]) == 0
    flat = " ".join(capsys.readouterr().out.split())  # the terminal's table wraps long reasons
    assert "failed: deterministic error" in flat and QUOTED in flat


# -- the agent's side: what a failed rank said -----------------------------------------------------------------
def test_the_agent_reads_the_exception_record_wrote_to_the_error_file(tmp_path: Path) -> None:
    path = errors.error_file(tmp_path, "j", 1, 2)
    assert path.name == "j.rank1.gen2.error.json"
    callstack = ('Traceback (most recent call last):\n  File "/x/train.py", line 40, in main\n    run()\n'
                 '  File "/x/train.py", line 12, in run\n    raise ValueError("lr must be > 0")\n'
                 'ValueError: lr must be > 0\n')
    path.write_text(json.dumps({"message": {"message": "ValueError: lr must be > 0",
                                            "extraInfo": {"py_callstack": callstack, "timestamp": "1"}}}))
    error = errors.script_error(tmp_path, "j", 1, 2, exit_code=1, signal=None)
    assert error is not None and error.source == "error_file"
    assert error.summary() == "ValueError: lr must be > 0 (train.py:12 in run)"
    assert errors.script_error(tmp_path, "j", 1, 2, exit_code=None, signal=9) is None, "a stop is no failure"


def test_without_an_error_file_the_agent_reads_the_last_traceback_or_line_of_the_output(tmp_path: Path) -> None:
    errors.output_file(tmp_path, "j", 0, 0).write_text(
        "epoch 0\nTraceback (most recent call last):\n  File \"/x/old.py\", line 1, in <module>\nKeyError: 'a'\n"
        "During handling...\nTraceback (most recent call last):\n  File \"/x/train.py\", line 7, in <module>\n"
        "    import trainer_utils\nModuleNotFoundError: No module named 'trainer_utils'\n")
    error = errors.script_error(tmp_path, "j", 0, 0, exit_code=1, signal=None)
    assert error is not None and error.source == "output"
    assert error.summary() == "ModuleNotFoundError: No module named 'trainer_utils' (train.py:7 in <module>)"
    errors.output_file(tmp_path, "j", 1, 0).write_text(
        "Could not override 'optim.lrr'.\nKey 'lrr' is not in struct\n"
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
    hydra = errors.script_error(tmp_path, "j", 1, 0, exit_code=1, signal=None)
    assert hydra is not None and hydra.summary() == "Key 'lrr' is not in struct"
    assert errors.script_error(tmp_path, "j", 2, 0, exit_code=1, signal=None) is None  # no output at all

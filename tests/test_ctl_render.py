"""recovery-ctl's tables: what fits the terminal, and every column with --wide."""

from __future__ import annotations

import pytest

from recovery.cli.ctl import JOB_COLUMNS, render

JOB = {"job": "llama-405b-pretrain-0007", "state": "recovering", "phase": "restoring", "step": 123456,
       "generation": 12, "alive": 16383, "world": 16384, "dp": 128, "nodes": 2048, "incident": 7, "attempt": 2,
       "incidents_closed": 6, "restarts_used": 9}


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_jobs_at_80_columns_shows_whole_columns_that_fit_and_says_what_it_left_out(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    render("jobs", {"jobs": [JOB]})
    lines = _lines(capsys)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    for whole in ("llama-405b-pretrain-0007", "recovering", "restoring", "123456", "16383/16384"):
        assert whole in text  # whole, not cut to three letters
    assert "incidents closed" not in text
    assert "--wide" in text


def test_jobs_wide_shows_every_column_whole(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    render("jobs", {"jobs": [JOB]}, wide=True)
    text = "\n".join(_lines(capsys))
    for column in JOB_COLUMNS:
        assert column.replace("_", " ") in text
    assert "--wide" not in text


def test_a_partitioned_answer_shows_each_jobs_partition_and_each_partitions_status(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    render("jobs", {"ok": True, "partitions": 4, "jobs": [{**JOB, "partition": 3}]})
    header, row = (line for line in _lines(capsys) if "partition" in line or "llama" in line)
    assert header.index("partition") > header.index("state") and "3" in row.split("│")[3]
    render("status", {"ok": True, "partitions": 4, "status": {"0": {"role": "active"}, "2": {"role": "active"}}})
    text = "\n".join(_lines(capsys))
    assert "partition 0 of 4" in text and "partition 2 of 4" in text

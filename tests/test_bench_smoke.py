"""Smoke test of tools/bench.py: each bench runs at --quick sizes and prints JSON lines (no timing checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
KEYS = {"bench", "metric", "value", "unit"}
REQUIRED = {
    "engine": {"events_per_s", "baseline_ops_per_s", "ratio_to_baseline", "bytes_per_rank"},
    "replay": {"events_per_s", "baseline_ops_per_s", "ratio_to_baseline"},
}


@pytest.mark.parametrize("bench", sorted(REQUIRED))
def test_bench_quick_prints_json_metrics(bench: str) -> None:
    done = subprocess.run([sys.executable, str(BENCH), bench, "--quick"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "warning: " not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines, done.stderr
    metrics: set[str] = set()
    for line in lines:
        row = orjson.loads(line)
        assert isinstance(row, dict) and set(row) == KEYS, line
        assert row["bench"] == bench, line
        assert isinstance(row["metric"], str) and isinstance(row["unit"], str), line
        value = row["value"]
        assert isinstance(value, int | float) and not isinstance(value, bool) and value > 0, line
        metrics.add(row["metric"])
    assert REQUIRED[bench] <= metrics, metrics


E2E_REQUIRED = {"cold_recovered_s", "cold_detect_s", "cold_restart_s", "cold_processes_restarted", "sdk_overhead_pct",
                "sdk_report_step_us", "memory_ckpt_stall_ratio_to_torch_save", "memory_restore_ratio_to_storage"}


def test_e2e_bench_quick_recovers_a_killed_rank_and_measures_the_sdk() -> None:
    """The stack's case, the SDK's overhead and the memory tier only: torchrun's and the standby's take a minute
    more each, and the end-to-end tests run those paths already."""
    done = subprocess.run([sys.executable, str(BENCH), "e2e", "--quick", "--only", "cold", "overhead", "memory"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    rows = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert all(isinstance(row, dict) and set(row) == KEYS and row["bench"] == "e2e" for row in rows), rows
    values = {row["metric"]: row["value"] for row in rows}
    assert set(values) >= E2E_REQUIRED, values
    assert values["cold_processes_restarted"] == 1, values
    assert 0 < values["cold_detect_s"] < values["cold_recovered_s"], values
    assert values["sdk_report_step_us"] > 0, values
    assert "warning: " not in done.stderr, done.stderr  # the memory tier: both tiers reported, no memory left

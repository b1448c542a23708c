"""The formation bench at --quick sizes: every simulated rank forms on both stores, and the figures are there (no
timing checks: the machine is shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench.py"


# One case: each run starts both servers, which import torch (half a minute on a loaded host). gloo's traffic (its
# address set, then every rank's wait, wait, get: 6 + 3 x world requests) is `--backend gloo`'s, run by hand.
@pytest.mark.parametrize(("backend", "ranks", "name", "requests"), [
    ("nccl", 256, "formation_256", 7),  # connect, init/, barrier's three, the roots' ids: wait and multi-get
])
def test_quick_formation_forms_every_rank_on_both_stores(backend: str, ranks: int, name: str,
                                                         requests: int) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "formation", "--quick", "--backend", backend, "--ranks",
                           str(ranks)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    values = {row["metric"]: row["value"] for row in map(orjson.loads, done.stdout.splitlines())}
    assert values[f"{name}_ranks_formed"] == ranks, done.stderr
    assert values[f"{name}_requests_per_rank"] == requests
    assert values[f"{name}_s"] > 0 and values[f"{name}_torch_store_s"] > 0
    assert values[f"{name}_ratio_to_torch_store"] > 0
    for phase in ("connect", "set", "get", "barrier"):
        assert 0 < values[f"{name}_{phase}_done_s"] <= values[f"{name}_s"]
        assert 0 < values[f"{name}_torch_store_{phase}_done_s"] <= values[f"{name}_torch_store_s"]

"""The GPU check where there is no GPU: the tests marked `gpu` are deselected and the summary says so, and
`tools/gpu_check.py run` without its wheels says how to get them instead of failing somewhere inside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e_support import environment

ROOT = Path(__file__).resolve().parents[1]


def _gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_gpu(), reason="checks the deselection where there is no GPU")
def test_tests_marked_gpu_are_deselected_without_a_gpu_and_the_summary_says_so() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment(), check=False)
    assert done.returncode == 5, done.stdout[-2000:]  # nothing ran: every test there is marked gpu
    # the suite's own line: pytest's "5 deselected" is a serial run's only (xdist's controller collects nothing)
    assert "5 test(s) marked gpu deselected: no GPU found" in done.stdout, done.stdout


def test_the_gpu_check_without_its_wheels_says_how_to_prepare_them(tmp_path: Path) -> None:
    code = ("import sys; out, wheels = sys.argv[1:]; sys.argv = ['gpu_check.py', 'run', '--out', out]; "
            "sys.path.insert(0, 'tools'); import gpu_check; from pathlib import Path; "
            "gpu_check.WHEELS = Path(wheels); gpu_check.main()")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out"), str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment(), check=False)
    assert done.returncode != 0
    assert "run `python tools/gpu_check.py prepare`" in done.stderr, done.stderr

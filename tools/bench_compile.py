"""Compiled code across a restart: a new process's time to its first compiled step (`tools/compile_probe.py`: a
small model under `torch.compile`, Inductor's C++ backend on this machine's compiler) with the job's compile caches
as the agent keeps them (`recovery/agent/compilecache.py`), against the same process with empty caches, alternating
in every repeat.

- `compile_cold_first_step_s`: a new process's first compiled step (the model made, compiled and stepped once), its
  caches empty (a job's first start, or a restart without the agent's per-job caches on a node whose /tmp was
  cleaned); the time from the process's start is printed beside it.
- `compile_restart_warm_ratio_to_cold`: the same process restarted on its node, with the caches the first one filled
  (the job's own directory, which outlives its ranks), against cold. Goal at most 0.2. The interpreter's start before
  it (torch's import) is what a warm standby pays ahead: `compile_restart_warm_total_ratio_to_cold` counts it too.
- `compile_spare_warm_ratio_to_cold`: the same process on a spare, whose caches the agent fetched from the job's
  shared copy (the node's, published after its first steps), against cold. Goal at most 0.3;
  `compile_spare_warm_total_ratio_to_cold` from the process's start.

    python tools/bench.py restart-cost [--repeat 3] [--width 256 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
from bench_harness import ROOT, Emit, environment, note

from recovery.agent.compilecache import CACHES, CompileCaches

PROBE = ROOT / "tools" / "compile_probe.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="rounds of cold, restarted and spare (medians)")
    parser.add_argument("--width", type=int, default=256, help="the probe model's width")
    parser.add_argument("--layers", type=int, default=4, help="the probe model's hidden layers")
    parser.add_argument("--quick", action="store_true", help="one round of a small model (the smoke test)")


def probe(cache: Path, out: Path, width: int, layers: int) -> dict[str, float]:
    env = {**environment(), **{var: str(cache / name) for var, name in CACHES.items()}, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(PROBE), "--out", str(out), "--width", str(width), "--layers", str(layers)],
                   env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    result: dict[str, float] = json.loads(out.read_text())
    return result


def once(workdir: Path, index: int, width: int, layers: int) -> dict[str, dict[str, float]]:
    """Cold, restarted on its node, and on a spare, the caches as the agents keep them."""
    shared = workdir / f"shared-{index}"
    node = CompileCaches(workdir / f"node-{index}", shared)
    spare = CompileCaches(workdir / f"spare-{index}", shared)
    cold = probe(node.job_dir("job"), workdir / f"cold-{index}.json", width, layers)
    restarted = probe(node.job_dir("job"), workdir / f"restarted-{index}.json", width, layers)
    anyio.run(node.publish, "job")
    anyio.run(spare.fetch, "job")
    moved = probe(spare.job_dir("job"), workdir / f"spare-{index}.json", width, layers)
    for name in (f"node-{index}", f"spare-{index}", f"shared-{index}"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    return {"cold": cold, "restarted": restarted, "spare": moved}


def measure(args: argparse.Namespace, emit: Emit) -> None:
    repeat, width, layers = (1, 64, 2) if args.quick else (args.repeat, args.width, args.layers)
    runs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as workdir:
        for index in range(repeat):
            runs.append(once(Path(workdir), index, width, layers))
            note(f"compile {index}: " + ", ".join(f"{case} {r['total_s']:.2f}s (hits {r['cache_hits']:g}, misses "
                                                  f"{r['cache_misses']:g})" for case, r in runs[-1].items()))
    for run in runs:
        for case in ("restarted", "spare"):
            if run[case]["cache_misses"]:
                raise RuntimeError(f"the {case} process compiled again: {run[case]}")
    def median(case: str, key: str) -> float:
        return round(statistics.median(r[case][key] for r in runs), 3)

    emit("restart-cost", "compile_cold_first_step_s", median("cold", "first_step_s"),
         f"s of a new process's first compiled step, empty caches ({layers} hidden layers of {width}); "
         f"{median('cold', 'total_s')} s from its start")
    for case, name, goal in (("restarted", "compile_restart_warm_ratio_to_cold", "0.2"),
                             ("spare", "compile_spare_warm_ratio_to_cold", "0.3")):
        emit("restart-cost", f"compile_{case}_first_step_s", median(case, "first_step_s"),
             f"s, the caches kept by the agent; {median(case, 'total_s')} s from the process's start")
        emit("restart-cost", name, round(statistics.median(r[case]["first_step_s"] / r["cold"]["first_step_s"]
                                                           for r in runs), 3),
             f"x the first compiled step (goal at most {goal}; the interpreter's start before it, torch's import, "
             f"is what a warm standby pays ahead)")
        emit("restart-cost", f"{name.removesuffix('_ratio_to_cold')}_total_ratio_to_cold",
             round(statistics.median(r[case]["total_s"] / r["cold"]["total_s"] for r in runs), 3),
             "x from the process's start, a cold interpreter both ways")


__all__ = ["add_arguments", "measure"]

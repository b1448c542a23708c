"""What running under `recovery-run` costs when nothing fails: the e2e bench's scripts run to their end without a
fault, under `recovery-run --standalone` (its default settings: warm standbys on) and under torchrun, back to back.

    python tools/bench_faultfree.py                 # 3 pairs of each script, medians
    python tools/bench_faultfree.py --repeat 5 --epochs 6

Two scripts, each on `--nproc` ranks of this host: the unmodified torchrun script `examples/ddp-tutorial/stock.py`
under both launchers, and the tutorial's SDK version `with_sdk.py` under `recovery-run` against its original
`original.py` under torchrun (the same training; the SDK's heartbeats and step reports are part of the cost).
`wall_s` is the launcher's wall time from its start to its exit (both exit 0, or the run is an error): start-up,
rendezvous, every epoch, the snapshots and the shutdown. Runs alternate launchers within each pair, and the figure
is the median of the per-pair ratios, so that a busy stretch of a shared host weighs on both sides of a pair.
`fault_free_ratio_to_torchrun` is the worse of the two scripts' medians (goal: at most 1.05).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_harness import Emit
from bench_harness_launch import TUTORIAL, launch

SCRIPTS = {"stock": ("stock.py", "stock.py"), "sdk": ("with_sdk.py", "original.py")}
"""script name -> (what recovery-run runs, what torchrun runs)"""


def run_once(launcher: str, script: str, workdir: Path, nproc: int, step_time: float, epochs: int) -> float:
    """The launcher's wall time running `script` to its end, no fault."""
    tag = f"{launcher}-{time.monotonic_ns()}"
    args = [str(TUTORIAL / script), "--epochs", str(epochs), "--samples", str(64 * nproc), "--step-time",
            str(step_time), "--snapshot", str(workdir / f"{tag}.pt")]
    command, env = launch(launcher, nproc, args, workdir / tag)
    log = workdir / f"{tag}.out"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the session is left (nothing, on a clean exit)
            proc.wait()
    wall = time.monotonic() - started
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{launcher} {script} exited {rc}:\n" + "\n".join(tail))
    return wall


def measure(repeat: int, workdir: Path, emit: Emit, quick: bool = False, nproc: int = 4, epochs: int | None = None,
            step_time: float = 0.1) -> float:
    """Every script's pairs (the launchers' order alternating), the medians, and the worse of the medians' ratios."""
    epochs = epochs if epochs is not None else (4 if quick else 8)  # as the stock bench trains
    worst = 0.0
    for name, (ours, theirs) in SCRIPTS.items():
        walls: dict[str, list[float]] = {"recovery-run": [], "torchrun": []}
        for index in range(repeat):
            order = [("recovery-run", ours), ("torchrun", theirs)]
            for launcher, script in order if index % 2 == 0 else order[::-1]:
                walls[launcher].append(run_once(launcher, script, workdir, nproc, step_time, epochs))
        for launcher, values in walls.items():
            emit("e2e", f"fault_free_{name}_{launcher.replace('-', '_')}_wall_s", round(statistics.median(values), 3),
                 f"s, {epochs} epochs of {TUTORIAL.name}/{ours if launcher == 'recovery-run' else theirs} on "
                 f"{nproc} ranks, no fault")
        ratio = statistics.median(a / b for a, b in zip(walls["recovery-run"], walls["torchrun"], strict=True))
        emit("e2e", f"fault_free_{name}_ratio_to_torchrun", round(ratio, 3), "x (wall time, median of pairs)")
        worst = max(worst, ratio)
    emit("e2e", "fault_free_ratio_to_torchrun", round(worst, 3),
         "x (the worse script's median; goal at most 1.05)")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--step-time", type=float, default=0.1)
    args = parser.parse_args()

    def emit(bench: str, metric: str, value: float, unit: str) -> None:
        print(f"{bench}.{metric} = {value} {unit}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-faultfree-") as workdir:
        measure(args.repeat, Path(workdir), emit, nproc=args.nproc, epochs=args.epochs, step_time=args.step_time)


if __name__ == "__main__":
    main()

"""Training frameworks under `recovery-run` against torchrun: a Lightning Trainer script and an Accelerate script
(examples/lightning/train.py, examples/accelerate/train.py, synthetic data), 4 ranks on this host.

    python tools/bench.py e2e --only frameworks            # 3 repeats of every case, medians
    python tools/bench.py e2e --only fsdp                  # the HSDP script (`measure_fsdp`), then bench_sharded.py
    python tools/bench_frameworks.py --repeat 5 --only frameworks
    python tools/bench_frameworks.py --only fsdp           # the HSDP script alone

What is measured, each run started alone (the host's two cores are shared by every rank):

- `lightning_rank_kill_ratio_to_torchrun`: rank 1 SIGKILLed once the job printed step `fault_at`; the time from the
  kill to the first step past the last one printed before it (Lightning prints a step after its optimizer step),
  with the integration (`RecoveryDDPStrategy`, a rank restarted alone) under `recovery-run`'s defaults, against
  the stock script (`strategy="ddp"`) under torchrun, which restarts every rank from `last.ckpt`. Median of the
  per-repeat ratios; goal at most 0.2.
- `accelerate_rank_kill_ratio_to_torchrun`: the same with the Accelerate script (`recovery.client.accelerate`
  against the stock script resuming from `accelerator.save_state` of its last epoch). Goal at most 0.2.
- `lightning_partial_sdk_ratio_to_stock`: the stock Lightning script with the SDK's step reports added (a Callback)
  against the same script without them, both under `recovery-run`. Goal at most 1.0: reports change no rung.
- `report_ttr_error_s`: `recovery-replay report`'s time to recovery of the integration's run minus the measured
  time from the kill to the first step past it, absolute, median. Goal at most 1 s.
- `lightning_sigint_checkpoint_written`: 1 when SIGINT to `recovery-run` (a terminal's Ctrl-C) gets the stock
  script's `OnExceptionCheckpoint` written, else 0.
- `lightning_fault_free_ratio_to_torchrun`: the stock Lightning script to its end, no fault, `recovery-run`'s
  defaults (warm standbys on) against torchrun, in alternating pairs; median of the pairs' ratios. Goal at most
  1.05.

- `stock_fsdp_ratio_to_torchrun` (`--only fsdp`): the HSDP script without the SDK (a stock FSDP2 script, which
  resumes every rank from its last epoch's DCP checkpoint, resharded on load) under `recovery-run` against the same
  script under torchrun, rank 1 SIGKILLed at the same step. Goal at most 0.5.

The standbys' readiness is waited for before a kill (they start with the agent, and a job that trained
`fault_at` steps has them ready on a quiet host); the kill then lands at any step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import ROOT, Emit
from bench_harness_launch import HSDP, Run, kill_once, script_args

LIGHTNING = ROOT / "examples" / "lightning" / "train.py"
ACCELERATE = ROOT / "examples" / "accelerate" / "train.py"


def report_ttr(data: Path) -> float | None:
    """The report's time to recovery of the run's one incident."""
    report = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "report", str(data), "--json"],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    if report.returncode != 0:
        return None
    incidents = [i for job in json.loads(report.stdout)["jobs"] for i in job["incidents"]]
    return incidents[0].get("ttr_s") if len(incidents) == 1 else None


def sigint_checkpoint(workdir: Path) -> int:
    tag = "sigint"
    run = Run("recovery-run", script_args(LIGHTNING, workdir, tag, epochs=50), workdir, tag)
    try:
        run.wait_for(lambda: any(step >= 6 for _, step in run.steps()), "step 6")
        run.proc.send_signal(signal.SIGINT)
        run.wait_for(lambda: run.proc.poll() is not None, "recovery-run's end", timeout=120)
    finally:
        run.stop()
    return int((workdir / f"{tag}-checkpoints" / "on_exception.ckpt").exists())


def fault_free_wall(launcher: str, workdir: Path, tag: str) -> float:
    run = Run(launcher, script_args(LIGHTNING, workdir, tag, epochs=4), workdir, tag)
    try:
        run.wait_for(lambda: any(line.startswith(b"`Trainer.fit` stopped") or b"]: `Trainer.fit` stopped" in line
                                 for _, line in list(run.lines)) or run.proc.poll() is not None, "the run's end",
                     timeout=600)
        run.proc.wait(timeout=600)
        ended = time.monotonic()  # the launcher's exit (polled every 10 ms): start-up to shutdown, as a user waits
        if run.proc.returncode != 0:
            raise RuntimeError(f"{launcher} exited {run.proc.returncode}")
        return ended - run.started
    finally:
        run.stop()


def measure(repeat: int, workdir: Path, emit: Emit, quick: bool = False) -> None:
    fault_at = 12 if quick else 20
    runs: dict[str, list[float]] = {name: [] for name in (
        "lightning", "lightning_torchrun", "accelerate", "accelerate_torchrun", "stock", "partial")}
    errors: list[float] = []
    for index in range(repeat):
        cases: list[tuple[str, str, list[str]]] = [
            ("lightning", "recovery-run", ["--strategy", "recovery"]),
            ("lightning_torchrun", "torchrun", ["--strategy", "ddp"]),
            ("accelerate", "recovery-run", ["--recovery"]),
            ("accelerate_torchrun", "torchrun", []),
            ("stock", "recovery-run", ["--strategy", "ddp"]),
            ("partial", "recovery-run", ["--strategy", "ddp", "--report-steps"]),
        ]
        for name, launcher, extra in cases:
            tag = f"{name}-{index}"
            script = ACCELERATE if name.startswith("accelerate") else LIGHTNING
            seconds, data = kill_once(launcher, script_args(script, workdir, tag, *extra), workdir, tag, fault_at)
            runs[name].append(seconds)
            print(f"{tag}: a step past the kill {seconds:.2f}s after it", file=sys.stderr, flush=True)
            if name == "lightning" and (ttr := report_ttr(data)) is not None:
                errors.append(abs(ttr - seconds))
    walls: dict[str, list[float]] = {"recovery-run": [], "torchrun": []}
    for index in range(repeat):
        order = ["recovery-run", "torchrun"]
        for launcher in order if index % 2 == 0 else order[::-1]:
            walls[launcher].append(fault_free_wall(launcher, workdir, f"faultfree-{launcher}-{index}"))

    def ratio(ours: str, theirs: str) -> float:
        return round(statistics.median(a / b for a, b in zip(runs[ours], runs[theirs], strict=True)), 3)

    for name, values in runs.items():
        emit("e2e", f"frameworks_{name}_regained_s", round(statistics.median(values), 3),
             "s from rank 1's SIGKILL to a step past it")
    emit("e2e", "lightning_rank_kill_ratio_to_torchrun", ratio("lightning", "lightning_torchrun"),
         "x (RecoveryDDPStrategy under recovery-run against the stock script under torchrun; goal at most 0.2)")
    emit("e2e", "accelerate_rank_kill_ratio_to_torchrun", ratio("accelerate", "accelerate_torchrun"),
         "x (recovery.client.accelerate under recovery-run against the stock script under torchrun; goal <= 0.2)")
    emit("e2e", "lightning_partial_sdk_ratio_to_stock", ratio("partial", "stock"),
         "x (step reports alone against the same script without them, both under recovery-run; goal at most 1.0)")
    emit("e2e", "report_ttr_error_s", round(statistics.median(errors), 3) if errors else float("nan"),
         "s (|the report's time to recovery - the measured kill to a step past it|; goal at most 1)")
    emit("e2e", "lightning_sigint_checkpoint_written", sigint_checkpoint(workdir),
         "(1: Ctrl-C to recovery-run got Lightning's exception checkpoint written)")
    emit("e2e", "lightning_fault_free_ratio_to_torchrun",
         round(statistics.median(a / b for a, b in zip(walls["recovery-run"], walls["torchrun"], strict=True)), 3),
         "x (the stock Lightning script to its last step, no fault, median of pairs; goal at most 1.05)")


def measure_fsdp(repeat: int, workdir: Path, emit: Emit, quick: bool = False) -> None:
    """`python tools/bench.py e2e --only fsdp`: the HSDP script (examples/fsdp/train.py, a 2 x 2 mesh) with
    `recovery.client.fsdp` under `recovery-run` against the stock script under torchrun (every rank restarted, from
    the last epoch's DCP checkpoint); the restarted processes counted, and the final parameters against a
    fault-free run of the same script; and the stock script under `recovery-run` (`stock_fsdp_ratio_to_torchrun`:
    every rank restarted too, from warm standbys)."""
    import torch

    fault_at = 12 if quick else 20
    ours: list[float] = []
    theirs: list[float] = []
    stock: list[float] = []
    restarted: list[int] = []
    equal: list[int] = []
    reference = workdir / "hsdp-reference.pt"
    run = Run("recovery-run", [*script_args(HSDP, workdir, "hsdp-reference"), "--recovery", "--out", str(reference)],
              workdir, "hsdp-reference")
    try:
        run.wait_for(lambda: run.proc.poll() is not None, "the fault-free run's end", timeout=600)
    finally:
        run.stop()
    for index in range(repeat):
        tag = f"hsdp-{index}"
        out = workdir / f"{tag}.pt"
        seconds, data = kill_once("recovery-run", [*script_args(HSDP, workdir, tag), "--recovery", "--out", str(out)],
                                  workdir, tag, fault_at)
        ours.append(seconds)
        restarted.append(sum(1 for log in data.glob("agents/*/*.rank*.gen*.log") if ".gen0." not in log.name))
        full, fault_free = torch.load(out), torch.load(reference)
        equal.append(int(full.keys() == fault_free.keys() and all(torch.equal(full[k], fault_free[k]) for k in full)))
        tag = f"hsdp_torchrun-{index}"
        theirs.append(kill_once("torchrun", script_args(HSDP, workdir, tag), workdir, tag, fault_at)[0])
        # the stock script (no SDK: every rank restarts and reshards the last DCP checkpoint) under recovery-run
        tag = f"hsdp_stock-{index}"
        stock.append(kill_once("recovery-run", script_args(HSDP, workdir, tag), workdir, tag, fault_at)[0])
        print(f"hsdp {index}: {ours[-1]:.2f}s ({restarted[-1]} restarted, equal {equal[-1]}), stock "
              f"{stock[-1]:.2f}s, torchrun {theirs[-1]:.2f}s", file=sys.stderr, flush=True)
    emit("e2e", "hsdp_regained_s", round(statistics.median(ours), 3), "s from rank 1's SIGKILL to a step past it")
    emit("e2e", "hsdp_torchrun_regained_s", round(statistics.median(theirs), 3), "s, the stock script under torchrun")
    emit("e2e", "hsdp_rank_kill_ratio_to_torchrun",
         round(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)), 3), "x (goal at most 0.2)")
    emit("e2e", "hsdp_processes_restarted", max(restarted), "processes (the most in a run; goal 1)")
    emit("e2e", "hsdp_equal_to_fault_free", min(equal), "(1: every run ended bit for bit as the fault-free one)")
    emit("e2e", "stock_fsdp_regained_s", round(statistics.median(stock), 3),
         "s, the stock script (no SDK) under recovery-run: every rank restarted from its DCP checkpoint")
    emit("e2e", "stock_fsdp_ratio_to_torchrun",
         round(statistics.median(a / b for a, b in zip(stock, theirs, strict=True)), 3), "x (goal at most 0.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", choices=("frameworks", "fsdp"), default=["frameworks", "fsdp"])
    args = parser.parse_args()

    def emit(bench: str, metric: str, value: float, unit: str) -> None:
        print(f"{bench}.{metric} = {value} {unit}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as workdir:
        if "frameworks" in args.only:
            measure(args.repeat, Path(workdir), emit, quick=args.quick)
        if "fsdp" in args.only:
            measure_fsdp(args.repeat, Path(workdir), emit, quick=args.quick)


if __name__ == "__main__":
    main()

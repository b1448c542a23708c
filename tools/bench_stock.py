"""A stock torchrun script's recovery from a rank's SIGKILL, under `recovery-run` and under torchrun.

    python tools/bench_stock.py                 # 3 repeats of each, medians
    python tools/bench_stock.py --repeat 5 --nproc 4
    python tools/bench_stock.py --job-level     # recovery-run restarts the job whole at once, as torchrun does

The script is `examples/ddp-tutorial/stock.py` (DDP, gloo, rank 0's snapshot every epoch, nothing of `recovery`),
`--nproc` ranks on this host: `recovery-run --standalone --nproc-per-node N --max-restarts 3` and `torchrun
--standalone --nproc-per-node N --max-restarts 3` with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (without which
torchrun cannot restart a gloo job, pytorch/pytorch#135712). Once the job has printed step `--fault-at`, rank 1 is
SIGKILLed; `regained_s` is the time from the kill until a process started after it (one that printed `Resuming
training from snapshot`) prints a step past the last one printed before the kill: the restart, the imports, the
rendezvous, the snapshot's load and the steps recomputed since it. Both launchers run the same command line; every
process started is stopped by its session when a run ends, however it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench_harness import Emit, sigterm_unwinds
from bench_harness_launch import STEP, TUTORIAL, launch, rank_pid, standbys_ready

STOCK = TUTORIAL / "stock.py"
EPOCH_STEPS = re.compile(rb"\| Steps: (\d+)")

JOB_LEVEL_SPEC = """{"policies": {"rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
    {"granularity": "restart_job", "budget": 3, "deadline_s": 900.0}]}}}}}"""
"""`--job-level`: a process fault restarts the job at once, as torchrun does (a stock script's survivors cannot
re-form their process group, so restarting the dead rank alone cannot work for it)"""


def run_once(launcher: str, workdir: Path, nproc: int, fault_at: int, step_time: float, epochs: int,
             job_level: bool = False, standby: str | None = "0") -> float:
    snapshot = workdir / f"{launcher}-{time.monotonic_ns()}.pt"
    script = [str(STOCK), "--epochs", str(epochs), "--samples", str(64 * nproc), "--step-time", str(step_time),
              "--snapshot", str(snapshot)]
    # `standby`, the job's RECOVERY_STANDBY: "all", a standby interpreter per rank, torch imported, that a restarted
    # rank is handed to, and the kill waits for them; "0", none; None, the agents' default (a standby for each rank
    # of a job whose faults restart every rank, once its ranks stepped), the kill not waiting for them
    warm = standby == "all"
    options = [] if standby is None else ["--env", f"RECOVERY_STANDBY={standby}"]
    if job_level:
        spec = workdir / "job-level.json"
        spec.write_text(JOB_LEVEL_SPEC)
        options += ["--spec", str(spec)]
    command, env = launch(launcher, nproc, script, workdir / snapshot.stem, *options)
    lines: list[tuple[float, bytes]] = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(int(m.group(1)) >= fault_at for _, line in list(lines) if (m := STEP.search(line))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher} did not reach step {fault_at}:\n"
                                   + b"".join(line for _, line in lines[-30:]).decode(errors="replace"))
            time.sleep(0.005)  # polling the output, within the deadline
        if warm:
            while standbys_ready(workdir / snapshot.stem) < nproc:  # strike once they can take the ranks
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the standbys of {snapshot.stem} were not ready in time")
                time.sleep(0.05)  # polling the standbys' output, within the deadline
            # Strike at the same place within an epoch as the cold runs do, so that the steps redone from the
            # epoch's snapshot are as many.
            per_epoch = int(next(m.group(1) for _, line in list(lines) if (m := EPOCH_STEPS.search(line))))
            done = max(int(m.group(1)) for _, line in list(lines) if (m := STEP.search(line)))
            target = done + 1 + (fault_at - done - 1) % per_epoch
            while not any(int(m.group(1)) >= target for _, line in list(lines) if (m := STEP.search(line))):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{launcher} did not reach step {target}")
                time.sleep(0.005)  # polling the output, within the deadline
        victim = rank_pid(str(snapshot), 1, workdir / snapshot.stem)
        assert victim is not None, "rank 1 not found"
        seen = [int(m.group(1)) for _, line in list(lines) if (m := STEP.search(line))]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while True:
            after = [(t, line) for t, line in list(lines) if t >= killed]
            resumed = [t for t, line in after if b"Resuming training from snapshot" in line]
            if resumed:
                regained = [t for t, line in after if t >= resumed[0] and (m := STEP.search(line))
                            and int(m.group(1)) > max(seen)]
                if regained:
                    return regained[0] - killed
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher} did not regain step {max(seen)}:\n"
                                   + b"".join(line for _, line in lines[-40:]).decode(errors="replace"))
            time.sleep(0.005)  # polling the output, within the deadline
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # recovery-run stops what it started; torchrun its workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftover = rank_pid(str(snapshot), 0) or rank_pid(str(snapshot), 1)
        if leftover is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leftover, signal.SIGKILL)


def measure(repeat: int, workdir: Path, emit: Emit, quick: bool = False, nproc: int = 4) -> None:
    """The `stock` case of `python tools/bench.py e2e`: recovery-run as the agents come (`default`), without standbys
    (`cold`), with warm standbys the kill waits for (`warm`), and torchrun, on the same kill, back to back in every
    repeat; then the same kill right after the first snapshot (`early`, by default, against torchrun's); the
    medians, and the medians of the per-repeat ratios to torchrun."""
    fault_at, epochs = (12, 4) if quick else (20, 8)
    early_at = 5  # the second epoch's first step: the first snapshot (after 4 steps) is the only one to resume from
    runs: dict[str, list[float]] = {"default": [], "cold": [], "warm": [], "torchrun": [], "early": [],
                                    "early_torchrun": []}
    standbys = {"default": None, "cold": "0", "warm": "all", "early": None}
    for _ in range(repeat):
        for case in runs:
            launcher = "torchrun" if case.endswith("torchrun") else "recovery-run"
            at = early_at if case.startswith("early") else fault_at
            # A warm run trains longer: its standbys (a torch import each, under contention) are ready after the
            # job's first epochs, and the kill waits for them.
            runs[case].append(run_once(launcher, workdir, nproc, at, 0.1, epochs * 8 if case == "warm" else epochs,
                                       standby=standbys.get(case, "0")))
    for case, values in runs.items():
        emit("e2e", f"stock_{case}_regained_s", round(statistics.median(values), 3),
             "s from a rank's SIGKILL to a step past it, a stock torchrun script (examples/ddp-tutorial/stock.py)")
    goals = {"default": ("stock_ratio_to_torchrun", "goal at most 0.2"),
             "cold": ("stock_cold_ratio_to_torchrun", "no standby: goal 1.0"),
             "warm": ("stock_warm_ratio_to_torchrun", "the kill waits for the standbys"),
             "early": ("stock_early_kill_ratio_to_torchrun", "a kill at step 5, right after the first snapshot, "
                                                             "the standbys not waited for: goal at most 0.5")}
    for case, (name, goal) in goals.items():
        theirs = runs["early_torchrun" if case == "early" else "torchrun"]
        ratios = [ours / other for ours, other in zip(runs[case], theirs, strict=True)]
        emit("e2e", name, round(statistics.median(ratios), 3), f"x (lower is faster; {goal})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--fault-at", type=int, default=20, help="the step after which rank 1 is killed")
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=["recovery-run", "torchrun"])
    parser.add_argument("--standby", choices=("default", "0", "all"), default="0",
                        help="the job's RECOVERY_STANDBY under recovery-run: default (the agents' own choice), 0 "
                             "(none) or all (one per rank, the kill waiting for them)")
    parser.add_argument("--job-level", action="store_true",
                        help="recovery-run's job restarts whole at the first fault (the spec's ladder), without "
                             "trying the dead rank alone first")
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in args.only}
    standby = None if args.standby == "default" else args.standby
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bench-stock-") as workdir:
        for repeat in range(args.repeat):
            for name in args.only:
                seconds = run_once(name, Path(workdir), args.nproc, args.fault_at, args.step_time,
                                   args.epochs * 8 if standby == "all" else args.epochs, args.job_level, standby)
                results[name].append(seconds)
                print(f"repeat {repeat}: {name} regained the step {seconds:.2f}s after the SIGKILL", flush=True)
    for name, values in results.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name}: median {statistics.median(values):.2f}s over {len(values)} ({each})")


if __name__ == "__main__":
    main()

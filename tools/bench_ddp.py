"""The tutorial DDP script converted to the SDK (`examples/ddp-tutorial/with_sdk.py`) under `recovery-run`, against
the original script (`original.py`) under torchrun, on the same kill.

    python tools/bench_ddp.py                   # 3 repeats, medians
    python tools/bench_ddp.py --repeat 5 --nproc 4

`--nproc` ranks on this host: `recovery-run --standalone --nproc-per-node N --max-restarts 3 with_sdk.py` and
`torchrun --standalone --nproc-per-node N --max-restarts 3 original.py` with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
(without which torchrun cannot restart a gloo job, pytorch/pytorch#135712), the same arguments. Once the job has
printed step `--fault-at`, rank 1 is SIGKILLed (and rank 2 with it, for the double fault); `regained_s` is the time
from the kill until any rank prints a step two past the last one printed before it (past the step in flight, which
the survivors may complete without the dead rank: the restart, the rendezvous, the state's transfer or the
snapshot's load, the steps recomputed, and one step). `processes_restarted` counts the rank processes seen running
(polled every 20 ms) between the kill and then that were not running before it. with_sdk.py's process group has
a 60 s timeout: a survivor freed only by that timeout would show here. Every process started is stopped by its
session when a run ends, however it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench_harness import Emit
from bench_harness_launch import STEP, TUTORIAL, launch, rank_pids, standbys_ready

from recovery.agent.standby import DEFAULT_PER_NODE


@dataclass(frozen=True)
class Run:
    regained_s: float
    processes_restarted: int


def recorded_pids(data_dir: Path) -> dict[int, int]:
    """pid -> rank of the rank processes recovery-run's agents recorded under `data_dir` (a rank handed to a warm
    standby runs in the standby's interpreter, whose command line and environment are not the script's)."""
    found: dict[int, int] = {}
    for record in data_dir.glob("agents/*/*.rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            found[int(json.loads(record.read_text())["pid"])] = int(record.stem.rpartition(".rank")[2])
    return found


def run_once(launcher: str, workdir: Path, nproc: int, fault_at: int, step_time: float, epochs: int,
             victims: tuple[int, ...], standby: str | None = None) -> Run:
    """One run; `standby`: the job's RECOVERY_STANDBY (None: the agent's default, two warm standbys per node; "0":
    cold, a new interpreter for every restarted rank). Unless cold, the fault waits for a standby per victim (at
    most two per node by default)."""
    snapshot = workdir / f"{launcher}-{time.monotonic_ns()}.pt"
    script = TUTORIAL / ("original.py" if launcher == "torchrun" else "with_sdk.py")
    args = [str(script), "--epochs", str(epochs), "--samples", str(64 * nproc), "--step-time", str(step_time),
            "--snapshot", str(snapshot)]
    command, env = launch(launcher, nproc, args, workdir / snapshot.stem,
                          *(["--env", f"RECOVERY_STANDBY={standby}"] if standby is not None else []))
    warm = launcher != "torchrun" and standby != "0"
    ready_for = len(victims) if standby not in (None, "0") else min(len(victims), DEFAULT_PER_NODE)
    lines: list[tuple[float, bytes]] = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in stdout), daemon=True).start()

    def tail() -> str:
        return b"".join(line for _, line in lines[-40:]).decode(errors="replace")

    try:
        deadline = time.monotonic() + 300
        while not any(int(m.group(1)) >= fault_at for _, line in list(lines) if (m := STEP.search(line))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher} did not reach step {fault_at}:\n{tail()}")
            time.sleep(0.005)  # polling the output, within the deadline
        data_dir = workdir / snapshot.stem

        def pids() -> dict[int, int]:
            return rank_pids(str(snapshot)) if launcher == "torchrun" else recorded_pids(data_dir)

        while warm and standbys_ready(data_dir) < ready_for:  # strike once they can take the victims' ranks
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the standbys of {snapshot.stem} were not ready in time:\n{tail()}")
            time.sleep(0.05)  # polling the standbys' output, within the deadline
        before = pids()
        seen = max(int(m.group(1)) for _, line in list(lines) if (m := STEP.search(line)))
        killed = time.monotonic()
        for pid, rank in before.items():
            if rank in victims:
                os.kill(pid, signal.SIGKILL)
        started: set[int] = set()  # every rank process seen after the kill that was not running before it
        while True:
            started |= set(pids()) - set(before)
            # past the step in flight at the kill, which the survivors may complete without the dead rank
            regained = [t for t, line in list(lines) if t >= killed and (m := STEP.search(line))
                        and int(m.group(1)) > seen + 1]
            if regained:
                return Run(regained[0] - killed, len(started))
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher} did not regain step {seen}:\n{tail()}")
            time.sleep(0.02)  # polling the output and /proc, within the deadline
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # recovery-run stops what it started; torchrun its workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in rank_pids(str(snapshot)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def measure(repeat: int, workdir: Path, emit: Emit, quick: bool = False, nproc: int = 4) -> None:
    """The `ddp` case of `python tools/bench.py e2e`: with_sdk.py under recovery-run and original.py under torchrun
    on the same single kill, back to back in every repeat, then with_sdk.py with two ranks killed together."""
    fault_at, epochs = (12, 4) if quick else (20, 8)
    runs: dict[str, list[Run]] = {"sdk": [], "cold": [], "torchrun": [], "double": [], "torchrun_double": []}
    for _ in range(repeat):
        # as recovery-run starts it: the agent keeps warm standbys (torch imported) the killed ranks are handed to;
        # the job trains longer, as its standby is ready only after the first epochs
        runs["sdk"].append(run_once("recovery-run", workdir, nproc, fault_at, 0.1, epochs * 8, (1,)))
        runs["cold"].append(run_once("recovery-run", workdir, nproc, fault_at, 0.1, epochs, (1,), standby="0"))
        runs["torchrun"].append(run_once("torchrun", workdir, nproc, fault_at, 0.1, epochs, (1,)))
        runs["double"].append(run_once("recovery-run", workdir, nproc, fault_at, 0.1, epochs * 8, (1, 2)))
        runs["torchrun_double"].append(run_once("torchrun", workdir, nproc, fault_at, 0.1, epochs, (1, 2)))
    note = "s from a rank's SIGKILL to a step past it, the tutorial DDP script"
    emit("e2e", "ddp_sdk_regained_s", round(statistics.median(r.regained_s for r in runs["sdk"]), 3),
         f"{note} with the SDK (examples/ddp-tutorial/with_sdk.py, group timeout 60 s) under recovery-run as it "
         f"starts: two warm standbys per node")
    emit("e2e", "ddp_torchrun_regained_s", round(statistics.median(r.regained_s for r in runs["torchrun"]), 3),
         f"{note} under torchrun (original.py)")
    ratios = [ours.regained_s / theirs.regained_s for ours, theirs in zip(runs["sdk"], runs["torchrun"], strict=True)]
    emit("e2e", "ddp_sdk_ratio_to_torchrun", round(statistics.median(ratios), 3), "x (lower is faster; goal 0.2)")
    emit("e2e", "ddp_sdk_processes_restarted", statistics.median(r.processes_restarted for r in runs["sdk"]),
         "processes per fault (goal 1)")
    emit("e2e", "ddp_sdk_cold_regained_s", round(statistics.median(r.regained_s for r in runs["cold"]), 3),
         f"{note} with the SDK and no standby (RECOVERY_STANDBY=0): a new interpreter imports torch")
    cold = [ours.regained_s / theirs.regained_s for ours, theirs in zip(runs["cold"], runs["torchrun"], strict=True)]
    emit("e2e", "ddp_sdk_cold_ratio_to_torchrun", round(statistics.median(cold), 3), "x (lower is faster)")
    emit("e2e", "ddp_double_fault_regained_s", round(statistics.median(r.regained_s for r in runs["double"]), 3),
         "s from two ranks' SIGKILL to a step past it, with the SDK (each handed to one of the node's two standbys)")
    emit("e2e", "ddp_torchrun_double_fault_regained_s",
         round(statistics.median(r.regained_s for r in runs["torchrun_double"]), 3),
         "s from two ranks' SIGKILL to a step past it, under torchrun (original.py)")
    double = [ours.regained_s / theirs.regained_s
              for ours, theirs in zip(runs["double"], runs["torchrun_double"], strict=True)]
    emit("e2e", "ddp_double_fault_ratio_to_torchrun", round(statistics.median(double), 3),
         "x (lower is faster; goal 0.2)")
    emit("e2e", "ddp_double_fault_processes_restarted",
         statistics.median(r.processes_restarted for r in runs["double"]), "processes (goal 2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a shorter job")
    args = parser.parse_args()

    def emit(bench: str, metric: str, value: float, unit: str) -> None:
        print(f"{metric} = {value} {unit}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as workdir:
        measure(args.repeat, Path(workdir), emit, args.quick, args.nproc)


if __name__ == "__main__":
    main()

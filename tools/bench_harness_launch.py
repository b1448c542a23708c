"""Launching a training script on this host's ranks under `recovery-run --standalone` or torchrun, finding its rank
processes and timing its steps as it prints them: the harness of the benches that run real training jobs (`stock`,
`ddp`, `faultfree`, `frameworks`, `fsdp` of `python tools/bench.py e2e`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_harness import ROOT

TUTORIAL = ROOT / "examples" / "ddp-tutorial"
HSDP = ROOT / "examples" / "fsdp" / "train.py"
STEP = re.compile(rb"\] step (\d+)")
"""a step as the tutorial's scripts print it"""
TRAINED_STEP = re.compile(rb"trained step (\d+)")
"""a step as the frameworks' and the FSDP scripts print it"""
NPROC = 4
"""a `Run`'s ranks unless told otherwise"""


def launch(launcher: str, nproc: int, script: list[str], data_dir: Path, *options: str) -> tuple[list[str],
                                                                                          dict[str, str]]:
    """The command line and environment that start `script` on `nproc` ranks of this host under `launcher`
    (torchrun, or recovery-run with `options` and its data in `data_dir`), as the e2e benches run both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", "3", *script], env
    return [sys.executable, "-m", "recovery.cli.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "3", "--data-dir", str(data_dir), *options, *script], env


def rank_pids(marker: str) -> dict[int, int]:
    """pid -> rank of the rank processes whose command line holds `marker` (the run's own snapshot path)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "cmdline").read_bytes():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
        if ranks:
            found[int(entry.name)] = ranks[0]
    return found


def rank_pid(marker: str, rank: int, data_dir: Path | None = None) -> int | None:
    """The process of `rank`: as recovery-run's agents recorded it under `data_dir` (a rank handed to a standby runs
    in the standby's interpreter, whose command line is not the script's), else the one whose command line holds
    `marker` (the run's own snapshot path)."""
    for record in sorted(data_dir.glob(f"agents/*/*.rank{rank}.json")) if data_dir is not None else ():
        with contextlib.suppress(OSError, ValueError, KeyError):
            return int(json.loads(record.read_text())["pid"])
    return next((pid for pid, of in rank_pids(marker).items() if of == rank), None)


def standbys_ready(data_dir: Path, pattern: str = "agents/*/*.standby*.log") -> int:
    """How many standbys of the standalone run have said they are ready: each writes `ready <seconds>` to its
    parent's output (one log per job's standby parent on a node; the agents log at WARNING there)."""
    return sum(1 for log in data_dir.glob(pattern)
               for line in log.read_text(errors="replace").splitlines() if line.startswith("ready "))


class Run:
    """One launcher's run of a script, its output lines timed as they come."""

    def __init__(self, launcher: str, script: list[str], workdir: Path, tag: str, *options: str,
                 nproc: int = NPROC) -> None:
        self.data = workdir / tag
        command, env = launch(launcher, nproc, script, self.data, *options)
        env["OMP_NUM_THREADS"] = "1"
        self.lines: list[tuple[float, bytes]] = []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.marker = tag
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def steps(self, since: float = 0.0, prefix: bytes = b"") -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in list(self.lines)
                if t >= since and line.startswith(prefix) and (m := TRAINED_STEP.search(line))]

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = b"".join(line for _, line in self.lines[-40:]).decode(errors="replace")
                raise RuntimeError(f"{what}: not seen\n{tail}")
            time.sleep(0.01)  # polling the output, within the deadline

    def stop(self) -> int:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # recovery-run stops what it started; torchrun its workers
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            for rank in range(NPROC):  # a rank left behind by a failed stop
                if (pid := rank_pid(self.marker, rank)) is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def script_args(script: Path, workdir: Path, tag: str, *extra: str, epochs: int = 3) -> list[str]:
    args = [str(script), "--epochs", str(epochs), "--samples", "1024", "--step-time", "0.1", *extra]
    return [*args, "--checkpoints", str(workdir / f"{tag}-checkpoints")]


def kill_once(launcher: str, script: list[str], workdir: Path, tag: str, fault_at: int,
              *options: str, victims: tuple[int, ...] = (1,)) -> tuple[float, Path]:
    """Seconds from the SIGKILL of `victims` (rank 1; once step `fault_at` was printed, and any standbys ready) to
    the first step printed past the last one printed before it; and the run's data directory."""
    run = Run(launcher, script, workdir, tag, *options)
    try:
        run.wait_for(lambda: any(step >= fault_at for _, step in run.steps()), f"step {fault_at}")
        if launcher == "recovery-run":
            run.wait_for(lambda: standbys_ready(run.data) >= len(victims), "ready standbys")
        pids = [rank_pid(tag, victim, run.data if launcher == "recovery-run" else None) for victim in victims]
        assert None not in pids, f"ranks {victims} not all found: {pids}"
        seen = max(step for _, step in run.steps())
        killed = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
        # The replacement's step: recovery-run prefixes a restarted rank's lines with its generation; torchrun
        # restarts every rank, whose first lines come seconds later (a survivor prints at most the step it was in).
        prefix = f"[rank{victims[0]}.".encode()
        prefix, since = (prefix, killed) if launcher == "recovery-run" else (b"", killed + 1.0)
        run.wait_for(lambda: any(step > seen for _, step in run.steps(since, prefix)), f"a step past {seen}")
        regained = min(t for t, step in run.steps(since, prefix) if step > seen) - killed
        run.wait_for(lambda: run.proc.poll() is not None, "the run's end", timeout=600)
        return regained, run.data
    finally:
        run.stop()

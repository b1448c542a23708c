"""The SDK's overhead in a training loop, for `python tools/bench.py e2e --only overhead`: see `bench_e2e.py`."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_harness import Emit, note, sig


# -- the SDK's overhead ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Overhead:
    loop_pct: float  # the loop with the SDK against without it, median of paired blocks
    direct_pct: float  # what the SDK's own calls cost per step: report_step, and a heartbeat a second
    report_step_us: float
    step_s: float


def sdk_overhead(pairs: int, workdir: Path, env: dict[str, str]) -> Overhead:
    """The SDK's cost in a loop of ~100 ms steps of single-threaded torch matmuls, in CPU time of this process
    (its heartbeat thread included, other processes' load not): `pairs` pairs of ten-step blocks, one with a
    client connected (heartbeats every second, `report_step` every step) and one without, in alternating order;
    the median of the pairs' ratios. And directly: the time of one `report_step` (a heartbeat is the same send)."""
    import torch

    import recovery.client as sdk

    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    reps = 10
    for _ in range(5):  # a step of about 100 ms of CPU, by successive corrections (the first runs are slower)
        started = time.process_time()
        matmuls(reps)
        reps = max(1, round(reps * 0.1 / max(time.process_time() - started, 1e-4)))
    path = workdir / "overhead.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    # The agent's end in a process of its own: a reader that only drains, so it costs the loop nothing.
    drain = subprocess.Popen([sys.executable, "-c", _DRAIN], stdin=subprocess.DEVNULL, pass_fds=(listener.fileno(),),
                             env={**env, "DRAIN_FD": str(listener.fileno())}, start_new_session=True)
    listener.close()

    def block(with_sdk: bool) -> float:
        client = sdk.Client(str(path), rank=0, heartbeat_s=1.0) if with_sdk else None
        started = time.process_time()
        for step in range(10):
            matmuls(reps)
            if client is not None:
                client.report_step(step)
        spent = (time.process_time() - started) / 10
        if client is not None:
            client.close()
        return spent

    try:
        ratios: list[float] = []
        steps: list[float] = []
        for pair in range(pairs):
            if pair % 2 == 0:
                with_, without = block(True), block(False)
            else:
                without, with_ = block(False), block(True)
            ratios.append(with_ / without)
            steps.append(without)
        client = sdk.Client(str(path), rank=0, heartbeat_s=1.0)
        calls = 20_000
        started = time.perf_counter()
        for i in range(calls):
            client.report_step(i)
        report_s = (time.perf_counter() - started) / calls
        client.close()
    finally:
        drain.kill()
        drain.wait(timeout=30)
    step_s = statistics.median(steps)
    note(f"SDK overhead: per-pair ratios (with/without) {[round(r, 4) for r in ratios]}; step {step_s * 1000:.1f} ms")
    return Overhead(100 * (statistics.median(ratios) - 1), 100 * report_s * (1 + step_s / 1.0) / step_s,
                    report_s * 1e6, step_s)


def report(emit: Emit, overhead: Overhead) -> None:
    step_ms = f"{overhead.step_s * 1000:.0f} ms"
    emit("e2e", "sdk_overhead_pct", sig(overhead.loop_pct, 3),
         f"% of a {step_ms} step (CPU time, paired blocks with and without; heartbeats every 1 s, report_step "
         "every step)")
    emit("e2e", "sdk_cost_pct", sig(overhead.direct_pct, 3),
         f"% of a {step_ms} step (one report_step per step and one heartbeat a second, timed directly)")
    emit("e2e", "sdk_report_step_us", sig(overhead.report_step_us, 3), "us per report_step")


_DRAIN = """
import os, selectors, socket
listener = socket.socket(fileno=int(os.environ["DRAIN_FD"]))
sel = selectors.DefaultSelector()
sel.register(listener, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is listener:
            conn, _ = listener.accept()
            sel.register(conn, selectors.EVENT_READ)
        elif not key.fileobj.recv(1 << 16):
            sel.unregister(key.fileobj)
            key.fileobj.close()
"""

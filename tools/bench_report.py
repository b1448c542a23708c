"""`python tools/bench.py report`: `recovery-replay report` over a log of a million records and over the simulated
54-day run of 16,384 GPUs, each in a process of its own so that its peak memory is its own.

Metrics (one JSON line each, `bench` = "report"): for each log, `<log>_records`, `<log>_seconds` (CPU time of the
report process, as the other benches time: a shared machine's other work is not counted), `<log>_wall_seconds`,
`<log>_records_per_s` (by CPU time) and `<log>_peak_rss_mib` (the process's peak resident set, VmHWM). The report is a
fold, one record at a time: a log a quarter as long (`quarter_peak_rss_mib`) must need about as much memory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_harness import Emit

from recovery.log import write_file
from recovery.sim.config import Cluster, SimConfig
from recovery.sim.sim import simulate

Note = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=1_000_000, help="records of the synthetic log (at least)")
    parser.add_argument("--sim-log", help="an existing log of the 54-day 16,384-GPU simulation (else it is run: "
                                          "about a minute of CPU)")
    parser.add_argument("--sim-gpus", type=int, default=16_384)
    parser.add_argument("--sim-days", type=float, default=54.0)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 50,000 records, 1,024 GPUs for 7 days")


def report_process(path: Path, out: Path) -> tuple[float, float, float]:
    """Run `recovery-replay report LOG --json` in a child; (CPU seconds, wall seconds, peak RSS MiB) of that child."""
    started = time.perf_counter()
    with open(out, "wb") as sink:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=sink, stderr=subprocess.PIPE)
        try:
            _, status, usage = os.wait4(child.pid, 0)
        except BaseException:
            child.kill()
            child.wait()
            raise
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    error = child.stderr.read().decode() if child.stderr is not None else ""
    if child.returncode != 0:
        raise RuntimeError(f"report of {path} failed ({child.returncode}): {error}")
    peak = [line for line in error.splitlines() if line.startswith("VmHWM:")]
    if not peak:
        raise RuntimeError(f"the report process did not say its peak memory: {error}")
    return usage.ru_utime + usage.ru_stime, wall, int(peak[-1].split()[1]) / 1024  # kB


_CHILD = """
import sys
from recovery.cli.replay import main
code = main(["report", sys.argv[1], "--json"])
# VmHWM: the peak resident set of this process's own memory since exec (ru_maxrss would also count the parent's
# pages at fork, which the bench, holding a million records it just wrote, has many of)
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")), file=sys.stderr)
sys.exit(code)
"""


def run(args: argparse.Namespace, emit: Emit, note: Note, generate: Callable[[int, int], Any]) -> None:
    if args.quick:
        args.records, args.sim_gpus, args.sim_days = 50_000, 1_024, 7.0
    with tempfile.TemporaryDirectory(prefix="recovery-bench-report-") as tmp:
        where = Path(tmp)
        synthetic = where / "synthetic.jsonl"
        rounds, lines = 1, 0
        while lines < args.records:
            # the engine bench's workload (jobs of 64 ranks with faults, recorded through the engine): rounds grow
            # until the log holds enough records
            workload = generate(1000, rounds)
            lines = len(workload.records)
            if lines < args.records:
                rounds = max(rounds + 1, int(rounds * args.records / max(lines, 1)) + 1)
                del workload
                continue
            write_file(synthetic, list(workload.records[: args.records]))
            del workload
        note(f"synthetic log: {args.records:,} records, {synthetic.stat().st_size / 2**20:.0f} MiB")
        quarter = where / "quarter.jsonl"
        with open(synthetic, "rb") as src, open(quarter, "wb") as dst:
            for number, line in enumerate(src):
                if number >= args.records // 4:
                    break
                dst.write(line)
        if args.sim_log:
            sim_log = Path(args.sim_log)
        else:
            sim_log = where / "sim.jsonl"
            started = time.process_time()
            simulate(SimConfig(cluster=Cluster(gpus=args.sim_gpus), days=args.sim_days), log_path=sim_log)
            note(f"simulated {args.sim_gpus:,} GPUs for {args.sim_days:g} days in {time.process_time() - started:.0f} "
                 f"s of CPU")
        for name, path in (("million", synthetic), ("quarter", quarter), ("sim54", sim_log)):
            with open(path, "rb") as fh:
                records = sum(1 for _ in fh)
            cpu, wall, rss = report_process(path, where / f"{name}.json")
            note(f"{name}: {records:,} records, {path.stat().st_size / 2**20:.0f} MiB: {cpu:.1f} s CPU, {wall:.1f} s "
                 f"wall, peak RSS {rss:.0f} MiB")
            emit("report", f"{name}_records", records, "records")
            emit("report", f"{name}_seconds", round(cpu, 2), "s (CPU)")
            emit("report", f"{name}_wall_seconds", round(wall, 2), "s")
            emit("report", f"{name}_records_per_s", round(records / cpu), "records/s (CPU)")
            emit("report", f"{name}_peak_rss_mib", round(rss, 1), "MiB")

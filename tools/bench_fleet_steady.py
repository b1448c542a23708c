"""`python tools/bench.py fleet --only steady`: what a healthy fleet writes into the log, with no fault in the window.

A fleet of `--steady-gpus` GPUs (20,000: 100 jobs of 25 nodes x 8) and `--steady-idle` more nodes of no job (spares,
nodes between jobs), on one nats-server and one `recovery-daemon`. The simulated agents (`bench_fleet_agents.py`)
report every `--steady-period-s` (10 s) and say they live at the same period, in three modes: everything in the log
(`liveness = "log"`: a `node.heartbeat` in each period a node did not report in, and each node's report, as agents
did before), liveness off it (`liveness = "live"`: a beat on core NATS, the mode stated once in the log, the daemon's
liveness monitor watching), and progress off it too (`progress = "summary"`: each period's report on core NATS, the
daemon logging one `progress.summary` per job per period). Nothing fails: what the log stores in the window is the
fleet's "still fine".

It reports, per mode, `steady_log_per_s` (records the log stored a second over the window; the metric of the
first mode carries the suffix `_logged_liveness`, of the second `_logged_progress`), and
`steady_daemon_cpu_cores` (the daemon's share of a core, the monitor's and the summaries' included). Every
process it starts is stopped when it ends, however it ends."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import orjson
from bench_harness import Emit, note
from bench_harness_daemon import Daemon, connect, nats_server, publish_all, wait_seq
from bench_harness_fleet import AGENTS, BENCH, NODES_PER_JOB, RPN, job_name, stream_messages

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec


def submissions(jobs: int, period_s: float) -> list[tuple[str, bytes, str]]:
    """The fleet's jobs, submitted and started; their silence bounds three periods of the agents' reports."""
    items = []
    bound = 3 * period_s
    for j in range(jobs):
        job = job_name(j)
        spec = JobSpec.model_validate({
            "nodes": [f"f{j * NODES_PER_JOB + i:05d}" for i in range(NODES_PER_JOB)], "ranks_per_node": RPN,
            "layout": {"dp": NODES_PER_JOB * RPN}, "watchdog_interval_s": 5.0,
            "policies": {"detection": {"name": "default", "params": {"agent_silence_s": bound,
                                                                     "hang_min_silence_s": bound}}}})
        for type_, data in (("job.submitted", {"spec": spec.model_dump(mode="json")}), ("job.started", {})):
            env = make_envelope(type_, data, id=f"{job}-{type_}", job=job, source="bench")
            items.append((subjects.job_event(job, type_), encode_envelope(env), env.id))
    return items


def measure(args: argparse.Namespace, work: Path, liveness: str, progress: str) -> tuple[float, float]:
    """(records/s the log stored over the window, daemon cores) for one mode."""
    jobs = max(1, args.steady_gpus // (NODES_PER_JOB * RPN))
    nodes = jobs * NODES_PER_JOB
    period, seconds = args.steady_period_s, args.steady_seconds
    with nats_server(work / "nats") as server, Daemon(work / "daemon", server.url, lease_ttl_s=0,
                                                      log_level="WARNING") as daemon:
        daemon.start()
        daemon.wait_ready(120)

        async def submit() -> None:
            nc, js = await connect(server.url)
            await asyncio.to_thread(wait_seq, daemon, await publish_all(js, submissions(jobs, period)))
            await nc.close()

        asyncio.run(submit())
        workers: list[subprocess.Popen[bytes]] = []
        per = -(-jobs // args.workers)
        idle_per = -(-args.steady_idle // args.workers)
        try:
            for w in range(args.workers):
                mine = [[job_name(j), j * NODES_PER_JOB, j * NODES_PER_JOB, NODES_PER_JOB]
                        for j in range(w * per, min(jobs, (w + 1) * per))]
                idle = [nodes + w * idle_per, max(0, min(idle_per, args.steady_idle - w * idle_per))]
                spec = {"url": server.url, "jobs": mine, "report_s": period, "step_s": args.step_s,
                        "seconds": seconds + period + 30, "acked": False, "idle": idle, "liveness": liveness,
                        "progress": progress}
                workers.append(subprocess.Popen([sys.executable, str(AGENTS), orjson.dumps(spec).decode()],
                                                stdin=subprocess.DEVNULL, start_new_session=True))
            # Every node's first period (its mode, its first report, which is news) and each job's first summary
            # (a period after its first report heard, from which the summaries pace the watchdog) before the window.
            time.sleep(2 * period + 5)
            stored0, cpu0, t0 = stream_messages(server.url), daemon.cpu_s(), time.monotonic()
            time.sleep(seconds)  # the window: nothing happens in it but the fleet's "still fine"
            wall = time.monotonic() - t0
            stored, cores = (stream_messages(server.url) - stored0) / wall, (daemon.cpu_s() - cpu0) / wall
        finally:
            for proc in workers:
                proc.kill()
                proc.wait()
    return stored, cores


MODES = (("log", "log", "_logged_liveness"), ("live", "log", "_logged_progress"), ("live", "summary", ""))
"""(liveness, progress, the metrics' suffix): as agents were, liveness off the log, and progress summarized too"""


def run_steady(args: argparse.Namespace, work: Path, emit: Emit) -> None:
    jobs = max(1, args.steady_gpus // (NODES_PER_JOB * RPN))
    for liveness, progress, suffix in MODES:
        if args.steady_modes and f"{liveness}-{progress}" not in args.steady_modes.split(","):
            continue
        stored, cores = measure(args, work / f"{liveness}-{progress}", liveness, progress)
        note(f"steady fleet of {jobs * NODES_PER_JOB * RPN:,} GPUs ({jobs * NODES_PER_JOB:,} nodes in {jobs} jobs, "
             f"{args.steady_idle} idle), a report every {args.steady_period_s:g} s, liveness {liveness}, progress "
             f"{progress}: {stored:,.1f} records/s stored, daemon {cores:.3f} cores")
        emit(BENCH, f"steady_log_per_s{suffix}", round(stored, 1),
             f"records/s the log stored with no fault in the window (liveness {liveness}, progress {progress})")
        emit(BENCH, f"steady_daemon_cpu_cores{suffix}", round(cores, 3),
             f"cores (liveness {liveness}, progress {progress})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steady-gpus", type=int, default=20_000, help="GPUs in jobs of the steady fleet, in jobs "
                        "of 25 nodes x 8")
    parser.add_argument("--steady-idle", type=int, default=250, help="nodes of no job (spares, between jobs)")
    parser.add_argument("--steady-period-s", type=float, default=10.0, help="each node's report and liveness period")
    parser.add_argument("--steady-seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--steady-modes", default="", help="the modes to run, as liveness-progress, comma-separated "
                        "(log-log, live-log, live-summary; default all)")

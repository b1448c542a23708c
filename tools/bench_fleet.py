"""`python tools/bench.py fleet`: the control plane at a fleet's scale, its agents simulated in processes of their
own that publish over real NATS (never inside a daemon's process).

Case `steady` (c), `tools/bench_fleet_steady.py`: a healthy fleet and no fault, what the log stores a second
(`fleet_steady_log_per_s`), with the nodes' liveness logged and off the log.

Case `job` (a): one job of `--nodes` nodes of 8 ranks (16,384 x 8 = 131,072 GPUs; `--quick` 1,024 x 8) on one daemon
and one nats-server. Each simulated agent does for its node what `recovery-agent` does: it folds its 8 ranks'
heartbeats (1/s) and steps (one every `--step-s`, 2 s) into one `progress.report` per `--report-s`, which the engine
also takes for the agent's sign of life (a `node.heartbeat` goes only in a period without a report); it acks the
commands addressed to its node, and its ranks report in the newest generation a command names. Every
`--fault-every-s` a rank's process exits (its agent publishes `process.exited`); the first command of the job on the
wire after it times its fault-to-command latency, and the next fault waits for the incident to close.
`job_daemon_cpu_cores` is the daemon's CPU time (user + system) over the measured window divided by the window: the
share of a core the job costs the control plane.

The simulated agents are `--workers` processes (`tools/bench_fleet_agents.py`), each a slice of the nodes; on this
2-core machine they, nats-server and the daemon share the cores, so at full size the publishers may not keep the
pace (`job_reports_per_s` says what was sent). Every process started is stopped when the bench ends, however it
ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from bench_harness import Emit, note
from bench_harness_daemon import Daemon, connect, nats_server, publish_all, wait_seq
from bench_harness_fleet import AGENTS, BENCH, CONTROL, RPN, node_name

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec
from recovery.agent.config import AgentConfig


# -- the bench -----------------------------------------------------------------------------------------------------
def job_items(job: str, nodes: int) -> list[tuple[str, bytes, str]]:
    spec = JobSpec.model_validate({"nodes": [node_name(i) for i in range(nodes)], "ranks_per_node": RPN,
                                   "layout": {"dp": nodes * RPN}, "watchdog_interval_s": 5.0})
    items = []
    for type_, data in (("job.submitted", {"spec": spec.model_dump(mode="json")}), ("job.started", {})):
        env = make_envelope(type_, data, id=f"{job}-{type_}", job=job, source="bench")
        items.append((subjects.job_event(job, type_), encode_envelope(env), env.id))
    return items


async def measure_job(url: str, daemon: Daemon, job: str, nodes: int, seconds: float, fault_every_s: float,
                      seed: int) -> tuple[list[float], float, float]:
    """(fault-to-command latencies in ms, daemon CPU cores over the window, reports/s the daemon applied)."""
    nc, _ = await connect(url)
    rng = random.Random(seed)
    first_command: dict[int, float] = {}  # generation -> monotonic time its first command was seen
    closed = asyncio.Event()

    async def on_command(msg: Any) -> None:
        _, job_id, _ = subjects.command_parts(msg.subject)
        if job_id == job:
            attempt = int(orjson.loads(msg.data).get("attempt", 0))
            first_command.setdefault(attempt, time.monotonic())

    async def on_decision(msg: Any) -> None:
        if b'"incident.closed"' in msg.data:
            closed.set()

    await nc.subscribe(subjects.COMMANDS, cb=on_command)
    await nc.subscribe(subjects.decision(job), cb=on_decision)
    latencies: list[float] = []
    events0, cpu0, t0 = daemon.events_total() or 0.0, daemon.cpu_s(), time.monotonic()
    while time.monotonic() - t0 < seconds - fault_every_s:
        await asyncio.sleep(fault_every_s)  # the pace of the faults
        rank = rng.randrange(nodes * RPN)
        closed.clear()
        reply = orjson.loads((await nc.request(f"{CONTROL}.fault.{node_name(rank // RPN)}", str(rank).encode(),
                                               timeout=30)).data)
        deadline = time.monotonic() + 30
        while reply["generation"] + 1 not in first_command and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # polling the subscription's record, within the deadline
        if reply["generation"] + 1 in first_command:
            latencies.append((first_command[reply["generation"] + 1] - reply["sent"]) * 1000)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), 30)  # the next fault strikes a running job
    wall = time.monotonic() - t0
    cores = (daemon.cpu_s() - cpu0) / wall
    applied = ((daemon.events_total() or 0.0) - events0) / wall
    await nc.close()
    return latencies, cores, applied


def run_job(args: argparse.Namespace, work: Path, emit: Emit) -> None:
    nodes = args.nodes or (1024 if args.quick else 16_384)
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    job = "fleet-job"
    with nats_server(work / "nats") as server, Daemon(work / "daemon", server.url, lease_ttl_s=0) as daemon:
        daemon.start()
        daemon.wait_ready(120)

        async def submit() -> None:
            nc, js = await connect(server.url)
            await asyncio.to_thread(wait_seq, daemon, await publish_all(js, job_items(job, nodes)))
            await nc.close()

        asyncio.run(submit())
        # The agents' own rule (`job_reports_per_s`): a job of more nodes reports less often than `report_s`.
        period = max(args.report_s, nodes / AgentConfig.model_fields["job_reports_per_s"].default)
        per = -(-nodes // args.workers)
        workers: list[subprocess.Popen[bytes]] = []
        try:
            for w in range(args.workers):
                first, count = w * per, min(per, nodes - w * per)
                if count > 0:
                    # One healthy server, never killed: reports fire and forget (nothing is lost), so that the two
                    # cores go to the daemon and the server, not to 16,384 agents' acknowledgements.
                    spec = {"url": server.url, "jobs": [[job, 0, first, count]], "report_s": period,
                            "step_s": args.step_s, "seconds": seconds + args.warmup_s + 5, "acked": False}
                    workers.append(subprocess.Popen([sys.executable, str(AGENTS), orjson.dumps(spec).decode()],
                                                    stdin=subprocess.DEVNULL, start_new_session=True))
            time.sleep(args.warmup_s)  # the agents' first reports, before the window is measured
            latencies, cores, applied = asyncio.run(measure_job(server.url, daemon, job, nodes, seconds,
                                                                args.fault_every_s, args.seed))
        finally:
            for proc in workers:
                proc.kill()
                proc.wait()
    gpus = nodes * RPN
    note(f"job of {gpus:,} GPUs on {nodes:,} nodes: {len(latencies)} faults, daemon {cores:.2f} cores, "
         f"{applied:,.0f} inputs/s applied (a node's report every {period:g} s)")
    emit(BENCH, "job_gpus", gpus, "GPUs")
    emit(BENCH, "job_report_period_s", period, "s (each node's report: the agents' job_reports_per_s rule)")
    emit(BENCH, "job_inputs_per_s", round(applied, 1), "inputs applied per second (reports and heartbeats)")
    emit(BENCH, "job_daemon_cpu_cores", round(cores, 3), "cores (daemon CPU s / wall s; goal 0.5 or less)")
    if latencies:
        ordered = sorted(latencies)
        emit(BENCH, "job_fault_to_command_p50_ms", round(statistics.median(ordered), 2), "ms")
        emit(BENCH, "job_fault_to_command_p99_ms", round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
             f"ms (goal 100 or less; {len(ordered)} faults)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=("job", "fleet", "steady"), default=None,
                        help="one case: `job` (a), one job of 131,072 GPUs; `fleet` (b), 200,000 GPUs in 1,000 jobs "
                             "over 3 daemons and 3 nats-servers; `steady` (c), what a healthy fleet writes into the "
                             "log, liveness logged and live (default: all three)")
    parser.add_argument("--quick", action="store_true", help="1,024 nodes for 20 s")
    parser.add_argument("--nodes", type=int, default=0, help="nodes of 8 ranks in the job (default 16,384)")
    parser.add_argument("--seconds", type=float, default=0.0, help="the measured window (default 60)")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=4, help="processes of simulated agents")
    parser.add_argument("--report-s", type=float, default=1.0, help="the agents' report_s (a job of more nodes "
                        "than job_reports_per_s reports less often)")
    parser.add_argument("--step-s", type=float, default=2.0, help="a rank's step")
    parser.add_argument("--fault-every-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="copy the daemons' and servers' logs here when the bench ends (where a fault's time went)")


@contextlib.contextmanager
def workspace(keep_logs: Path | None) -> Iterator[Path]:
    """A temporary directory for the cases, its logs copied to `keep_logs` when they end, however they end."""
    with tempfile.TemporaryDirectory(prefix="recovery-fleet-") as tmp:
        try:
            yield Path(tmp)
        finally:
            if keep_logs is not None:
                for log in Path(tmp).rglob("*.log"):
                    kept = keep_logs / log.relative_to(tmp)
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, kept)

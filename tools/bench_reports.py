"""The `reports` part of `python tools/bench.py daemon`: what edge aggregation saves the daemon.

The same progress of the same ranks, told twice to one daemon on one nats-server: first as every rank's own
`progress.step` (what older agents send), then folded as agents fold it, one `progress.report` per node (here a
job of 8 ranks on one node) per period. Emitted: the daemon's CPU per per-rank event, per report and per rank a
report covers, and the ratio of the last to the first (how much less CPU a rank's word costs folded).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from bench_harness import Emit, note, sig
from bench_harness_daemon import RANKS, Daemon, blast, connect, job_setup, progress, publish_all, wait_seq

from events import subjects
from recovery.log import MSG_ID
from recovery.log.jetstream import publish_with_retry

JOBS = 125


def reports(jobs: int, prefix: str, count: int, start_step: int) -> list[tuple[str, bytes, str]]:
    """`count` progress reports, round-robin over the jobs, each with every rank of its job one step further."""
    items = []
    for i in range(count):
        rnd, j = divmod(i, jobs)
        job = f"{prefix}{j:05d}"
        step = start_step + rnd
        ident = f"{job}-report-{step}"
        data = {"id": ident, "type": "progress.report", "job": job, "source": "bench",
                "data": {"ranks": [{"rank": rank, "step": step, "attempt": 0} for rank in range(RANKS)]}}
        items.append((subjects.job_event(job, "progress.report"), orjson.dumps(data), ident))
    return items


async def _cpu_us_each(url: str, daemon: Daemon, items: list[tuple[str, bytes, str]]) -> float:
    """The daemon's CPU microseconds per item, for `items` blasted and applied."""
    nc, js = await connect(url)
    marker = items.pop()
    cpu0 = daemon.cpu_s()
    await blast(nc, js, "RECOVERY", items)
    last = (await publish_with_retry(js, marker[0], marker[1], {MSG_ID: marker[2]})).seq
    await nc.close()
    await asyncio.to_thread(wait_seq, daemon, last)
    return (daemon.cpu_s() - cpu0) * 1e6 / (len(items) + 1)


def measure(work: Path, url: str, events: int, emit: Emit) -> None:
    with Daemon(work / "d-reports", url) as daemon:
        daemon.start()
        daemon.wait_ready()

        async def setup() -> None:
            nc, js = await connect(url)
            await asyncio.to_thread(wait_seq, daemon, await publish_all(js, job_setup(JOBS, "ag")))
            await nc.close()

        asyncio.run(setup())
        rounds = max(1, events // (JOBS * RANKS))
        per_event = asyncio.run(_cpu_us_each(url, daemon, progress(JOBS, "ag", rounds * JOBS * RANKS)))
        per_report = asyncio.run(_cpu_us_each(url, daemon, reports(JOBS, "ag", rounds * JOBS, rounds + 1)))
        daemon.stop()
    per_rank = per_report / RANKS
    note(f"edge aggregation: {per_event:.1f} us of daemon CPU per per-rank event, {per_report:.1f} us per report of "
         f"{RANKS} ranks ({per_rank:.1f} us per rank covered): {per_event / per_rank:.1f}x less per rank")
    emit("daemon", "daemon_cpu_us_per_rank_event", sig(per_event), "us (a rank's own progress.step)")
    emit("daemon", "daemon_cpu_us_per_node_report", sig(per_report), f"us (a progress.report of {RANKS} ranks)")
    emit("daemon", "daemon_cpu_us_per_rank_reported", sig(per_rank), "us (per rank a report covers)")
    emit("daemon", "aggregation_cpu_ratio", sig(per_rank / per_event), "x (per rank, folded against per-rank)")

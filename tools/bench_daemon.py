"""`python tools/bench.py daemon`: the daemon as a process on a real nats-server, measured end to end.

    python tools/bench.py daemon            # 1,000,000 events, 10,000 jobs, 300 faults under 10k heartbeats/s
    python tools/bench.py daemon --quick    # small sizes (the smoke test)
    python tools/bench.py daemon --only latency --faults 300

Figures (JSON lines on stdout, `{"bench": "daemon", "metric", "value", "unit"}`):

- `nats_publish_per_s`, `nats_consume_per_s`: the ceiling. nats-py alone on the same server: pipelined
  JetStream publishes with acks, and the pull reader every consumer here uses (`recovery.log.pull`, the daemon's
  included) reading in batches and doing nothing with the messages.
- `events_per_s`: sustained publish -> acknowledged processing. A publisher pipelines progress reports of
  running jobs as fast as nats-py goes while the daemon applies them; from the first publish to the daemon's
  acknowledgement of the last (its published sequence). `ratio_to_nats_consume` puts it against the ceiling.
- `daemon_cpu_us_per_event`: the daemon process's CPU time (user + system) over the same run, per event: what
  the daemon costs, nearly independent of other load on the machine (a rate is not).
- `fault_to_command_p50_ms` / `_p99_ms`: a fault published (process exit) to its first command received by a
  subscriber on `recovery.cmd.>`, with `--heartbeat-rate` heartbeats/s of background load from other jobs.
- `restart_to_ready_s`: a SIGTERMed daemon started again over the stream holding `--events` events, from the
  process start (imports included) to `/readyz` answering 200; `restart_after_kill_to_ready_s` the same after
  SIGKILL (it replays the tail after its last periodic snapshot), the median of three kills. The daemon's modules'
  bytecode is cached as an installed package's is, whatever PYTHONDONTWRITEBYTECODE says.
- `failover_after_kill_s`, `failover_after_sigterm_s`: a standby daemon on the same partition, from the active
  one's SIGKILL (the lease expires) or SIGTERM (it hands over) to the standby's `/readyz` answering 200.
- `rss_idle_mb`, `rss_mb` with `--rss-jobs` running jobs (8 ranks each), `rss_per_job_kb`.

The machine is shared: every figure is one run (the restart one the median of three), and the ratio to the
raw nats-py consume rate measured beside it is the figure that travels between machines. The publisher of the
throughput figure does not wait for acknowledgements (agents do not), so the daemon is the bottleneck.

Every process it starts (nats-server, the daemons and what they fork) is stopped when it ends, however it ends:
a failure, Ctrl-C or SIGTERM. A publish the server refuses (429, its ingest buffer full) is sent again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The harness is beside this file: on the path too when this module is imported as `tools.bench_daemon` (the tests).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import orjson
from bench_harness import Emit, note, sig, sigterm_unwinds
from bench_harness_daemon import RANKS, Daemon, blast, connect, job_setup, nats_server, progress, publish_all, wait_seq
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.log import MSG_ID
from recovery.log.jetstream import publish_with_retry
from recovery.log.pull import PullReader
from recovery.testing.nats import NatsServer


# -- the benches ------------------------------------------------------------------------------------------
async def raw_rates(url: str, count: int) -> tuple[float, float, float]:
    """nats-py's own rates on a scratch stream: pipelined JetStream publishes with acks, publishes without
    waiting for acks (until the stream holds them), and the pull reader in batches of the daemon's size."""
    nc, js = await connect(url)
    name = f"BENCH_RAW_{time.monotonic_ns()}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"bench.{name}.>"], storage=StorageType.FILE,
                                     duplicate_window=600))
    payload = orjson.dumps({"id": "x" * 24, "type": "process.heartbeat", "job": "job00001", "source": "bench",
                            "data": {"rank": 3, "step": 1000, "attempt": 0}})
    items = [(f"bench.{name}.job{i % 100}.progress", payload, f"raw-{i}") for i in range(count)]
    t0 = time.perf_counter()
    await publish_all(js, items)
    publish_rate = count / (time.perf_counter() - t0)
    more = [(s, d, f"raw2-{i}") for i, (s, d, _) in enumerate(items)]
    t0 = time.perf_counter()
    await blast(nc, js, name, more)
    stored, grew = 0, time.monotonic()
    while stored < 2 * count:
        now_stored = int((await js.stream_info(name)).state.messages)
        if now_stored > stored:
            stored, grew = now_stored, time.monotonic()
        elif time.monotonic() - grew > 10:
            # Publishes without a reply get no 429: the server drops what its ingest buffer cannot hold.
            raise RuntimeError(f"the server stored {stored - count:,} of the {count:,} messages published without "
                               "waiting for acknowledgements and no more for 10 s: it dropped the rest")
        await asyncio.sleep(0.005)  # polling interval of a bounded wait (the server stores what it got)
    blast_rate = count / (time.perf_counter() - t0)
    reader = PullReader(nc, js, name, ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True), batch=1000,
                        end_seq=stored)
    got = 0
    t0 = time.perf_counter()
    await reader.open(1)
    while not reader.done:
        got += len(await reader.next_batch(reader.stall_s))
    consume_rate = got / (time.perf_counter() - t0)
    await reader.close()
    await js.delete_stream(name)
    await nc.close()
    return publish_rate, blast_rate, consume_rate


async def throughput(url: str, daemon: Daemon, jobs: int, events: int) -> tuple[float, float, int, float]:
    """(events/s applied and acknowledged, events/s offered, last sequence, the daemon's CPU microseconds per
    event) for `events` progress reports published as fast as nats-py goes while the daemon runs."""
    nc, js = await connect(url)
    last = await publish_all(js, job_setup(jobs, "tp"))
    await asyncio.to_thread(wait_seq, daemon, last)
    items = progress(jobs, "tp", events)
    marker = items.pop()
    cpu0 = daemon.cpu_s()
    t0 = time.monotonic()
    await blast(nc, js, "RECOVERY", items)
    last = (await publish_with_retry(js, marker[0], marker[1], {MSG_ID: marker[2]})).seq  # after all the others
    offered = time.monotonic()
    await nc.close()
    end = await asyncio.to_thread(wait_seq, daemon, last)
    return events / (end - t0), events / (offered - t0), last, (daemon.cpu_s() - cpu0) * 1e6 / events


async def latency(url: str, daemon: Daemon, faults: int, rate: float) -> tuple[list[float], float]:
    """(fault-to-command latencies in ms, background heartbeats/s achieved)."""
    nc, js = await connect(url)
    background_jobs = 100
    # The probed jobs never report progress: a watchdog checking them would (rightly) call them hung first.
    last = await publish_all(js, job_setup(background_jobs, "bg", watchdog_s=5.0)
                             + job_setup(faults, "lat", watchdog_s=3600.0))
    await asyncio.to_thread(wait_seq, daemon, last)
    sent: dict[str, float] = {}
    got: dict[str, float] = {}

    async def on_command(msg: Msg) -> None:
        _, job, _ = subjects.command_parts(msg.subject)
        if job in sent and job not in got:
            got[job] = time.perf_counter()

    sub = await nc.subscribe(f"{subjects.PREFIX}.cmd.>", cb=on_command)
    stop = asyncio.Event()
    background = progress(background_jobs, "bg", int(rate * (faults * 0.05 + 10)), kind="process.heartbeat")
    published = 0

    async def load() -> None:
        nonlocal published
        tick = 0.01
        per_tick = max(1, int(rate * tick))
        start = time.perf_counter()
        i = 0
        while not stop.is_set() and i < len(background):
            for subject, data, ident in background[i:i + per_tick]:
                await nc.publish(subject, data, headers={MSG_ID: ident})  # agents do not wait for acks
            i += per_tick
            published += per_tick
            delay = start + (i / per_tick) * tick - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing of the background load

    loader = asyncio.create_task(load())
    await asyncio.sleep(1.0)  # let the background load settle before measuring
    t_load = time.perf_counter()
    p0 = published
    for f in range(faults):
        job = f"lat{f:05d}"
        env = make_envelope("process.exited", {"rank": 0, "exit_code": 1}, id=f"{job}-exit", job=job, source="bench")
        sent[job] = time.perf_counter()
        await js.publish_async(subjects.job_event(job, "process.exited"), encode_envelope(env),
                               headers={MSG_ID: env.id})
        await asyncio.sleep(0.05)  # one fault every 50 ms
    deadline = time.perf_counter() + 30
    while len(got) < faults and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)  # polling interval of a deadline-bounded wait
    achieved = (published - p0) / (time.perf_counter() - t_load)
    stop.set()
    await loader
    await sub.unsubscribe()
    await nc.close()
    return [(got[j] - sent[j]) * 1000 for j in sent if j in got], achieved


async def rss_setup(url: str, daemon: Daemon, jobs: int) -> None:
    nc, js = await connect(url)
    last = await publish_all(js, job_setup(jobs, "rss", watchdog_s=30.0))
    last = max(last, await publish_all(js, progress(jobs, "rss", jobs * RANKS)))
    await nc.close()
    await asyncio.to_thread(wait_seq, daemon, last)


PARTS = ("raw", "throughput", "latency", "failover", "rss", "reports")
"""`--only`'s choices; `failover` (tools/bench_failover.py) and `reports` (tools/bench_reports.py) are the `beside`
that `python tools/bench.py daemon` gives `run`"""

Beside = Callable[[Path, str, int], None]
"""more parts on the same nats-server, after the latency: (the work directory, the server's URL, `--events`)"""


def run(args: argparse.Namespace, emit: Emit, beside: Beside | None = None) -> None:
    events = args.events or (50_000 if args.quick else 1_000_000)
    rss_jobs = args.rss_jobs or (1_000 if args.quick else 10_000)
    faults = args.faults or (40 if args.quick else 300)
    parts = set(args.only or PARTS)
    consume_rate = None
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bench-daemon-") as tmp:
        work = Path(tmp)
        # NatsServer as this module names it: a test stands in a server that records what it started.
        with nats_server(work / "nats", NatsServer) as server:
            if "raw" in parts or "throughput" in parts:
                publish_rate, blast_rate, consume_rate = asyncio.run(raw_rates(server.url, min(events, 100_000)))
                note(f"raw nats-py: publish {publish_rate:,.0f}/s with acks, {blast_rate:,.0f}/s without waiting, "
                     f"consume {consume_rate:,.0f}/s")
                emit("daemon", "nats_publish_per_s", sig(publish_rate), "msgs/s (acked)")
                emit("daemon", "nats_publish_noack_per_s", sig(blast_rate), "msgs/s")
                emit("daemon", "nats_consume_per_s", sig(consume_rate), "msgs/s")
            if "throughput" in parts:
                _throughput_and_restart(work, server.url, args, events, consume_rate, emit)
            if "latency" in parts:
                with Daemon(work / "d-latency", server.url, batch_size=args.batch) as daemon:
                    daemon.start()
                    daemon.wait_ready()
                    lat, achieved = asyncio.run(latency(server.url, daemon, faults, args.heartbeat_rate))
                    daemon.stop()
                lat.sort()
                if lat:
                    p50 = lat[len(lat) // 2]
                    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
                    note(f"fault to command: p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {lat[-1]:.2f} ms; {len(lat)} of "
                         f"{faults} faults answered, {achieved:,.0f} heartbeats/s in the background")
                    emit("daemon", "fault_to_command_p50_ms", sig(p50), "ms")
                    emit("daemon", "fault_to_command_p99_ms", sig(p99), "ms")
                    emit("daemon", "background_heartbeats_per_s", sig(achieved), "events/s")
            if beside is not None:
                beside(work, server.url, events)
        if "rss" in parts:
            _rss(work, rss_jobs, emit)


def _throughput_and_restart(work: Path, url: str, args: argparse.Namespace, events: int,
                            consume_rate: float | None, emit: Emit) -> None:
    with Daemon(work / "d1", url, batch_size=args.batch, snapshot_every_records=200_000, snapshot_every_s=30.0,
                timers_enabled=True) as daemon:
        _throughput_and_restart_with(daemon, url, args, events, consume_rate, emit)


def _throughput_and_restart_with(daemon: Daemon, url: str, args: argparse.Namespace, events: int,
                                 consume_rate: float | None, emit: Emit) -> None:
    daemon.start()
    daemon.wait_ready()
    rate, offered, last, cpu_us = asyncio.run(throughput(url, daemon, args.jobs, events))
    note(f"throughput: {rate:,.0f} events/s applied and acknowledged ({offered:,.0f}/s offered), "
         f"{events:,} events over {args.jobs} jobs of {RANKS} ranks, {cpu_us:.1f} us of daemon CPU per event")
    emit("daemon", "events_per_s", sig(rate), "events/s")
    emit("daemon", "daemon_cpu_us_per_event", sig(cpu_us), "us")
    emit("daemon", "offered_per_s", sig(offered), "events/s")
    if consume_rate:
        emit("daemon", "ratio_to_nats_consume", sig(rate / consume_rate), "x")
    emit("daemon", "stream_events", last, "records")
    emit("daemon", "sigterm_stop_s", sig(daemon.stop()), "s")
    ready = []
    for _ in range(3):
        started = daemon.start()
        daemon.wait_ready()
        ready.append(time.monotonic() - started)
        daemon.stop()
    note(f"restart to ready over {last:,} records: {[round(r, 3) for r in ready]} s")
    emit("daemon", "restart_to_ready_s", sig(statistics.median(ready)), "s")
    killed: list[float] = []
    replayed: list[int] = []
    for round_ in range(3):
        daemon.start()
        daemon.wait_ready()
        wait_seq(daemon, asyncio.run(_more(url, args.jobs, events, round_)))
        daemon.stop(kill=True)
        started = daemon.start()
        daemon.wait_ready()
        killed.append(time.monotonic() - started)
        replayed.append(int(daemon.status().get("replayed_records") or 0))
        daemon.stop()
    note(f"after SIGKILL: ready in {[round(k, 3) for k in killed]} s, replayed {replayed} records after the last "
         f"snapshot")
    emit("daemon", "restart_after_kill_to_ready_s", sig(statistics.median(killed)), "s")
    emit("daemon", "restart_after_kill_replayed", float(statistics.median(replayed)), "records")


def _rss(work: Path, jobs: int, emit: Emit) -> None:
    with nats_server(work / "nats-rss") as server, \
            Daemon(work / "d2", server.url, timers_enabled=False, snapshot_every_records=10_000_000,
                   snapshot_every_s=3600.0) as daemon:
        daemon.start()
        daemon.wait_ready()
        idle = daemon.rss_mb()
        asyncio.run(rss_setup(server.url, daemon, jobs))
        with contextlib.suppress(Exception):
            daemon.get("/metrics")
        rss = daemon.rss_mb()
        daemon.stop()
        note(f"RSS: idle {idle:.1f} MB, {rss:.1f} MB with {jobs:,} running jobs of {RANKS} ranks")
        emit("daemon", "rss_idle_mb", sig(idle), "MB")
        emit("daemon", "rss_mb", sig(rss), f"MB ({jobs} jobs)")
        emit("daemon", "rss_per_job_kb", sig((rss - idle) * 1024 / jobs), "KB/job")


async def _more(url: str, jobs: int, events: int, round_: int = 0) -> int:
    """Some more traffic after the graceful restarts, so that the kill lands after the last snapshot (each round's
    steps past the one before's)."""
    nc, js = await connect(url)
    last = await publish_all(js, progress(jobs, "tp", min(events // 10, 50_000),
                                          start_step=10_000_000 * (round_ + 1)))
    await nc.close()
    return last


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes (50,000 events, 1,000 jobs, 40 faults)")
    parser.add_argument("--events", type=int, help="progress events for the throughput and restart figures "
                                                   "(default 1,000,000)")
    parser.add_argument("--jobs", type=int, default=125, help="jobs the progress events report for")
    parser.add_argument("--rss-jobs", type=int, help="running jobs for the RSS figure (default 10,000)")
    parser.add_argument("--faults", type=int, help="faults for the latency figure (default 300)")
    parser.add_argument("--heartbeat-rate", type=float, default=10_000.0, help="background heartbeats/s")
    parser.add_argument("--batch", type=int, default=1000, help="the daemon's batch_size")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")


if __name__ == "__main__":
    # The whole bench, its failover and reports parts included, is put together by bench.py.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    bench = Path(__file__).resolve().with_name("bench.py")
    os.execv(sys.executable, [sys.executable, str(bench), "daemon", *sys.argv[1:]])

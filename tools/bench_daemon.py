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
  SIGKILL (it replays the tail after its last periodic snapshot).
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
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, PubAck, StorageType, StreamConfig

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec
from recovery.log.jetstream import is_retryable, publish_with_retry, surface_async_ack_errors
from recovery.log.pull import PullReader
from recovery.testing.nats import NatsServer, free_port

ROOT = Path(__file__).resolve().parent.parent
MSG_ID = "Nats-Msg-Id"
RANKS = 8

Emit = Callable[[str, str, float, str], None]


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the daemon process -----------------------------------------------------------------------------------
class Daemon:
    def __init__(self, workdir: Path, url: str, **settings: Any) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "daemon.toml"
        values = {"nats_url": url, "http_port": self.port, "data_dir": str(workdir / "data"), "log_level": "INFO",
                  "log_file": str(workdir / "daemon.log"), **settings}
        self.config.write_text("".join(f"{k} = {orjson.dumps(v).decode()}\n" for k, v in values.items()))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        started = time.monotonic()
        # Its own process group: `close` stops the daemon and the snapshot children it forks together, and a
        # Ctrl-C in the terminal reaches the bench, which stops it, rather than racing it.
        self.proc = subprocess.Popen([sys.executable, "-m", "recovery.cli.daemon", "--config", str(self.config)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=ROOT, start_new_session=True)
        return started

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""
        except (urllib.error.URLError, OSError):
            return 0, b""

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/readyz")[0] != 200:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited; see {self.workdir / 'daemon.log'}")
            if time.monotonic() > deadline:
                tail = "\n".join((self.workdir / "daemon.log").read_text(errors="replace").splitlines()[-30:])
                raise TimeoutError(f"daemon not ready within {timeout:g} s; /status {self.status()}; log:\n{tail}")
            time.sleep(0.02)  # polling interval of a deadline-bounded wait (each poll costs the daemon a request)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        result: dict[str, Any] = orjson.loads(body) if code == 200 else {}
        return result

    def published_seq(self) -> int:
        return int(self.status().get("published_seq", 0))

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the daemon process has used: unlike a rate, barely moved by other load on
        a shared machine, so it compares two builds run minutes apart."""
        assert self.proc is not None
        # /proc/<pid>/stat: fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, kill: bool = False) -> float:
        assert self.proc is not None
        started = time.monotonic()
        if kill:
            self._kill_group()  # a crashed host: a snapshot child in flight dies with the daemon
        else:
            self.proc.terminate()
        self.proc.wait(timeout=60)
        return time.monotonic() - started

    def _kill_group(self) -> None:
        # Only while the daemon is not reaped: until then its pid, which is its group's id, cannot name another
        # process group.
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the daemon (and anything it forked) if it still runs: the cleanup of a bench that failed."""
        if self.proc is None:
            return
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@contextlib.contextmanager
def nats_server(store_dir: Path) -> Iterator[NatsServer]:
    """A running nats-server, stopped on the way out whatever happens, a failed or interrupted start included
    (`NatsServer`'s own `with` does not stop a server whose start raised)."""
    server = NatsServer(store_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a CI timeout, `kill`) ends the bench through its `finally` blocks, as Ctrl-C does, instead of
    leaving its processes running."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def unwind(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_seq(daemon: Daemon, seq: int, timeout: float = 3600.0) -> float:
    deadline = time.monotonic() + timeout
    while daemon.published_seq() < seq:
        if daemon.proc is None or daemon.proc.poll() is not None:
            raise RuntimeError(f"daemon exited before reaching {seq}; see {daemon.workdir / 'daemon.log'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon did not reach {seq}")
        time.sleep(0.002)  # polling interval of a deadline-bounded wait
    return time.monotonic()


# -- publishing -------------------------------------------------------------------------------------------
async def connect(url: str) -> tuple[Client, JetStreamContext]:
    nc = await nats.connect(url, max_reconnect_attempts=-1, pending_size=256 * 1024 * 1024)
    js = nc.jetstream(timeout=30, publish_async_max_pending=20_000)
    surface_async_ack_errors(js)  # else a refused publish's future never resolves (a nats-py bug)
    return nc, js


async def publish_all(js: JetStreamContext, items: list[tuple[str, bytes, str]], window: int = 8192,
                      ack_timeout: float = 30.0) -> int:
    """Pipelined JetStream publishes, at most `window` unacknowledged; the last stream sequence. One refused
    (429) or not acknowledged within `ack_timeout` is sent again on its own, with its id (so never twice)."""
    last = 0
    pending: list[tuple[tuple[str, bytes, str], asyncio.Future[PubAck]]] = []

    async def settle() -> None:
        nonlocal last
        if not pending:
            return
        # Bounded: an acknowledgement that never comes must not hold the bench forever.
        _, late = await asyncio.wait([future for _, future in pending], timeout=ack_timeout)
        for future in late:
            future.cancel()
        for (subject, data, ident), future in pending:
            error = None if future.cancelled() else future.exception()
            if future.cancelled() or error is not None:
                if error is not None and not is_retryable(error, idempotent=True):
                    raise error
                ack = await publish_with_retry(js, subject, data, {MSG_ID: ident}, retry_for=max(ack_timeout, 60))
            else:
                ack = future.result()
            last = max(last, ack.seq)
        pending.clear()

    for item in items:
        subject, data, ident = item
        pending.append((item, await js.publish_async(subject, data, headers={MSG_ID: ident})))
        if len(pending) >= window:
            await settle()
    await settle()
    return last


async def blast(nc: Client, js: JetStreamContext, stream: str, items: list[tuple[str, bytes, str]]) -> None:
    """Publish without waiting for each acknowledgement (what a fleet of agents looks like to the server)."""
    for n, (subject, data, ident) in enumerate(items, 1):
        await nc.publish(subject, data, headers={MSG_ID: ident})
        if n % 10_000 == 0:
            await nc.flush(timeout=60)
    await nc.flush(timeout=60)


def job_setup(jobs: int, prefix: str, watchdog_s: float = 2.0) -> list[tuple[str, bytes, str]]:
    items = []
    for j in range(jobs):
        job = f"{prefix}{j:05d}"
        spec = JobSpec.model_validate({"nodes": [f"{job}-n"], "ranks_per_node": RANKS, "layout": {"dp": RANKS},
                                       "watchdog_interval_s": watchdog_s})
        for type_, data in (("job.submitted", {"spec": spec.model_dump(mode="json")}), ("job.started", {})):
            env = make_envelope(type_, data, id=f"{job}-{type_}", job=job, source="bench")
            items.append((subjects.job_event(job, type_), encode_envelope(env), env.id))
    return items


def progress(jobs: int, prefix: str, count: int, start_step: int = 1, kind: str = "progress.step"
             ) -> list[tuple[str, bytes, str]]:
    """`count` progress reports, round-robin over every rank of every job, steps going up."""
    items = []
    per_round = jobs * RANKS
    for i in range(count):
        rnd, k = divmod(i, per_round)
        j, rank = divmod(k, RANKS)
        job = f"{prefix}{j:05d}"
        ident = f"{job}-{kind}-{rank}-{start_step + rnd}"
        data = {"id": ident, "type": kind, "job": job, "source": "bench",
                "data": {"rank": rank, "step": start_step + rnd, "attempt": 0}}
        items.append((subjects.job_event(job, kind), orjson.dumps(data), ident))
    return items


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


def run(args: argparse.Namespace, emit: Emit) -> None:
    events = args.events or (50_000 if args.quick else 1_000_000)
    rss_jobs = args.rss_jobs or (1_000 if args.quick else 10_000)
    faults = args.faults or (40 if args.quick else 300)
    parts = set(args.only or PARTS)
    consume_rate = None
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bench-daemon-") as tmp:
        work = Path(tmp)
        with nats_server(work / "nats") as server:
            if "raw" in parts or "throughput" in parts:
                publish_rate, blast_rate, consume_rate = asyncio.run(raw_rates(server.url, min(events, 100_000)))
                note(f"raw nats-py: publish {publish_rate:,.0f}/s with acks, {blast_rate:,.0f}/s without waiting, "
                     f"consume {consume_rate:,.0f}/s")
                emit("daemon", "nats_publish_per_s", _sig(publish_rate), "msgs/s (acked)")
                emit("daemon", "nats_publish_noack_per_s", _sig(blast_rate), "msgs/s")
                emit("daemon", "nats_consume_per_s", _sig(consume_rate), "msgs/s")
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
                    emit("daemon", "fault_to_command_p50_ms", _sig(p50), "ms")
                    emit("daemon", "fault_to_command_p99_ms", _sig(p99), "ms")
                    emit("daemon", "background_heartbeats_per_s", _sig(achieved), "events/s")
            if "failover" in parts:
                import bench_failover  # beside this script, as bench.py puts tools/ on the path

                bench_failover.failover(work, server.url, emit)
            if "reports" in parts:
                import bench_reports

                bench_reports.measure(work, server.url, min(events, 200_000), emit)
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
    emit("daemon", "events_per_s", _sig(rate), "events/s")
    emit("daemon", "daemon_cpu_us_per_event", _sig(cpu_us), "us")
    emit("daemon", "offered_per_s", _sig(offered), "events/s")
    if consume_rate:
        emit("daemon", "ratio_to_nats_consume", _sig(rate / consume_rate), "x")
    emit("daemon", "stream_events", last, "records")
    emit("daemon", "sigterm_stop_s", _sig(daemon.stop()), "s")
    ready = []
    for _ in range(3):
        started = daemon.start()
        daemon.wait_ready()
        ready.append(time.monotonic() - started)
        daemon.stop()
    note(f"restart to ready over {last:,} records: {[round(r, 3) for r in ready]} s")
    emit("daemon", "restart_to_ready_s", _sig(statistics.median(ready)), "s")
    daemon.start()
    daemon.wait_ready()
    wait_seq(daemon, asyncio.run(_more(url, args.jobs, events)))
    daemon.stop(kill=True)
    started = daemon.start()
    daemon.wait_ready()
    killed = time.monotonic() - started
    replayed = daemon.status().get("replayed_records")
    daemon.stop()
    note(f"after SIGKILL: ready in {killed:.3f} s, replayed {replayed} records after the last snapshot")
    emit("daemon", "restart_after_kill_to_ready_s", _sig(killed), "s")
    emit("daemon", "restart_after_kill_replayed", float(replayed or 0), "records")


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
        emit("daemon", "rss_idle_mb", _sig(idle), "MB")
        emit("daemon", "rss_mb", _sig(rss), f"MB ({jobs} jobs)")
        emit("daemon", "rss_per_job_kb", _sig((rss - idle) * 1024 / jobs), "KB/job")


async def _more(url: str, jobs: int, events: int) -> int:
    """Some more traffic after the graceful restarts, so that the kill lands after the last snapshot."""
    nc, js = await connect(url)
    last = await publish_all(js, progress(jobs, "tp", min(events // 10, 50_000), start_step=10_000_000))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)

    def emit(bench: str, metric: str, value: float, unit: str) -> None:
        sys.stdout.write(orjson.dumps({"bench": bench, "metric": metric, "value": value, "unit": unit}).decode()
                         + "\n")
        sys.stdout.flush()

    run(args, emit)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()

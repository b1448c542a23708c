"""`python tools/bench.py soak --minutes M`: the daemon for M minutes under load, faults, its own SIGKILLs and NATS
restarts; what it must never do (lose an event, double a command) counted, what it may do (grow, slow down) drawn.

    python tools/bench.py soak --minutes 30 --png docs/soak.png     # the figure of docs/platform.md, "Soak"
    python tools/bench.py soak --minutes 2 --rate 1000              # a short look

The load is the demo's cluster (`recovery.service.demo.BuiltinCluster`, in this process): `--rate` events/s of
progress reports from jobs of 8 ranks, a fault every `--fault-every-s` (a crash, a GPU off the bus, a hang, a link
flap), every command carried out after a short delay. The daemon is a process of its own on a nats-server of its
own. Every `--kill-every-s` (jittered) the daemon is SIGKILLed and started again; every `--nats-restart-every-s`
the nats-server is stopped and started on the same store (with `--cluster 3`, three routed nats-servers and
every stream at three replicas: the log stream's leader is SIGKILLed and comes back `--down-s` later). Once the
time is up the faults stop, the cluster stops, and the log is read back whole:

- `events_lost`: events the cluster published (JetStream acknowledged them) that are not in the log: must be 0.
- `commands_doubled`: a command id stored twice for one node in the command stream: must be 0.
- `decisions_missing` / `decisions_extra`: the log's recorded decisions against an offline replay of its inputs
  (a decision lost in a crash, or made twice): must be 0.
- `rss_growth_pct`: the daemon's RSS at the end of its longest-lived incarnation against the same incarnation's RSS
  once warmed up (its first `--warmup-s`): the goal is 10% or less. `rss_mb_max` the largest sample.
- `events_per_s_p50`, `events_per_s_min`: the daemon's applied inputs per second over the samples (its
  `recovery_events_total`), with the kills and restarts in them.

Samples every `--sample-s` seconds go to `--csv` and, drawn, to `--png` (an SVG drawn by headless Chromium; without
Chromium the SVG alone). Every process started is stopped when the bench ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import itertools
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
from bench_harness import Emit, note, sigterm_unwinds
from bench_harness_daemon import Daemon, nats_server

from events.envelope import Record
from events.outputs import Decision
from events.subjects import is_output
from recovery.core.effects import apply_encoded
from recovery.core.engine import Engine
from recovery.log import MSG_ID
from recovery.log.jetstream import JetStreamLog
from recovery.service.demo import BuiltinCluster, Bus, DemoSettings
from recovery.testing.nats import NatsCluster, NatsServer

BENCH = "soak"
RANKS = 8  # the demo cluster's jobs: two nodes of four ranks


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    events_total: float
    incarnation: int


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    nats_restarts: list[float] = field(default_factory=list)
    restarts: list[tuple[float, float, int]] = field(default_factory=list)
    """per daemon SIGKILL: (time into the run, seconds until ready again, inputs replayed past its snapshot)"""


class Outage:
    """What `--nats-restart-every-s` does to NATS: one server stopped and started again on its store; on a cluster
    (`--cluster N`), the server leading the log stream SIGKILLed and started again `--down-s` later, its peers
    carrying on meanwhile."""

    def __init__(self, args: argparse.Namespace, server: NatsServer | None, cluster: NatsCluster | None) -> None:
        self.args, self.server, self.cluster = args, server, cluster

    @property
    def url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.server.url  # type: ignore[union-attr]

    async def strike(self) -> None:
        if self.cluster is None:
            assert self.server is not None
            await asyncio.to_thread(self.server.stop)
            # A store of millions of messages takes JetStream more than the default 15 s to recover at start.
            await asyncio.to_thread(self.server.start, 600)
            return
        leader = await asyncio.to_thread(self.cluster.leader_of, "RECOVERY") or self.cluster.servers[0]
        await asyncio.to_thread(leader.kill)
        await asyncio.sleep(self.args.down_s)  # the cluster runs one server short this long
        await asyncio.to_thread(leader.start, 600)
        await asyncio.to_thread(self.cluster.wait_formed, 600)


async def soak_run(args: argparse.Namespace, work: Path, outage: Outage, daemon: Daemon, soak: Soak) -> list[str]:
    """Drive the cluster for `args.minutes`; the ids of every event it published."""
    rng = random.Random(args.seed)
    outages: list[str] = []

    async def on_error(exc: Exception) -> None:
        outages.append(repr(exc))  # the restarts this bench makes: nothing to print

    nc = await nats.connect(outage.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            error_cb=on_error)
    js = nc.jetstream(timeout=10.0)
    bus = Bus(nc, js)
    jobs = max(1, round(args.rate * args.step_s / RANKS))
    settings = DemoSettings(seconds=args.minutes * 60, seed=args.seed, jobs=jobs, step_s=args.step_s,
                            fault_every_s=args.fault_every_s)
    cluster = BuiltinCluster(bus, settings, prefix="soak")
    await bus.start(cluster)
    start = time.monotonic()
    end = start + args.minutes * 60
    next_kill = start + args.kill_every_s * (0.5 + rng.random())
    next_nats = start + args.nats_restart_every_s
    next_sample = start
    incarnation = 0
    try:
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                total = await asyncio.to_thread(daemon.events_total)
                if total is not None and daemon.proc is not None and daemon.proc.poll() is None:
                    soak.samples.append(Sample(now - start, daemon.rss_mb(), total, incarnation))
                next_sample += args.sample_s
            if now >= next_kill:
                daemon.stop(kill=True)
                soak.kills.append(now - start)
                daemon.start()
                incarnation += 1
                began = time.monotonic()
                await asyncio.to_thread(daemon.wait_ready, 300)
                status = await asyncio.to_thread(daemon.status)
                soak.restarts.append((now - start, time.monotonic() - began, int(status.get("replayed_records") or 0)))
                next_kill = time.monotonic() + args.kill_every_s * (0.5 + rng.random())
            if now >= next_nats:
                soak.nats_restarts.append(now - start)
                await outage.strike()
                next_nats = time.monotonic() + args.nats_restart_every_s
            await asyncio.sleep(0.05)  # the driver's tick: sampling and the schedule above
        cluster.calm()
        cluster.stop()
        await bus.flush(timeout=300)
        return list(bus.sent)
    finally:
        await bus.close()
        await nc.close()


@dataclass
class ReadBack:
    """The log read back whole, kept small: the hashes of the message ids stored (8 bytes each where the ids are
    tens: a 30-minute soak stores millions), the decisions it recorded and those an offline replay of its inputs
    derives (as (job, cause seq, index)), and the command stream's ids."""

    ids: set[int] = field(default_factory=set)
    recorded: list[tuple[str, int, int]] = field(default_factory=list)
    derived: set[tuple[str, int, int]] = field(default_factory=set)
    copies: list[str] = field(default_factory=list)


async def read_back(url: str) -> ReadBack:
    """Stream the log through a fresh engine (a 30-minute soak's millions of records are never held at once) and
    read the command stream's message ids (a command's is `<command id>@<node>`: one per command and node)."""
    nc = await nats.connect(url.split(","))
    out = ReadBack()
    engine = Engine()
    try:
        js = nc.jetstream(timeout=30.0)
        log = JetStreamLog(nc, js, "RECOVERY", owns_connection=False)
        async for record in log.read(1):
            ident = record.headers.get(MSG_ID)
            if ident:
                out.ids.add(hash(ident))
            if is_output(record.subject):
                if isinstance(record, Record) and record.envelope.type == "decision":
                    d = record.envelope.data
                    out.recorded.append((d.job, d.cause_seq, d.index))  # type: ignore[union-attr]
                continue
            for effect, _, _, _ in apply_encoded(engine, record):
                if isinstance(effect, Decision):
                    out.derived.add((effect.job, effect.cause_seq, effect.index))
        commands = JetStreamLog(nc, js, "RECOVERY_CMD", owns_connection=False)
        out.copies = [r.headers.get(MSG_ID, "") async for r in commands.read(1)]
        return out
    finally:
        await nc.close()


def run(args: argparse.Namespace, emit: Emit) -> None:
    soak = Soak()
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="recovery-soak-") as tmp:
        work = Path(tmp)
        with contextlib.ExitStack() as stack:
            if args.cluster > 1:
                cluster = NatsCluster(work / "nats", size=args.cluster)
                stack.callback(cluster.stop)
                cluster.start()
                outage = Outage(args, None, cluster)
            else:
                outage = Outage(args, stack.enter_context(nats_server(work / "nats")), None)
            daemon = stack.enter_context(Daemon(work / "daemon", outage.url, lease_ttl_s=0, replicas=args.cluster))
            daemon.start()
            daemon.wait_ready(120)
            sent = asyncio.run(soak_run(args, work, outage, daemon, soak))
            _wait_quiet(daemon)
            back = asyncio.run(read_back(outage.url))
    ids, copies = back.ids, back.copies
    lost = sum(1 for ident in sent if hash(ident) not in ids)
    doubled = len(copies) - len(set(copies))
    derived, recorded = back.derived, back.recorded
    emit(BENCH, "events_published", len(sent), "events")
    emit(BENCH, "events_lost", lost, "events")
    emit(BENCH, "commands", len(copies), "commands")
    emit(BENCH, "commands_doubled", doubled, "commands")
    emit(BENCH, "decisions_missing", len(derived - set(recorded)), "decisions")
    emit(BENCH, "decisions_extra", len(recorded) - len(set(recorded)) + len(set(recorded) - derived), "decisions")
    emit(BENCH, "daemon_kills", len(soak.kills), "kills")
    emit(BENCH, "nats_restarts", len(soak.nats_restarts), "restarts")
    if soak.restarts:
        ready = sorted(r[1] for r in soak.restarts)
        emit(BENCH, "restart_ready_s_p50", round(ready[len(ready) // 2], 2),
             "s from a SIGKILLed daemon's start to ready")
        emit(BENCH, "restart_ready_s_max", round(ready[-1], 2), "s")
        emit(BENCH, "restart_replayed_max", max(r[2] for r in soak.restarts), "inputs replayed past the snapshot")
    rates = _rates(soak.samples)
    if rates:
        values = sorted(r for _, r in rates)
        emit(BENCH, "events_per_s_p50", round(values[len(values) // 2], 1), "events/s")
        emit(BENCH, "events_per_s_min", round(values[0], 1), "events/s")
    if soak.samples:
        emit(BENCH, "rss_mb_max", round(max(s.rss_mb for s in soak.samples), 1), "MB")
        growth = _rss_growth(soak.samples, args.warmup_s)
        if growth is not None:
            emit(BENCH, "rss_growth_pct", round(growth, 1), "%")
    if args.csv:
        with open(args.csv, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["t_s", "rss_mb", "events_total", "incarnation"])
            writer.writerows([s.t_s, s.rss_mb, s.events_total, s.incarnation] for s in soak.samples)
    if args.png:
        draw(soak, rates, Path(args.png))


def _wait_quiet(daemon: Daemon, quiet_s: float = 5.0, timeout: float = 600.0) -> None:
    """Until the daemon's applied count stays put for `quiet_s` (everything published is applied)."""
    deadline = time.monotonic() + timeout
    last, since = daemon.events_total(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon never went quiet")
        time.sleep(0.5)  # sampling interval of a deadline-bounded wait
        now = daemon.events_total()
        if now != last:
            last, since = now, time.monotonic()


def _rates(samples: list[Sample]) -> list[tuple[float, float]]:
    """(time, inputs applied per second since the sample before), within one incarnation (a restarted daemon's
    counter starts again at zero)."""
    out = []
    for a, b in itertools.pairwise(samples):
        if a.incarnation == b.incarnation and b.t_s > a.t_s:
            out.append((b.t_s, (b.events_total - a.events_total) / (b.t_s - a.t_s)))
    return out


def _rss_growth(samples: list[Sample], warmup_s: float) -> float | None:
    """Growth of the longest-lived incarnation's RSS from the end of its warm-up to its last sample, in %."""
    lives: dict[int, list[Sample]] = {}
    for s in samples:
        lives.setdefault(s.incarnation, []).append(s)
    longest = max(lives.values(), key=lambda life: life[-1].t_s - life[0].t_s)
    warm = [s for s in longest if s.t_s - longest[0].t_s >= warmup_s]
    if len(warm) < 2:
        return None
    return 100 * (warm[-1].rss_mb - warm[0].rss_mb) / warm[0].rss_mb


def draw(soak: Soak, rates: list[tuple[float, float]], png: Path) -> None:
    """RSS and throughput over time as an SVG, then a PNG of it drawn by headless Chromium when there is one."""
    width, height, pad = 1000, 520, 60
    samples = soak.samples
    if not samples:
        return
    t_max = max(s.t_s for s in samples) or 1.0
    rss_max = max(s.rss_mb for s in samples) * 1.15
    rate_points = rates
    rate_max = max((r for _, r in rate_points), default=1.0) * 1.15 or 1.0

    def x(t: float) -> float:
        return pad + (width - 2 * pad) * t / t_max

    def panel(top: int, values: list[tuple[float, float]], top_value: float, colour: str, label: str) -> str:
        h = (height - 3 * pad) / 2

        def y(v: float) -> float:
            return top + h - h * v / top_value

        line = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in values)
        marks = "".join(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{top + h}" stroke="#c62828" '
                        f'stroke-dasharray="3,3"/>' for t in soak.kills)
        marks += "".join(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{top + h}" stroke="#1565c0" '
                         f'stroke-dasharray="6,3"/>' for t in soak.nats_restarts)
        return (f'<rect x="{pad}" y="{top}" width="{width - 2 * pad}" height="{h}" fill="none" stroke="#999"/>'
                f'{marks}<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>'
                f'<text x="{pad}" y="{top - 8}" font-size="14">{label}</text>'
                f'<text x="{pad - 6}" y="{top + 10}" font-size="11" text-anchor="end">{top_value:,.0f}</text>'
                f'<text x="{pad - 6}" y="{top + h}" font-size="11" text-anchor="end">0</text>')

    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
           + panel(pad, [(s.t_s, s.rss_mb) for s in samples], rss_max, "#2e7d32", "daemon RSS (MB)")
           + panel(int(pad * 2 + (height - 3 * pad) / 2), rate_points, rate_max, "#6a1b9a",
                   "inputs applied per second")
           + f'<text x="{width / 2}" y="{height - 12}" font-size="12" text-anchor="middle">seconds; red: daemon '
             f'SIGKILLed and restarted, blue: nats-server restarted; {t_max:,.0f} s in all</text></svg>')
    svg_path = png.with_suffix(".svg")
    svg_path.write_text(svg)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        note(f"no chromium: the figure is {svg_path}")  # stdout holds the figures alone
        return
    with tempfile.TemporaryDirectory(prefix="soak-chromium-") as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        f"--screenshot={png}", f"--window-size={width},{height}", svg_path.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    svg_path.unlink()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=5000.0, help="events per second the cluster publishes")
    parser.add_argument("--step-s", type=float, default=0.2, help="a job's step: sets how many jobs make --rate")
    parser.add_argument("--fault-every-s", type=float, default=2.0)
    parser.add_argument("--kill-every-s", type=float, default=120.0, help="mean time between daemon SIGKILLs")
    parser.add_argument("--nats-restart-every-s", type=float, default=300.0)
    parser.add_argument("--cluster", type=int, default=1, help="nats-servers in a cluster (streams and buckets at "
                                                                "that many replicas); the outage then SIGKILLs the "
                                                                "log stream's leader")
    parser.add_argument("--down-s", type=float, default=10.0, help="with --cluster: how long the killed server stays "
                                                                   "down")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--csv", help="write the samples here")
    parser.add_argument("--png", help="draw RSS and throughput over time here")

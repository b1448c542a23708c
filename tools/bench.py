#!/usr/bin/env python
"""Benchmarks of the recovery engine: `python tools/bench.py <bench> [--quick]`.

Every bench prints one JSON object per line on stdout, `{"bench", "metric", "value", "unit"}`;
diagnostics (workload summary, profiles) go to stderr.

    python tools/bench.py engine            # Engine.apply over an in-memory mix: events/s, bytes per rank
    python tools/bench.py replay            # recorder.replay(log.iter_file(path)) end to end: events/s
    python tools/bench.py engine --quick    # small sizes (the smoke test)
    python tools/bench.py engine --profile  # also a cProfile of one steady pass and a tracemalloc top, on stderr
    python tools/bench.py report            # recovery-replay report: 1,000,000 records and the 54-day simulation

The machine is shared (two cores, other work on them), so rates are timed by this process's CPU time
(`--clock wall` for elapsed time): the share of the cores the scheduler gives to other processes is not
counted, though their pressure on caches still is. Every rate is the median of `--repeat` runs, and each
comes with a baseline measured in the same process over the same items and interleaved with what it is
compared to: a plain loop doing two dict updates per record for `engine` (timed in alternation with the
engine, 20,000 records at a time), `orjson.loads` of the same lines for `replay` (timed before and after
each replay). `ratio_to_baseline` is the median of the per-run ratios rate / baseline rate: it moves much
less than the absolute rates between a busy machine and an idle one.

Metrics. engine: `events_per_s` (steady-state inputs applied per second, after the jobs were submitted),
`baseline_ops_per_s`, `ratio_to_baseline`, `bytes_per_rank` (tracemalloc: what the engine keeps alive per
tracked rank once every job's dedupe window is full), `events` and `non_progress_pct` (the mix).
replay: `events_per_s` (inputs per second, end to end: read, decode, apply), `records_per_s` (lines, with
the recorded decisions), `baseline_ops_per_s` (lines/s of `orjson.loads`), `ratio_to_baseline` (of lines/s).

The workload: `--jobs` jobs of 64 ranks on 8 nodes of 8 ranks (even jobs dp=8 tp=8, odd jobs dp=16 tp=4,
one in four elastic; every node joins before its job is submitted), a pool of spare nodes, and `--rounds`
rounds of one virtual second (one training step) each. Every round, every live rank reports its step (an
eighth of them also a heartbeat), due timers fire (the per-job watchdog every 2 s, debounce and ack
deadlines), nodes save in-memory checkpoints every third step and storage checkpoints every sixth, and
about 1% of the running jobs get a fault: process exits and hangs, NVIDIA XIDs 13 (restart in place), 48
and 79 (migrate to a spare), link and node flaps that clear, link downs that are confirmed and retried,
collective timeouts. A synthetic executor answers every command the engine sends (accepted at once; dying
checkpoint saved, processes started and done a round later) and faulty nodes are repaired and rejoin the
spare pool. The log is generated once by running the engine itself through a `Recorder`, so it holds
inputs and recorded decisions exactly as the daemon writes them; the benches then apply it to fresh
engines and check they derive the same number of effects.

New benches (`policies`, `daemon`, `report`, `e2e`, `soak`) register a parser and a runner in `BENCHES` below.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import linecache
import pstats
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# The benches, beside this script (`python tools/bench.py` puts tools/ on the path): each imports only the harness
# (`bench_harness*`), and where one bench's run takes in others' (e2e's cases, the daemon's failover and reports, the
# fleet's three cases), they are put together here.
import bench_compile
import bench_daemon
import bench_ddp
import bench_e2e
import bench_failover
import bench_faultfree
import bench_fleet
import bench_fleet_many
import bench_fleet_steady
import bench_formation
import bench_frameworks
import bench_gpu
import bench_memory
import bench_policy_calls
import bench_report
import bench_reports
import bench_sdk_overhead
import bench_sharded
import bench_soak
import bench_stock
import orjson
from bench_harness import emit, environment, note, sig, sigterm_unwinds
from bench_harness_workload import (
    CHUNK,
    NODES_PER_JOB,
    RANKS_PER_JOB,
    RANKS_PER_NODE,
    TICK_NS,
    Workload,
    apply_all,
    describe,
    generate,
)
from bench_harness_workload import interleaved as workload_interleaved

from events import subjects
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.values import JobSpec, Layout
from policies.base import NS
from recovery.core.engine import Engine
from recovery.core.job import DEDUPE_WINDOW
from recovery.log import EPOCH, MSG_ID, iter_file, write_file
from recovery.log.file import overruns_in_file
from recovery.log.recorder import replay
from recovery.sim import bench as sim_bench
from recovery.sim import storm as sim_storm

# -- measuring ---------------------------------------------------------------------------------------------
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]
"""what rates are measured against: this process's CPU time by default, so that the time the scheduler gives
to other work on a shared machine is not counted as ours (`--clock wall` for elapsed time)"""


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = clock()
    result = fn()
    return clock() - start, result


def interleaved(engine: Engine, records: list[Record]) -> tuple[float, float, int]:
    """The harness's `interleaved`, by the clock this run measures with."""
    return workload_interleaved(engine, records, CHUNK, clock)


def ready_engine(setup: list[Record]) -> Engine:
    engine = Engine()
    apply_all(engine, setup)
    return engine


def progress_only(jobs: int, rounds: int) -> Iterator[Record]:
    """Spares, submissions and `rounds` rounds of steps from every rank, made as they are consumed."""
    seq = 0
    ts = EPOCH

    def record(subject: str, envelope: EnvelopeBase) -> Record:
        nonlocal seq, ts
        seq += 1
        ts += TICK_NS
        return Record.model_construct(seq=seq, ts=ts, subject=subject, headers={MSG_ID: envelope.id},
                                      envelope=envelope)

    for i in range(jobs):
        job = f"job-{i:05d}"
        nodes = [f"node-{i * NODES_PER_JOB + n:06d}" for n in range(NODES_PER_JOB)]
        dp, tp = (8, 8) if i % 2 == 0 else (16, 4)
        spec = JobSpec(nodes=nodes, ranks_per_node=RANKS_PER_NODE, layout=Layout(dp=dp, tp=tp))
        for type_, data in (("job.submitted", {"spec": spec.model_dump()}), ("job.started", {})):
            yield record(subjects.job_event(job, type_),
                         make_envelope(type_, data, id=f"{job}/{seq}", job=job, source="scheduler"))
    for step in range(1, rounds + 1):
        ts = max(ts, EPOCH + step * NS)
        for i in range(jobs):
            job = f"job-{i:05d}"
            subject = subjects.job_event(job, "progress.step")
            for rank in range(RANKS_PER_JOB):
                envelope = make_envelope("progress.step", {"rank": rank, "step": step, "attempt": 0},
                                         id=f"{job}/r{rank}/{seq}", job=job,
                                         source=f"agent@node-{i * NODES_PER_JOB + rank // RANKS_PER_NODE:06d}")
                yield record(subject, envelope)


def engine_bytes(jobs: int, rounds: int, top: int = 0) -> int:
    """Bytes an engine keeps alive after `jobs` 64-rank jobs and `rounds` rounds of steps (tracemalloc).

    Records are made inside the traced region and dropped once applied, so the event ids, timestamps and
    specs the engine keeps from them are counted; the figure is what freeing the engine gives back."""
    gc.collect()
    tracemalloc.start()
    try:
        engine = Engine()
        for record in progress_only(jobs, rounds):
            engine.apply(record)
        del record
        gc.collect()
        with_engine = tracemalloc.get_traced_memory()[0]
        if top:
            snapshot = tracemalloc.take_snapshot()
        del engine
        gc.collect()
        without = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    if top:
        note(f"tracemalloc: the engine's {with_engine - without} bytes, top allocation sites:")
        for stat in snapshot.statistics("lineno")[:top]:
            frame = stat.traceback[0]
            line = linecache.getline(frame.filename, frame.lineno).strip()
            note(f"  {stat.size:>12,} B {stat.count:>9,} blocks  {frame.filename}:{frame.lineno}  {line}")
    return with_engine - without


def profile(fn: Callable[[], Any], top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    note(out.getvalue())


# -- benches -----------------------------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> Workload:
    started = time.perf_counter()
    workload = generate(args.jobs, args.rounds, args.seed)
    note(f"generated in {time.perf_counter() - started:.1f} s")
    return workload


def run_engine(args: argparse.Namespace) -> None:
    workload = _generate(args)
    events, share = describe(workload)
    setup, steady = workload.setup, workload.steady
    expected = workload.steady_effects()
    del workload
    gc.collect()
    gc.freeze()  # the prebuilt records are the bench's, not the engine's: keep them out of the collector's way
    rates: list[float] = []
    baselines: list[float] = []
    for _ in range(args.repeat):
        engine = ready_engine(setup)
        engine_s, baseline_s, effects = interleaved(engine, steady)
        rates.append(len(steady) / engine_s)
        baselines.append(len(steady) / baseline_s)
        if effects != expected:
            note(f"warning: the engine derived {effects} effects where the log recorded {expected}")
        del engine
    if args.profile:
        engine = ready_engine(setup)
        profile(partial(apply_all, engine, steady), args.profile)
        del engine
    gc.unfreeze()
    del setup, steady
    gc.collect()
    memory_rounds = DEDUPE_WINDOW // RANKS_PER_JOB + 1  # enough steps to fill each job's dedupe window
    started = time.perf_counter()
    per_rank = engine_bytes(args.jobs, memory_rounds, top=args.profile) / (args.jobs * RANKS_PER_JOB)
    note(f"memory measured in {time.perf_counter() - started:.1f} s")
    ratios = [r / b for r, b in zip(rates, baselines, strict=True)]
    note(f"engine events/s runs: {[round(r) for r in rates]}; baseline: {[round(b) for b in baselines]}; "
         f"ratios: {[round(r, 3) for r in ratios]}")
    emit("engine", "events_per_s", sig(statistics.median(rates)), "events/s")
    emit("engine", "baseline_ops_per_s", sig(statistics.median(baselines)), "records/s (dict-update loop)")
    emit("engine", "ratio_to_baseline", sig(statistics.median(ratios)), "x")
    emit("engine", "bytes_per_rank", sig(per_rank), "B/rank")
    emit("engine", "events", events, "events")
    emit("engine", "non_progress_pct", sig(share, 3), "%")


def orjson_baseline(path: Path) -> int:
    loads = orjson.loads
    lines = 0
    with open(path, "rb") as fh:
        for line in fh:
            loads(line)
            lines += 1
    return lines


def run_replay(args: argparse.Namespace) -> None:
    workload = _generate(args)
    describe(workload)
    records: list[Record | RawRecord] = list(workload.records)
    decisions = sum(1 for r in workload.records if r.envelope.type == "decision")
    del workload
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        path = Path(tmp) / "log.jsonl"
        lines = write_file(path, records)
        note(f"replay log: {lines} lines, {path.stat().st_size / 2**20:.1f} MiB")
        del records
        gc.collect()
        rates: list[float] = []
        line_rates: list[float] = []
        baselines: list[float] = []
        for _ in range(args.repeat):
            before, _ = timed(partial(orjson_baseline, path))
            seconds, result = timed(lambda: replay(iter_file(path), overruns=overruns_in_file(path)))
            after, _ = timed(partial(orjson_baseline, path))
            baselines.append(2 * lines / (before + after))  # the load around the run, not just before it
            rates.append(result.inputs / seconds)
            line_rates.append(lines / seconds)
            if len(result.decisions) != decisions or len(result.recorded_decisions) != decisions:
                note(f"warning: replay derived {len(result.decisions)} decisions and read "
                     f"{len(result.recorded_decisions)}, the log holds {decisions}")
            inputs = result.inputs
            del result
        if args.profile:
            profile(lambda: replay(iter_file(path), overruns=overruns_in_file(path)), args.profile)
    ratios = [r / b for r, b in zip(line_rates, baselines, strict=True)]
    note(f"replay events/s runs: {[round(r) for r in rates]}; orjson lines/s: {[round(b) for b in baselines]}; "
         f"ratios: {[round(r, 3) for r in ratios]}")
    emit("replay", "events_per_s", sig(statistics.median(rates)), "events/s")
    emit("replay", "records_per_s", sig(statistics.median(line_rates)), "lines/s")
    emit("replay", "baseline_ops_per_s", sig(statistics.median(baselines)), "lines/s (orjson.loads)")
    emit("replay", "ratio_to_baseline", sig(statistics.median(ratios)), "x")
    emit("replay", "events", inputs, "events")


# -- command line ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    jobs: int
    rounds: int
    repeat: int


def _workload_args(parser: argparse.ArgumentParser, full: Sizes, quick: Sizes) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes for a smoke test ({quick.jobs} jobs, {quick.rounds} rounds, "
                             f"{quick.repeat} runs)")
    parser.add_argument("--jobs", type=int, help=f"64-rank jobs (default {full.jobs})")
    parser.add_argument("--rounds", type=int, help=f"one-second rounds of the workload (default {full.rounds})")
    parser.add_argument("--repeat", type=int, help=f"timed runs; the median is reported (default {full.repeat})")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="time rates by this process's CPU time (default) or by elapsed wall time")
    parser.add_argument("--profile", type=int, nargs="?", const=10, default=0, metavar="N",
                        help="also print a cProfile (top N by own time) and a tracemalloc top on stderr")
    parser.set_defaults(full=full, quick_sizes=quick)


def _resolve(args: argparse.Namespace) -> None:
    sizes: Sizes = args.quick_sizes if args.quick else args.full
    args.jobs = args.jobs or sizes.jobs
    args.rounds = args.rounds or sizes.rounds
    args.repeat = args.repeat or sizes.repeat


# -- policies: ETTR and lost GPU-hours of our policies and the baselines (the simulator, recovery/sim) -------
POLICY_PROFILES = ("default", "torchelastic-like", "mindcluster-like")
"""`default-memory` too with `--profiles`: left out of the sweep to keep it within 20 minutes on two cores"""


def _policies_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="seeds per profile and case; medians are reported")
    parser.add_argument("--scales", "--gpus", dest="scales", type=int, nargs="+", default=[4_096, 16_384],
                        help="cluster sizes (GPUs): the rates sweep on the smallest, the others run the Llama 3 "
                             "rate")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 3.0, 10.0],
                        help="fault rates, in times the Llama 3 rate, swept on the smallest size")
    parser.add_argument("--mixes", nargs="+", default=["llama3", "dbe", "straggler", "latent"],
                        help="fault mixes: llama3 (the rates above), dbe (repeating double-bit ECC errors, at 3x), "
                             "straggler (slow nodes, at 3x on 1,024 GPUs for at most 14 days), latent (the Llama 3 "
                             "mix at 3x with latent bad devices, `default` with the agents' health checks and without)")
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--profiles", nargs="+", default=list(POLICY_PROFILES))
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1,024 GPUs for 7 days, one seed, 1x, and the latent case")


def run_policies(args: argparse.Namespace) -> None:
    """54 days per case and profile, medians over seeds (recovery/sim/bench.py)."""
    if args.quick:
        args.seeds, args.scales, args.days, args.rates, args.mixes = 1, [1_024], 7.0, [1.0], ["llama3", "latent"]
    sim_bench.main(args.seeds, args.scales, args.days, args.profiles, args.workers,
                   lambda metric, value, unit: emit("policies", metric, value, unit), note, rates=args.rates,
                   mixes=args.mixes)


# -- storm: every profile through fault storms at 1x, 10x and 30x, seed by seed (recovery/sim/storm.py) ---------
def _storm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=4_096)
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--rates", type=float, nargs="+", default=list(sim_storm.STORM_RATES),
                        help="fault rates, in times the Llama 3 rate (1.97e-5 per GPU-hour)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[17, 19, 23, 29],
                        help="seeds (the default ones were never used to tune the policies)")
    parser.add_argument("--profiles", nargs="+", default=list(sim_storm.STORM_PROFILES))
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")


def run_storm(args: argparse.Namespace) -> None:
    """ETTR by rate, seed and profile with each rate's median; the seeds where `default` failed its job or trailed
    another profile."""
    outcomes = sim_storm.sweep(args.gpus, args.days, args.rates, args.seeds, args.profiles, args.workers, note)
    note(sim_storm.table(outcomes))
    for metric, value, unit in sim_bench.metrics(outcomes, args.days):
        emit("storm", metric, value, unit)
    short = sim_storm.shortfalls(outcomes)
    emit("storm", "default.shortfalls", float(len(short)), f"of {len(outcomes) // max(len(args.profiles), 1)} "
         f"rate-seed pairs (a failed job, or a lower ETTR than another profile)")
    for line in short:
        note(f"  shortfall: {line}")


# -- daemon: the recovery-daemon process on a real nats-server (tools/bench_daemon.py) -----------------------
def run_daemon(args: argparse.Namespace) -> None:
    """Throughput, fault-to-command latency under load, restart-to-ready, RSS; the raw nats-py ceiling; a standby's
    failover (tools/bench_failover.py) and edge aggregation's saving (tools/bench_reports.py) on the same server."""
    parts = set(args.only or bench_daemon.PARTS)

    def beside(work: Path, url: str, events: int) -> None:
        if "failover" in parts:
            bench_failover.failover(work, url, emit)
        if "reports" in parts:
            bench_reports.measure(work, url, min(events, 200_000), emit)

    bench_daemon.run(args, emit, beside)


# -- report: recovery-replay report over a million records and the 54-day simulated run (tools/bench_report.py) ---
def run_report(args: argparse.Namespace) -> None:
    """CPU and wall seconds and peak memory of the postmortem report, each log in a process of its own."""
    bench_report.run(args, emit, note, generate)


# -- soak: the daemon for hours under load, faults, its own SIGKILLs and NATS restarts (tools/bench_soak.py) -------
def run_soak(args: argparse.Namespace) -> None:
    """The daemon for --minutes under load, faults, SIGKILLs and NATS restarts: losses, doubles, RSS, throughput."""
    bench_soak.run(args, emit)


# -- fleet: the control plane at a fleet's scale (tools/bench_fleet.py, bench_fleet_many.py, bench_fleet_steady.py) ---
def _fleet_args(parser: argparse.ArgumentParser) -> None:
    bench_fleet.add_arguments(parser)
    bench_fleet_many.add_arguments(parser)
    bench_fleet_steady.add_arguments(parser)


def run_fleet(args: argparse.Namespace) -> None:
    """One job of 131,072 GPUs (a), a fleet of 200,000 over three daemons and servers (b), a healthy fleet's log (c):
    simulated agents in processes of their own."""
    with sigterm_unwinds(), bench_fleet.workspace(args.keep_logs) as work:
        if args.only in (None, "job"):
            bench_fleet.run_job(args, work / "job", emit)
        if args.only in (None, "fleet"):
            bench_fleet_many.run_fleet(args, work / "fleet", emit)
        if args.only in (None, "steady"):
            bench_fleet_steady.run_steady(args, work / "steady", emit)


# -- e2e: a rank's fault on real processes, our stack against torchrun (tools/bench_e2e.py and its cases') ----------
def run_e2e(args: argparse.Namespace) -> None:
    """SIGKILL of a rank to the job's step completed again, by phase, cold, warm and under torchrun; SIGSTOP
    detection; the SDK's overhead; the stock, DDP, memory-tier, fault-free, frameworks' and FSDP cases."""
    bench_e2e.resolve(args)
    only = set(args.only)
    overhead = None
    with sigterm_unwinds(), bench_e2e.workspace(args) as workdir:
        recoveries = bench_e2e.measure(args, workdir)
        if "overhead" in only:
            overhead = bench_sdk_overhead.sdk_overhead(2 if args.quick else 30, workdir, environment())
        if "stock" in only:
            bench_stock.measure(args.repeat, workdir, emit, quick=args.quick)
        if "ddp" in only:
            bench_ddp.measure(args.repeat, workdir, emit, quick=args.quick)
        if "memory" in only:
            bench_memory.measure(workdir, emit, quick=args.quick)
        if "faultfree" in only:
            bench_faultfree.measure(args.repeat, workdir, emit, quick=args.quick)
        if "frameworks" in only:
            bench_frameworks.measure(args.repeat, workdir, emit, quick=args.quick)
        if "fsdp" in only:
            bench_frameworks.measure_fsdp(args.repeat, workdir, emit, quick=args.quick)
            bench_sharded.measure(args.repeat, workdir, emit, quick=args.quick)  # FSDP without a replica
    bench_e2e.report(emit, recoveries)
    if overhead is not None:
        bench_sdk_overhead.report(emit, overhead)


def run_policy_calls(args: argparse.Namespace) -> None:
    """A third-party policy's call through its worker process against the same call in-process."""
    bench_policy_calls.run(args, emit)


def _policy_calls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000, help="calls per run (the 131,072-rank view: 1/200 of them)")


def run_restart_cost(args: argparse.Namespace) -> None:
    """What a restart costs beyond the process: compiled code found again on the node and on a spare, and the
    store's part of forming the new generation at 16,384 ranks."""
    with sigterm_unwinds():
        bench_compile.measure(args, emit)
        bench_formation.measure(args, emit)


def run_formation(args: argparse.Namespace) -> None:
    with sigterm_unwinds():
        bench_formation.measure(args, emit)


def _restart_cost_args(p: argparse.ArgumentParser) -> None:
    bench_compile.add_arguments(p)
    bench_formation.add_arguments(p, shared=False)


def run_gpu(args: argparse.Namespace) -> None:
    """On a machine with an NVIDIA GPU: a warm standby's CUDA context, the in-memory tier's stall on GPU state, the
    SDK's NCCL abort and formation again."""
    bench_gpu.run(args, emit)


BENCHES: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None]]] = {
    "engine": ("Engine.apply over a prebuilt in-memory mix; bytes per tracked rank",
               lambda p: _workload_args(p, Sizes(1000, 12, 5), Sizes(10, 8, 2)), run_engine),
    "replay": ("recovery.log.replay(iter_file(path)) of a recorded JSONL log, end to end",
               lambda p: _workload_args(p, Sizes(1000, 6, 3), Sizes(10, 8, 2)), run_replay),
    "policy-calls": ("a third-party policy's call through its worker process against in-process, per family",
                     _policy_calls_args, run_policy_calls),
    "policies": ("ETTR and lost GPU-hours of our policies and the baselines over fault rates, sizes and mixes "
                 "(simulated)",
                 _policies_args, run_policies),
    "storm": ("ETTR of every profile through fault storms at 1x, 10x and 30x the Llama 3 rate, by seed, with "
              "medians; where the default fails its job or trails (simulated)", _storm_args, run_storm),
    "daemon": ("recovery-daemon on nats-server: throughput, fault-to-command latency, restart-to-ready, RSS",
               bench_daemon.add_arguments, run_daemon),
    "report": ("recovery-replay report over 1,000,000 records and the 54-day 16,384-GPU simulated log: time, memory",
               bench_report.add_arguments, run_report),
    "e2e": ("a rank's SIGKILL to the job's step completed again, by phase, against torchrun; SIGSTOP detection; "
            "SDK overhead", bench_e2e.add_arguments, run_e2e),
    "fleet": ("the control plane at a fleet's scale over real NATS, agents simulated in processes of their own: "
              "fault-to-command p99 and daemon CPU for a 131,072-GPU job", _fleet_args, run_fleet),
    "restart-cost": ("a restarted rank's first compiled step with the job's compile caches kept by the agent, on "
                     "its node and on a spare, against empty caches; the formation of 16,384 ranks on the job's store",
                     _restart_cost_args, run_restart_cost),
    "formation": ("the store requests of 16,384 ranks' init_process_group on the job's torch store against torch's "
                  "own TCPStore server, by phase", bench_formation.add_arguments, run_formation),
    "gpu": ("on an NVIDIA GPU: a warm standby's CUDA context, the in-memory tier's stall on GPU tensors against "
            "torch.save, NCCL's abort and formation again in process", bench_gpu.add_arguments, run_gpu),
    "soak": ("the daemon for --minutes under load with faults, its own SIGKILLs and NATS restarts: events lost, "
             "commands doubled, RSS and throughput over time (--png)", bench_soak.add_arguments, run_soak),
}
"""name -> (help, add arguments, run). `policies`, `daemon`, `report`, `e2e` and `soak` are added here."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (help_, add_arguments, run) in BENCHES.items():
        bench_parser = sub.add_parser(name, help=help_)
        add_arguments(bench_parser)
        bench_parser.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> None:
    global clock
    args = build_parser().parse_args(argv)
    clock = CLOCKS[getattr(args, "clock", "cpu")]
    if hasattr(args, "quick_sizes"):
        _resolve(args)
    args.run(args)


if __name__ == "__main__":
    main()

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

New benches (`policies`, `daemon`, `report`, `e2e`) register a parser and a runner in `BENCHES` below.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import linecache
import pstats
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import bench_daemon  # beside this script (`python tools/bench.py` puts tools/ on the path)
import bench_e2e
import bench_report
import orjson

from events import subjects
from events.commands import CommandBase, MigrateRanks, RestartJob, RestartRanks, SaveCheckpoint, ScaleJob
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.outputs import Decision
from events.values import STORAGE_HOLDER, Elastic, JobSpec, Layout, Tier
from policies.base import NS
from recovery.core.engine import Effect, Engine
from recovery.core.job import DEDUPE_WINDOW
from recovery.log import EPOCH, MSG_ID, Appended, iter_file, write_file
from recovery.log.recorder import Recorder, replay
from recovery.sim import bench as sim_bench

RANKS_PER_NODE = 8
NODES_PER_JOB = 8
RANKS_PER_JOB = RANKS_PER_NODE * NODES_PER_JOB
TICK_NS = 100
"""log time between two consecutive records: a round of a million records still fits in its second"""
PROGRESS = frozenset({"progress.step", "process.heartbeat"})
CHUNK = 20_000
"""records per turn when the engine and its baseline are timed in alternation"""


# -- output ------------------------------------------------------------------------------------------------
def emit(bench: str, metric: str, value: float, unit: str) -> None:
    line = orjson.dumps({"bench": bench, "metric": metric, "value": value, "unit": unit})
    sys.stdout.write(line.decode() + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _sig(value: float, digits: int = 4) -> float:
    """Round to a few significant digits: medians of noisy rates carry no more."""
    return float(f"{value:.{digits}g}")


# -- the workload ------------------------------------------------------------------------------------------
class ListLog:
    """A `SyncLog` for the Recorder that keeps `Record`s built with `model_construct` in a list: the same
    records a MemoryLog would store (an envelope is a valid model already, so its JSON round trip is the
    identity), without paying for the encode/decode on every append."""

    def __init__(self, start_ns: int) -> None:
        self.now = start_ns
        self.records: list[Record] = []

    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended:
        if not isinstance(payload, EnvelopeBase):
            raise TypeError("the workload sends envelopes only")
        self.now += TICK_NS
        seq = len(self.records) + 1
        record = Record.model_construct(seq=seq, ts=self.now, subject=subject,
                                        headers={**(headers or {}), MSG_ID: payload.id}, envelope=payload)
        self.records.append(record)
        return Appended(seq, False, record)


FAULTS: tuple[tuple[str, int], ...] = (
    ("exit", 25), ("hang", 8), ("xid13", 10), ("xid48", 6), ("xid79", 6), ("link_flap", 15),
    ("link_down", 10), ("node_flap", 10), ("collective", 10),
)
REPAIR_ROUNDS = 5
LINK_DOWN_ROUNDS = 15  # longer than the 10 s debounce: confirmed, then retried


@dataclass
class Workload:
    """The generated log and where its steady part (after spares joined and jobs started) begins."""

    records: list[Record]
    setup_end: int
    jobs: int
    ranks: int
    rejections: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)

    @property
    def setup(self) -> list[Record]:
        return [r for r in self.records[: self.setup_end] if not subjects.is_output(r.subject)]

    @property
    def steady(self) -> list[Record]:
        return [r for r in self.records[self.setup_end :] if not subjects.is_output(r.subject)]

    def steady_effects(self) -> int:
        """Decisions and rejections the recorded steady part holds: what a replay must derive again."""
        return sum(1 for r in self.records[self.setup_end :] if subjects.is_output(r.subject))


class Generator:
    """Drives a real engine through a Recorder, reading its state and decisions back to script the cluster."""

    def __init__(self, jobs: int, seed: int, fault_rate: float) -> None:
        self.log = ListLog(EPOCH)
        self.recorder = Recorder(self.log, Engine())
        self.engine = self.recorder.engine
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        self.job_ids = [f"job-{i:05d}" for i in range(jobs)]
        self.spares = [f"spare-{i:04d}" for i in range(max(2, jobs // 20))]
        self.round = 0
        self._n = 0
        self._accept: list[CommandBase] = []
        self._answer: list[CommandBase] = []
        self._later: dict[int, list[tuple[str, str, str, dict[str, Any]]]] = {}
        self.rejections: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()

    # -- sending ---------------------------------------------------------------------------------------
    def _send(self, subject: str, envelope: EnvelopeBase) -> None:
        for effect in self.recorder.feed(subject, envelope):
            self._observe(effect)

    def _observe(self, effect: Effect) -> None:
        if not isinstance(effect, Decision):
            self.rejections[effect.code] += 1
            return
        self.decisions[effect.kind] += 1
        self._accept.extend(effect.commands)
        self._n += len(effect.timers)  # the event ids count timers too, as they always have: the same workload

    def job_event(self, job: str, type_: str, data: dict[str, Any], source: str = "agent") -> None:
        self._n += 1
        envelope = make_envelope(type_, data, id=f"{job}/{self._n}", job=job, source=source)
        self._send(subjects.job_event(job, type_), envelope)

    def node_event(self, node: str, type_: str, data: dict[str, Any]) -> None:
        self._n += 1
        envelope = make_envelope(type_, data, id=f"{node}/{self._n}", node=node, source=f"probe@{node}")
        self._send(subjects.node_event(node, type_), envelope)

    def _event(self, scope: str, target: str, type_: str, data: dict[str, Any]) -> None:
        if scope == "job":
            self.job_event(target, type_, data)
        else:
            self.node_event(target, type_, data)

    def later(self, rounds: int, scope: str, target: str, type_: str, data: dict[str, Any]) -> None:
        self._later.setdefault(self.round + rounds, []).append((scope, target, type_, data))

    # -- phases ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        for i, job_id in enumerate(self.job_ids):
            nodes = [f"node-{i * NODES_PER_JOB + n:06d}" for n in range(NODES_PER_JOB)]
            for node in nodes:
                self.node_event(node, "node.joined", {"spare": False, "devices": RANKS_PER_NODE})
            dp, tp = (8, 8) if i % 2 == 0 else (16, 4)
            elastic = Elastic(min_dp=dp // 2, max_dp=dp) if i % 4 == 1 else None
            spec = JobSpec(nodes=nodes, ranks_per_node=RANKS_PER_NODE, layout=Layout(dp=dp, tp=tp),
                           elastic=elastic, spares=2)
            self.job_event(job_id, "job.submitted", {"spec": spec.model_dump()}, source="scheduler")
            self.job_event(job_id, "job.started", {}, source="scheduler")
        for node in self.spares:
            self.node_event(node, "node.joined", {"spare": True, "devices": RANKS_PER_NODE})
        self._flush_accepts()

    def run_round(self) -> None:
        self.round += 1
        self.log.now = max(self.log.now, EPOCH + self.round * NS)
        self._fire_timers(self.log.now)
        self._answer_commands()
        for scope, target, type_, data in self._later.pop(self.round, []):
            self._event(scope, target, type_, data)
        self._flush_accepts()
        self._inject_faults()
        self._flush_accepts()
        self._progress()
        self._flush_accepts()
        self._checkpoints()

    def _fire_timers(self, now: int) -> None:
        timers = self.recorder.timers
        while (due := timers.next_at()) is not None and due <= now:
            firing = timers.take()
            if firing is None:
                continue  # cancelled, or a period already fired
            if firing.every is not None:
                self._n += 1  # counted in the event ids, as it always was
            self.job_event(firing.job, "timer.fired", {"timer_id": firing.timer_id, "due": firing.due},
                           source="timers")

    def _flush_accepts(self) -> None:
        while self._accept:
            commands, self._accept = self._accept, []
            for command in commands:
                self.job_event(command.job, "command.ack", {"command_id": command.id, "status": "accepted"},
                               source="executor")
            self._answer.extend(commands)

    def _answer_commands(self) -> None:
        """A well-behaved executor, a round after the command: save, start processes, then ack done."""
        commands, self._answer = self._answer, []
        for command in commands:
            job = self.engine.jobs[command.job]
            if isinstance(command, SaveCheckpoint):
                self.job_event(command.job, "checkpoint.saved",
                               {"step": command.step, "tier": Tier.DYING, "holder": STORAGE_HOLDER,
                                "shards": list(range(job.layout.shards))})
            elif isinstance(command, RestartRanks | MigrateRanks | RestartJob | ScaleJob):
                ranks = command.ranks if isinstance(command, RestartRanks | MigrateRanks) else range(job.world)
                for rank in ranks:
                    self.job_event(command.job, "process.started",
                                   {"rank": rank, "pid": 10_000 + rank, "attempt": command.attempt})
            self.job_event(command.job, "command.ack", {"command_id": command.id, "status": "done"},
                           source="executor")

    def _inject_faults(self) -> None:
        running = [j for j in self.job_ids
                   if self.engine.jobs[j].state == "running" and self.engine.jobs[j].incident is None]
        count = min(len(running), max(1, round(self.fault_rate * len(self.job_ids))))
        kinds_, weights = zip(*FAULTS, strict=True)
        for job_id in self.rng.sample(running, count):
            job = self.engine.jobs[job_id]
            rank = self.rng.randrange(job.world)
            node = job.nodes[rank // job.rpn]
            device = rank % job.rpn
            gen = job.generation
            kind = self.rng.choices(kinds_, weights)[0]
            if kind == "exit":
                self.job_event(job_id, "process.exited", {"rank": rank, "exit_code": 1, "attempt": gen})
            elif kind == "hang":
                self.job_event(job_id, "process.hang",
                               {"rank": rank, "seconds_without_progress": 30.0, "attempt": gen})
            elif kind in ("xid13", "xid48", "xid79"):
                self.node_event(node, "device.fault", {"device": device, "vendor": "nvidia", "code": kind[3:]})
                if kind != "xid13":
                    self.later(REPAIR_ROUNDS, "node", node, "device.recovered", {"device": device})
                    self.later(REPAIR_ROUNDS, "node", node, "node.joined", {"spare": True,
                                                                            "devices": RANKS_PER_NODE})
            elif kind in ("link_flap", "link_down"):
                self.node_event(node, "network.link_down", {"link": "mlx5_0", "switch": "leaf-1"})
                self.later(1 if kind == "link_flap" else LINK_DOWN_ROUNDS, "node", node, "network.link_up",
                           {"link": "mlx5_0"})
            elif kind == "node_flap":
                self.node_event(node, "node.not_ready", {"reason": "kubelet stopped posting status"})
                self.later(1, "node", node, "node.ready", {})
            else:
                group = rank - rank % RANKS_PER_NODE
                members = list(range(group, min(group + RANKS_PER_NODE, job.world)))
                self.job_event(job_id, "network.collective_timeout",
                               {"group": f"dp{group}", "members": members,
                                "reporters": [r for r in members if r != rank], "timeout_s": 600.0})

    def _progress(self) -> None:
        """Every live rank of a running job reports its next step; during a recovery they only heartbeat."""
        for job_id in self.job_ids:
            job = self.engine.jobs[job_id]
            state = job.phase or job.state
            if state in ("running", "restoring"):
                step: int | None = job.step + 1
                type_ = "progress.step"
            elif state in ("planning", "settling", "saving", "stopping", "rescheduling", "waiting"):
                step, type_ = None, "process.heartbeat"
            else:
                continue
            rpn = job.rpn
            sources = [f"agent@{n}" for n in job.nodes]
            subject = subjects.job_event(job_id, type_)
            beat = subjects.job_event(job_id, "process.heartbeat")
            for rank in range(job.world):
                if not job.alive[rank]:
                    continue
                gen = job.generation  # a restore that completes mid-round does not change it
                self._n += 1
                data = {"rank": rank, "step": step, "attempt": gen}
                envelope = make_envelope(type_, data, id=f"{job_id}/r{rank}/{self._n}", job=job_id,
                                         source=sources[rank // rpn])
                self._send(subject, envelope)
                if type_ == "progress.step" and (rank + self.round) % 8 == 0:
                    self._n += 1
                    envelope = make_envelope("process.heartbeat", data, id=f"{job_id}/r{rank}/{self._n}",
                                             job=job_id, source=sources[rank // rpn])
                    self._send(beat, envelope)

    def _checkpoints(self) -> None:
        memory, storage = self.round % 3 == 1, self.round % 6 == 2
        if not (memory or storage):
            return
        for job_id in self.job_ids:
            job = self.engine.jobs[job_id]
            if job.state != "running" or job.incident is not None:
                continue
            shards = job.layout.shards
            if memory:
                for index, node in enumerate(job.nodes):
                    held = sorted({r % shards for r in range(index * job.rpn, (index + 1) * job.rpn)})
                    self.job_event(job_id, "checkpoint.saved",
                                   {"step": job.step, "tier": Tier.MEMORY, "holder": node, "shards": held},
                                   source=f"agent@{node}")
            if storage:
                self.job_event(job_id, "checkpoint.saved",
                               {"step": job.step, "tier": Tier.STORAGE, "holder": STORAGE_HOLDER,
                                "shards": list(range(shards))}, source="checkpointer")


def generate(jobs: int, rounds: int, seed: int = 7, fault_rate: float = 0.01) -> Workload:
    gen = Generator(jobs, seed, fault_rate)
    gen.setup()
    setup_end = len(gen.log.records)
    for _ in range(rounds):
        gen.run_round()
    ranks = sum(j.world for j in gen.engine.jobs.values())
    return Workload(gen.log.records, setup_end, jobs, ranks, gen.rejections, gen.decisions)


def describe(workload: Workload) -> tuple[int, float]:
    """Log a summary of the workload on stderr; return the steady input count and its non-progress share."""
    steady = workload.steady
    types = Counter(r.envelope.type for r in steady)
    other = sum(n for t, n in types.items() if t not in PROGRESS)
    share = 100.0 * other / max(1, len(steady))
    note(f"workload: {workload.jobs} jobs, {len(workload.setup)} setup inputs, {len(steady)} steady inputs "
         f"({share:.2f}% not heartbeat/progress), {len(workload.records)} records with decisions")
    note("  inputs: " + ", ".join(f"{t}={n}" for t, n in types.most_common()))
    note("  decisions: " + ", ".join(f"{k}={n}" for k, n in workload.decisions.most_common()))
    if workload.rejections:
        note("  rejections: " + ", ".join(f"{k}={n}" for k, n in workload.rejections.most_common()))
    return len(steady), share


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


def dict_baseline(records: list[Record]) -> int:
    """The cheapest fold over the records a Python engine could do: two dict updates per record."""
    latest: dict[tuple[str | None, str], int] = {}
    seen: dict[str, int] = {}
    for record in records:
        envelope = record.envelope
        latest[(envelope.job or envelope.node, envelope.type)] = record.ts
        seen[envelope.id] = record.seq
    return len(seen)


def apply_all(engine: Engine, records: list[Record]) -> int:
    apply = engine.apply
    effects = 0
    for record in records:
        effects += len(apply(record))
    return effects


def interleaved(engine: Engine, records: list[Record], chunk: int = CHUNK) -> tuple[float, float, int]:
    """Seconds the engine and the dict baseline take over `records`, timed chunk by chunk in turn so that
    both see the same load on a shared machine; and the number of effects the engine returned."""
    gc.collect()
    engine_s = baseline_s = 0.0
    effects = 0
    for start in range(0, len(records), chunk):
        part = records[start : start + chunk]
        t0 = clock()
        dict_baseline(part)
        t1 = clock()
        effects += apply_all(engine, part)
        t2 = clock()
        baseline_s += t1 - t0
        engine_s += t2 - t1
    return engine_s, baseline_s, effects


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
    emit("engine", "events_per_s", _sig(statistics.median(rates)), "events/s")
    emit("engine", "baseline_ops_per_s", _sig(statistics.median(baselines)), "records/s (dict-update loop)")
    emit("engine", "ratio_to_baseline", _sig(statistics.median(ratios)), "x")
    emit("engine", "bytes_per_rank", _sig(per_rank), "B/rank")
    emit("engine", "events", events, "events")
    emit("engine", "non_progress_pct", _sig(share, 3), "%")


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
            seconds, result = timed(lambda: replay(iter_file(path)))
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
            profile(lambda: replay(iter_file(path)), args.profile)
    ratios = [r / b for r, b in zip(line_rates, baselines, strict=True)]
    note(f"replay events/s runs: {[round(r) for r in rates]}; orjson lines/s: {[round(b) for b in baselines]}; "
         f"ratios: {[round(r, 3) for r in ratios]}")
    emit("replay", "events_per_s", _sig(statistics.median(rates)), "events/s")
    emit("replay", "records_per_s", _sig(statistics.median(line_rates)), "lines/s")
    emit("replay", "baseline_ops_per_s", _sig(statistics.median(baselines)), "lines/s (orjson.loads)")
    emit("replay", "ratio_to_baseline", _sig(statistics.median(ratios)), "x")
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
    parser.add_argument("--mixes", nargs="+", default=["llama3", "dbe"],
                        help="fault mixes: llama3 (the rates above), dbe (repeating double-bit ECC errors, at 3x)")
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--profiles", nargs="+", default=list(POLICY_PROFILES))
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 1,024 GPUs for 7 days, one seed, 1x")


def run_policies(args: argparse.Namespace) -> None:
    """54 days per case and profile, medians over seeds (recovery/sim/bench.py)."""
    if args.quick:
        args.seeds, args.scales, args.days, args.rates, args.mixes = 1, [1_024], 7.0, [1.0], ["llama3"]
    sim_bench.main(args.seeds, args.scales, args.days, args.profiles, args.workers,
                   lambda metric, value, unit: emit("policies", metric, value, unit), note, rates=args.rates,
                   mixes=args.mixes)


# -- daemon: the recovery-daemon process on a real nats-server (tools/bench_daemon.py) -----------------------
def run_daemon(args: argparse.Namespace) -> None:
    """Throughput, fault-to-command latency under load, restart-to-ready, RSS; the raw nats-py ceiling."""
    bench_daemon.run(args, emit)


# -- report: recovery-replay report over a million records and the 54-day simulated run (tools/bench_report.py) ---
def run_report(args: argparse.Namespace) -> None:
    """CPU and wall seconds and peak memory of the postmortem report, each log in a process of its own."""
    bench_report.run(args, emit, note, generate)


# -- e2e: a rank's fault on real processes, our stack against torchrun (tools/bench_e2e.py) ----------------------
def run_e2e(args: argparse.Namespace) -> None:
    """SIGKILL of a rank to the job's step completed again, by phase, cold, warm and under torchrun; SIGSTOP
    detection; the SDK's overhead."""
    bench_e2e.run(args, emit)


BENCHES: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None]]] = {
    "engine": ("Engine.apply over a prebuilt in-memory mix; bytes per tracked rank",
               lambda p: _workload_args(p, Sizes(1000, 12, 5), Sizes(10, 8, 2)), run_engine),
    "replay": ("recovery.log.replay(iter_file(path)) of a recorded JSONL log, end to end",
               lambda p: _workload_args(p, Sizes(1000, 6, 3), Sizes(10, 8, 2)), run_replay),
    "policies": ("ETTR and lost GPU-hours of our policies and the baselines over fault rates, sizes and mixes "
                 "(simulated)",
                 _policies_args, run_policies),
    "daemon": ("recovery-daemon on nats-server: throughput, fault-to-command latency, restart-to-ready, RSS",
               bench_daemon.add_arguments, run_daemon),
    "report": ("recovery-replay report over 1,000,000 records and the 54-day 16,384-GPU simulated log: time, memory",
               bench_report.add_arguments, run_report),
    "e2e": ("a rank's SIGKILL to the job's step completed again, by phase, against torchrun; SIGSTOP detection; "
            "SDK overhead", bench_e2e.add_arguments, run_e2e),
}
"""name -> (help, add arguments, run). `policies`, `daemon`, `report` and `e2e` are added here."""


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

"""The workload of `python tools/bench.py engine` and `replay` (and the million-record log of `report`): jobs of 64
ranks reporting steps, heartbeats and checkpoints round by round, faults of every class, and a synthetic executor
answering every command, generated once by running the engine itself through a `Recorder` (see `bench.py`'s
docstring for the mix)."""

from __future__ import annotations

import gc
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench_harness import note

from events import subjects
from events.commands import CommandBase, MigrateRanks, RestartJob, RestartRanks, SaveCheckpoint, ScaleJob
from events.envelope import EnvelopeBase, Record, make_envelope
from events.outputs import Decision
from events.values import STORAGE_HOLDER, Elastic, JobSpec, Layout, Tier
from policies.base import NS
from recovery.core.engine import Effect, Engine
from recovery.log import EPOCH, MSG_ID, Appended
from recovery.log.recorder import Recorder

RANKS_PER_NODE = 8
NODES_PER_JOB = 8
RANKS_PER_JOB = RANKS_PER_NODE * NODES_PER_JOB
TICK_NS = 100
"""log time between two consecutive records: a round of a million records still fits in its second"""
PROGRESS = frozenset({"progress.step", "process.heartbeat"})
CHUNK = 20_000
"""records per turn when the engine and its baseline are timed in alternation"""


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


# -- measuring the engine against its baseline (the bench, and the test suite's guard) -------------------
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


def chunk_times(engine: Engine, records: list[Record], chunk: int = CHUNK,
                clock: Callable[[], float] = time.process_time) -> tuple[list[tuple[float, float]], int]:
    """Seconds the dict baseline and the engine take over each chunk of `records`, timed in turn so that both see
    the same load on a shared machine; and the number of effects the engine returned."""
    gc.collect()
    times: list[tuple[float, float]] = []
    effects = 0
    for start in range(0, len(records), chunk):
        part = records[start : start + chunk]
        t0 = clock()
        dict_baseline(part)
        t1 = clock()
        effects += apply_all(engine, part)
        t2 = clock()
        times.append((t1 - t0, t2 - t1))
    return times, effects


def interleaved(engine: Engine, records: list[Record], chunk: int = CHUNK,
                clock: Callable[[], float] = time.process_time) -> tuple[float, float, int]:
    """Seconds the engine and the dict baseline take over `records` (`chunk_times`, summed); and the number of
    effects the engine returned."""
    times, effects = chunk_times(engine, records, chunk, clock)
    return sum(e for _, e in times), sum(b for b, _ in times), effects

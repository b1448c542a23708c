"""The simulator: the world, the real engine and a timer service on one virtual clock.

Exactly what `recovery.testing.Scenario` does, at cluster scale: every event the world emits is appended to a
`MemoryLog` (or `FileLog`) whose clock is the simulator's, applied by `recovery.core.engine.Engine` through a
`recovery.log.Recorder`, and every decision is recorded after it. Timers the decisions ask for are fired from
the recorder's `TimerTable` as `timer.fired` job events at their due time (periodic ones again at
`recovery.core.timers.next_due`), in one order with the world's own actions, and the commands go to the world's
executors. The log is a replay log: `recovery-replay verify` and `timeline` work on it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from events import subjects
from events.commands import CommandBase
from events.envelope import EnvelopeBase, make_envelope
from events.names import TimerPurpose
from events.outputs import Decision, Rejection
from recovery.core.engine import Engine
from recovery.core.job import Job
from recovery.core.timers import TimerTable
from recovery.log import EPOCH, CountingLog, FileLog, MemoryLog, Recorder, write_file
from recovery.plugins import DEFAULT_BUDGET_S, PolicyWorkers
from recovery.sim.accounting import CAUSES, STATE_LABEL, FaultOutcome, Ledger, Result
from recovery.sim.config import NS, SimConfig
from recovery.sim.faults import Fault, FaultMix, draw_faults, read_trace
from recovery.sim.world import World

OUTCOMES = {"attempt.failed": "failed", "attempt.timed_out": "timed_out", "attempt.superseded": "superseded"}


def faults_for(config: SimConfig) -> list[Fault]:
    """The run's faults: the trace if one is given, else drawn from the mix for the run's seed."""
    if config.trace_path is not None:
        horizon = config.horizon_ns
        return [f for f in read_trace(config.trace_path) if f.at_ns < horizon]
    mix = FaultMix.load(config.mix_path)
    cl = config.cluster
    return draw_faults(mix, gpus=cl.gpus, positions=cl.nodes, devices=cl.gpus_per_node,
                       horizon_ns=config.horizon_ns, seed=config.seed, rate_per_gpu_hour=config.rate_per_gpu_hour,
                       durations=config.durations)


class _Recording(Recorder):
    """The simulator's recorder: decisions are recorded and accounted for, commands wait for the record to be
    done (an executor's reply must come after every decision the record made)."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__(sim.log, sim.engine, TimerTable(sim._order))
        self.sim = sim
        self.commands: list[CommandBase] = []

    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        super().decided(decision, subject, envelope, data)
        self.sim.decisions += 1
        if decision.kind == "policy.failed":
            self.sim.policy_failures += 1
        self.sim._observe(decision)

    def commanded(self, command: CommandBase, decision: Decision) -> None:
        self.commands.append(command)

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        super().rejected(rejection, subject, envelope, data)
        rejections = self.sim.rejections
        rejections[rejection.code] = rejections.get(rejection.code, 0) + 1


class Simulator:
    progress: Callable[[str], None] | None = None
    """told a line on the run's progress every `progress_every_s` of the machine's time (`python -m recovery.sim run`
    prints it on stderr): a long run, or one a policy keeps busy, shows where it is"""
    progress_every_s = 10.0

    def __init__(self, config: SimConfig, log: MemoryLog | FileLog | None = None,
                 faults: list[Fault] | None = None, policy_budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.cfg = config
        self._now = EPOCH
        self.log = log if log is not None else MemoryLog(clock=self._clock)
        self.log._clock = self._clock
        self.engine = Engine()
        # Third-party policies run as the daemon runs them: a call past its budget is abandoned, and a fact in the log.
        self.policy_workers = PolicyWorkers(policy_budget_s)
        self.engine.policy_calls = self.policy_workers
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count(1)  # one order for the world's actions and the timers due at the same time
        self.recorder = _Recording(self)
        self.timers = self.recorder.timers
        self.ledger = Ledger(EPOCH)
        self.world = World(config, self, self._deliver, start_ns=EPOCH)
        self.world.strike = self._inject  # a latent bad device's fault is one of the run's, counted as the mix's are
        self.faults = faults if faults is not None else faults_for(config)
        self.events = 0
        self.engine_seconds = 0.0
        """wall-clock time spent in Recorder.feed: the log appends, Engine.apply and recording decisions"""
        self.decisions = 0
        self.rejections: dict[str, int] = {}
        self.policy_failures = 0  # a plugin's errors or loops the built-in answered for (`policy.failed`)
        self.restarts: dict[str, dict[str, int]] = {}
        self.outcomes: list[FaultOutcome] = []
        self._open: list[FaultOutcome] = []
        self.landed_on_bad = 0
        self.check_added_s: list[float] = []
        self.end = EPOCH + config.horizon_ns
        self._watchdog = f"{config.job}/{TimerPurpose.WATCHDOG}/"

    # -- the clock and the scheduler ------------------------------------------------------------------
    def _clock(self) -> int:
        return self._now

    @property
    def now(self) -> int:
        return self._now

    def at(self, when: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self._now), next(self._order), action))

    # -- the engine in the loop -----------------------------------------------------------------------
    def _deliver(self, subject: str, envelope: EnvelopeBase) -> None:
        recorder = self.recorder
        started = time.perf_counter()
        recorder.feed(subject, envelope)
        self.engine_seconds += time.perf_counter() - started
        self.events += 1
        if recorder.commands:
            commands, recorder.commands = recorder.commands, []
            for command in commands:
                if command.kind != "dump_stacks":  # simulated processes have no stacks to take; none is awaited
                    self.world.execute(command)
        self._relabel()

    def _observe(self, decision: Decision) -> None:
        kind = decision.kind
        if kind == "attempt.started":
            g = str(decision.detail.get("granularity"))
            counts = self.restarts.setdefault(g, {})
            counts["started"] = counts.get("started", 0) + 1
        elif kind in OUTCOMES:
            g = str(decision.detail.get("granularity", "?"))
            counts = self.restarts.setdefault(g, {})
            counts[OUTCOMES[kind]] = counts.get(OUTCOMES[kind], 0) + 1
        elif kind == "incident.closed":
            g = str(decision.detail.get("granularity"))
            counts = self.restarts.setdefault(g, {})
            counts["recovered"] = counts.get("recovered", 0) + 1
            for outcome in self._open:
                outcome.recovered_s = (self._now - EPOCH) / NS
            self._open = []
            landed, added_ns = self.world.recovered()
            self.landed_on_bad += landed
            if self.cfg.agents.health_checks:
                self.check_added_s.append(added_ns / NS)

    def _relabel(self) -> None:
        if self._now < EPOCH:  # the cluster's history, before the job: no time of the job's to book
            return
        label = self.world.busy_label
        if label is None:
            job = self.engine.jobs.get(self.cfg.job)
            label = STATE_LABEL.get((job.phase or job.state) if job is not None else "submitted", "detection")
        self.ledger.label(self._now, label)

    def _inject(self, fault: Fault) -> None:
        if self.world.inject(fault):
            outcome = FaultOutcome(fault.index, fault.component, fault.signal, (self._now - EPOCH) / NS)
            self.outcomes.append(outcome)
            self._open.append(outcome)

    # -- running --------------------------------------------------------------------------------------
    def run(self) -> Result:
        started = time.perf_counter()
        self._recall()
        self.world.start()
        self._relabel()
        for fault in self.faults:
            self.at(EPOCH + fault.at_ns, partial(self._inject, fault))
        heap, timers, end = self._heap, self.timers, self.end
        turns, report_at = 0, started + self.progress_every_s
        while True:
            turns += 1
            if self.progress is not None and not turns & 255 and time.perf_counter() >= report_at:
                self.progress(self.progress_line(time.perf_counter() - started))
                report_at = time.perf_counter() + self.progress_every_s
            timer = timers.peek()
            if heap and (timer is None or heap[0][0] < timer[0] or (heap[0][0] == timer[0] and heap[0][1] < timer[1])):
                if heap[0][0] > end:
                    break
                when, _, action = heapq.heappop(heap)
                self._now = when
                action()
            elif timer is not None:
                if timer[0] > end:
                    break
                self._now = max(self._now, timer[0])
                firing = timers.take()
                if firing is not None and self.cfg.watch_s and firing.timer_id.startswith(self._watchdog):
                    self.world.report_progress()  # the agents' reports of the period come before the tick
                if firing is not None:  # else cancelled, or a period already fired
                    self.world.job_event("timer.fired", {"timer_id": firing.timer_id, "due": firing.due},
                                         source="timers")
            else:
                break
            self._relabel()
            if self.world.failed:
                break
        self._now = self.end
        self.world.finish(self.end)
        self._relabel()
        self.ledger.close(self.end)
        return self._result(time.perf_counter() - started)

    def _recall(self) -> None:
        """The cluster's history (`SimConfig.history`, `recovery.sim.history`): each node event at its recorded
        offset before the start, to the engine alone, before the job is submitted."""
        for past in self.cfg.history:
            self._now = EPOCH - past.before_ns
            self.world.node_event(past.node, past.kind, dict(past.data), source=past.source)
        self._now = EPOCH

    def progress_line(self, seconds: float) -> str:
        """Where the run is: the simulated day, the ETTR so far (training booked so far, and the interval under way
        when it is training, over the time simulated), faults, recoveries, restarts and decisions."""
        elapsed = self._now - EPOCH
        ledger = self.ledger
        training = self.world.counters.productive + (self._now - ledger.since if ledger.current == "train" else 0)
        ettr = training / elapsed if elapsed > 0 else 1.0
        recovered = sum(counts.get("recovered", 0) for counts in self.restarts.values())
        started = sum(counts.get("started", 0) for counts in self.restarts.values())
        return (f"sim: day {elapsed / NS / 86_400:.1f} of {self.cfg.days:g}, ETTR {ettr:.3f} so far, "
                f"{len(self.outcomes)} faults, {recovered} incidents recovered, {started} restarts, "
                f"{self.decisions:,} decisions, {self.policy_failures} policy failures ({seconds:.0f} s)")

    def _result(self, seconds: float) -> Result:
        totals = dict(self.ledger.totals)
        c = self.world.counters
        train = totals.pop("train", 0)
        if train != c.productive + c.recompute + c.checkpoint + c.straggler:
            raise AssertionError(f"training time {train} ns is not productive {c.productive} + recompute "
                                 f"{c.recompute} + checkpoint {c.checkpoint} + straggler {c.straggler}")
        totals["recompute"] = totals.get("recompute", 0) + c.recompute
        totals["checkpoint"] = totals.get("checkpoint", 0) + c.checkpoint
        totals["straggler"] = totals.get("straggler", 0) + c.straggler
        lost = {cause: totals.pop(cause, 0) / NS for cause in CAUSES}
        if totals:
            raise AssertionError(f"time booked under unknown labels: {totals}")
        job = self.engine.jobs.get(self.cfg.job)
        result = Result(
            profile=self.cfg.profile.name,
            policies=dict(job.policies.labels) if job is not None else {},
            seed=self.cfg.seed, gpus=self.cfg.cluster.gpus, days=self.cfg.days,
            wall_s=(self.end - EPOCH) / NS, productive_s=c.productive / NS,
            lost_s=lost,
            faults=self.outcomes, restarts=dict(sorted(self.restarts.items())), events=self.events,
            decisions=self.decisions, rejections=dict(sorted(self.rejections.items())),
            policy_failures=self.policy_failures,
            records=self._records(), job_state=_job_state(job),
            steps=self.world.high_water, sim_seconds=seconds, engine_seconds=self.engine_seconds,
            stats=dict(sorted(self.world.stats.items())),
            landed_on_bad=self.landed_on_bad, check_added_s=self.check_added_s,
        )
        result.check()
        return result

    def _records(self) -> int:
        if isinstance(self.log, MemoryLog):
            return self.log._count
        return self.log._last_seq

    def write_log(self, path: str | Path) -> int:
        """Write the run's log (a MemoryLog) as a replay JSONL export."""
        if not isinstance(self.log, MemoryLog):
            raise TypeError("the run logs to a file already")
        return write_file(path, list(self.log.records()))


def simulate(config: SimConfig, log_path: str | Path | None = None,
             progress: Callable[[str], None] | None = None, progress_every_s: float = 10.0) -> Result:
    """Run one simulation; with `log_path`, also write its log in the replay format (as it goes). Without one,
    the run keeps no log in memory. `progress` is told a line on the run's progress every `progress_every_s`."""
    log: FileLog | CountingLog
    if log_path is None:
        log = CountingLog()
    else:
        Path(log_path).unlink(missing_ok=True)
        log = FileLog(log_path)
    sim = Simulator(config, log=log)
    sim.progress, sim.progress_every_s = progress, progress_every_s
    try:
        return sim.run()
    finally:
        sim.policy_workers.close()
        if isinstance(log, FileLog):
            log.close_sync()


def event(type_: str, data: dict[str, object], *, id: str, job: str | None = None,
          node: str | None = None) -> tuple[str, EnvelopeBase]:
    """A subject and envelope for one input event (job-scoped if `job`, else node-scoped)."""
    if job is not None:
        return subjects.job_event(job, type_), make_envelope(type_, data, id=id, job=job)
    assert node is not None
    return subjects.node_event(node, type_), make_envelope(type_, data, id=id, node=node)


def _job_state(job: Job | None) -> str:
    """The job's state at the end, with the phase of a recovery still open (`recovering (waiting)`)."""
    if job is None:
        return "?"
    return f"{job.state} ({job.phase})" if job.phase else job.state

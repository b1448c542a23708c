"""A time-skipping harness: the engine, a log and a timer service on a virtual clock.

Policy authors and our own tests script a cluster with it: submit a job, send heartbeats, inject a
fault, acknowledge commands, and `advance` time, which fires every timer that falls due on the way
exactly as the daemon's timer service would, at its due time. Hour-long timeouts take microseconds.
The log it writes is a real replay log (inputs and recorded decisions), so `recovery-replay verify`
and `timeline` work on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from events import subjects
from events.commands import CommandBase, SaveCheckpoint
from events.envelope import EnvelopeBase, make_envelope
from events.kinds import JOB_EVENTS
from events.outputs import Decision, Rejection
from events.values import STORAGE_HOLDER, JobSpec, Layout, Tier
from policies.base import NS
from recovery.core.engine import Effect, Engine
from recovery.log import EPOCH, FileLog, MemoryLog
from recovery.log.recorder import Recorder
from recovery.plugins import DEFAULT_BUDGET_S, PolicyWorkers


class _Recording(Recorder):
    """The scenario's recorder: what it records, the scenario also keeps, to be read back by the test."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario.log, scenario.engine)
        self.scenario = scenario

    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        super().decided(decision, subject, envelope, data)
        self.scenario.decisions.append(decision)
        self.scenario._counter += len(decision.timers)  # the ids it makes count timers as well, as they always did

    def commanded(self, command: CommandBase, decision: Decision) -> None:
        self.scenario.commands[command.id] = command

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        super().rejected(rejection, subject, envelope, data)
        self.scenario.rejections.append(rejection)


class Scenario:
    def __init__(self, log: MemoryLog | FileLog | None = None, start_ns: int = EPOCH,
                 policy_budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.now = start_ns
        self.log = log if log is not None else MemoryLog(clock=self._clock)
        if isinstance(self.log, MemoryLog | FileLog):
            self.log._clock = self._clock
        self.engine = Engine()
        # Third-party policies run as the daemon runs them, where a call that never returns is abandoned after
        # `policy_budget_s` (of the machine's time, not the scenario's) and written into the log as a fact.
        self.policy_workers = PolicyWorkers(policy_budget_s)
        self.engine.policy_calls = self.policy_workers
        self.decisions: list[Decision] = []
        self.rejections: list[Rejection] = []
        self.commands: dict[str, CommandBase] = {}
        self._counter = 0
        self.recorder = _Recording(self)
        self.timers = self.recorder.timers

    def _clock(self) -> int:
        return self.now

    def _id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    # -- sending ----------------------------------------------------------------------------------------
    def send(self, subject: str, payload: EnvelopeBase | bytes) -> list[Effect]:
        return self.recorder.feed(subject, payload)

    def job_event(self, job: str, type_: str, event_id: str | None = None, **data: Any) -> list[Effect]:
        envelope = make_envelope(type_, data, id=event_id or self._id(type_), job=job, source="scenario")
        return self.send(subjects.job_event(job, type_), envelope)

    def node_event(self, node: str, type_: str, event_id: str | None = None, **data: Any) -> list[Effect]:
        envelope = make_envelope(type_, data, id=event_id or self._id(type_), node=node, source="scenario")
        return self.send(subjects.node_event(node, type_), envelope)

    def event(self, type_: str, target: str, **data: Any) -> list[Effect]:
        if type_ in JOB_EVENTS:
            return self.job_event(target, type_, **data)
        return self.node_event(target, type_, **data)

    # -- conveniences -----------------------------------------------------------------------------------
    def submit(self, job: str, nodes: list[str], ranks_per_node: int, dp: int, tp: int = 1, pp: int = 1,
               start: bool = True, fsdp: bool = False, **spec: Any) -> list[Effect]:
        job_spec = JobSpec(nodes=nodes, ranks_per_node=ranks_per_node, layout=Layout(dp=dp, tp=tp, pp=pp, fsdp=fsdp),
                           **spec)
        effects = self.job_event(job, "job.submitted", spec=job_spec.model_dump())
        if start:
            effects += self.job_event(job, "job.started")
        return effects

    def spare(self, node: str, devices: int = 8, pool: str | None = None) -> list[Effect]:
        """`node` joins the spare pool `pool` (None: the shared one)."""
        data: dict[str, Any] = {"spare": True, "devices": devices}
        if pool is not None:
            data["pool"] = pool
        return self.node_event(node, "node.joined", **data)

    def steps(self, job: str, step: int, ranks: Iterable[int] | None = None, attempt: int | None = None) -> None:
        """Every listed rank (default: all) reports `step` completed."""
        state = self.engine.jobs[job]
        gen = state.generation if attempt is None else attempt
        for rank in range(state.world) if ranks is None else ranks:
            self.job_event(job, "progress.step", rank=rank, step=step, attempt=gen)

    def train(self, job: str, steps: int, step_time_s: float = 1.0, ranks: Iterable[int] | None = None) -> None:
        """Advance `steps` steps of `step_time_s` each, all (or the listed) ranks reporting every step."""
        state = self.engine.jobs[job]
        chosen = list(range(state.world) if ranks is None else ranks)
        for _ in range(steps):
            self.advance(step_time_s)
            self.steps(job, state.step + 1, chosen)

    def idle(self, job: str, seconds: float, ranks: Iterable[int] | None = None) -> None:
        """Let `seconds` pass while the job's live ranks (or the listed ones) heartbeat once a second
        without progress: time passes for a fault's debounce without the watchdog seeing silence."""
        state = self.engine.jobs[job]
        for _ in range(round(seconds)):
            self.advance(1)
            chosen = [r for r in range(state.world) if state.alive[r]] if ranks is None else list(ranks)
            for rank in chosen:
                self.job_event(job, "process.heartbeat", rank=rank, attempt=state.generation)

    def checkpoint(self, job: str, step: int, tier: Tier | str, holder: str, shards: Iterable[int] | None = None
                   ) -> list[Effect]:
        state = self.engine.jobs[job]
        shard_list = list(range(state.layout.shards) if shards is None else shards)
        return self.job_event(job, "checkpoint.saved", step=step, tier=Tier(tier), shards=shard_list, holder=holder)

    def outstanding(self, kind: str | None = None) -> list[CommandBase]:
        """Commands whose attempt is still waiting on them, oldest first."""
        pending: list[CommandBase] = []
        for job in self.engine.jobs.values():
            attempt = job.incident.attempt if job.incident is not None else None
            if attempt is not None:
                pending += [self.commands[c] for c in attempt.pending if c in self.commands]
        return [c for c in pending if kind is None or getattr(c, "kind", None) == kind]

    def ack(self, command: CommandBase | str, status: str = "done", reason: str = "", node: str | None = None
            ) -> list[Effect]:
        """Acknowledge `command`: as one executor for the whole command, or (with `node`) as that node's agent,
        one of several the command is addressed to."""
        cmd = self.commands[command] if isinstance(command, str) else command
        result = {} if node is None else {"node": node}
        return self.job_event(cmd.job, "command.ack", command_id=cmd.id, status=status, reason=reason, result=result)

    def complete(self, command: CommandBase) -> list[Effect]:
        """Play a well-behaved executor: a dying checkpoint is saved (to storage) before its ack."""
        effects: list[Effect] = []
        if isinstance(command, SaveCheckpoint):
            effects += self.checkpoint(command.job, command.step, Tier.DYING, STORAGE_HOLDER)
        return effects + self.ack(command)

    def ack_all(self, rounds: int = 10) -> list[Effect]:
        """Complete outstanding commands until none is left (executors that always succeed)."""
        effects: list[Effect] = []
        for _ in range(rounds):
            pending = self.outstanding()
            if not pending:
                break
            for command in pending:
                effects += self.complete(command)
        return effects

    # -- time -------------------------------------------------------------------------------------------
    def advance(self, seconds: float) -> list[Effect]:
        """Move virtual time forward, firing every timer that falls due on the way, at its due time."""
        end = self.now + int(seconds * NS)
        return self.run_until(end)

    def run_until(self, end: int) -> list[Effect]:
        effects: list[Effect] = []
        timers = self.timers
        while (next_at := timers.next_at()) is not None and next_at <= end:
            firing = timers.take()
            if firing is None:
                continue  # cancelled, or a period already fired
            self.now = max(self.now, next_at)  # its due time, or when a refused firing is sent again
            if firing.every is not None:
                self._counter += 1  # a periodic timer is armed again: counted in the ids, as it always was
            effects += self.job_event(firing.job, "timer.fired", timer_id=firing.timer_id, due=firing.due)
        self.now = max(self.now, end)
        return effects

    # -- reading ----------------------------------------------------------------------------------------
    def state(self, job: str) -> str:
        """The job's lifecycle state: submitted, running, recovering, paused, completed, failed or cancelled."""
        return self.engine.jobs[job].state

    def phase(self, job: str) -> str | None:
        """The phase of the job's recovery under way, or None while no incident is open."""
        return self.engine.jobs[job].phase

    def kinds(self, job: str | None = None) -> list[str]:
        return [d.kind for d in self.decisions if job is None or d.job == job]

    def find(self, kind: str, job: str | None = None) -> list[Decision]:
        return [d for d in self.decisions if d.kind == kind and (job is None or d.job == job)]

    def commands_of(self, kind: str) -> list[Any]:
        return [c for d in self.decisions for c in d.commands if c.kind == kind]

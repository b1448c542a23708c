"""The engine: a pure function of the log.

`Engine.apply(record)` reads only the record and the engine's state and returns effects: decisions
(each with its commands and timers) and rejections. It never reads a clock (log time is the record's
`ts`), never does I/O, and iterates only in log order or sorted order, so a replay of the same log
gives the same decisions byte for byte under any PYTHONHASHSEED.
"""

from __future__ import annotations

import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from events import kinds
from events.codec import DecodeError, decode_envelope
from events.commands import (
    FailJob,
    IsolateDevice,
    IsolateNode,
    MigrateRanks,
    RestartJob,
    RestartRanks,
    RetryStep,
    SaveCheckpoint,
    ScaleJob,
    StopRanks,
)
from events.envelope import EnvelopeBase, RawRecord, Record
from events.kinds import JOB_EVENTS, NODE_EVENTS
from events.outputs import Decision, Rejection, TimerRequest
from events.subjects import is_output, job_event, node_event
from events.values import FaultClass, Granularity, Layout, ResumePlan, Tier
from policies.base import (
    NS,
    CheckpointContext,
    RankActivity,
    RescheduleContext,
    Signal,
    Verdict,
    WatchdogView,
    label,
)
from policies.detection import DefaultDetection
from policies.registry import PolicyError, load_set
from recovery.core.cluster import ClusterView
from recovery.core.job import CLOSED_INCIDENTS, DEDUPE_WINDOW, Attempt, Incident, Job, Memento
from recovery.core.machine import FINAL, TRANSITIONS, fire
from recovery.core.timers import next_due

Effect = Decision | Rejection
_T = TypeVar("_T")
G = Granularity
_PROGRESS = ("process.heartbeat", "progress.step")
NODE_DEDUPE_WINDOW = 65_536
FINISHED_JOBS_KEPT = 256
"""completed, failed and cancelled jobs kept for `recovery-ctl` and late events; older ones are forgotten (the log
keeps everything), so that a daemon running for months does not grow with every job it ever saw. A constant, not
a setting: a replay must forget exactly what the daemon forgot."""
STEP_LEAD = 1000
"""how far one rank's step may run ahead of every other rank's before it is taken as a corrupted counter: ranks of
a job train in lockstep, a few steps apart at most (asynchronous schemes such as local SGD, a few hundred)"""
MAX_PLANS_PER_RECORD = 16
"""a record that would ask the rescheduling policy more often than this (each answer superseded at once) makes the
job wait instead: a policy and a cluster that keep refusing each other must not loop"""
_RESTARTS = (G.IN_PLACE, G.MIGRATE, G.RESTART_JOB, G.SCALE_IN, G.SCALE_OUT)


class _Reject(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Out:
    """Effects of one record, with the counters that make command ids and decision indexes (made on first
    use: most records, the heartbeats and steps, decide nothing)."""

    __slots__ = ("commands", "decisions", "effects", "plans", "seq", "ts")

    def __init__(self, seq: int, ts: int) -> None:
        self.seq = seq
        self.ts = ts
        self.plans = 0  # rescheduling decisions asked for within this record: bounded by MAX_PLANS_PER_RECORD
        self.effects: list[Effect] = []
        self.commands: dict[str, int] | None = None
        self.decisions: dict[str, int] | None = None

    def command_id(self, job: str) -> str:
        if self.commands is None:
            self.commands = {}
        index = self.commands.get(job, 0)
        self.commands[job] = index + 1
        return f"{job}:{self.seq}:{index}"

    def index(self, job: str) -> int:
        if self.decisions is None:
            self.decisions = {}
        index = self.decisions.get(job, 0)
        self.decisions[job] = index + 1
        return index


class Engine:
    def __init__(self) -> None:
        self.cluster = ClusterView()
        self.jobs: dict[str, Job] = {}
        self.timers: dict[str, tuple[str, int, int | None]] = {}  # id -> (job, due, every), in request order
        self.last_seq = 0
        self._node_seen: OrderedDict[str, None] = OrderedDict()
        self._order: dict[str, int] = {}  # job id -> submission index: the order of self.jobs
        self._hungry: dict[str, None] = {}  # every job that _hungry() holds for, and maybe some it no longer does
        self._finished: dict[str, None] = {}  # jobs in a final state, in the order they got there
        self._submissions = 0  # jobs ever accepted: the next one's place in _order (forgotten jobs leave gaps)
        self._hardware = DefaultDetection()  # judges device faults on nodes no job runs on
        self._undo: _Undo | None = None  # the journal of the record being applied, if it changes anything
        self._last: tuple[_Undo | None, Record | RawRecord, EnvelopeBase] | None = None  # for revoke()

    def __getstate__(self) -> dict[str, Any]:
        # The journal and the last record are about the record just applied, not the engine's state: a
        # snapshot leaves them out (and the envelope models made at import time do not pickle).
        return {**self.__dict__, "_undo": None, "_last": None}

    # -- entry point ----------------------------------------------------------------------------------
    def apply(self, record: Record | RawRecord) -> list[Effect]:
        """Apply one log record; return its effects. Bad input becomes a Rejection and changes nothing.

        So does a record whose handling fails half way (a bug, a policy that raises, a value that cannot be
        encoded): everything the record changed is undone from the journal and the record is dead-lettered, so
        that one poisoned record never stops the daemon nor leaves a job half changed."""
        self.last_seq = record.seq
        self._undo = self._last = None
        if is_output(record.subject):
            return []  # our own decisions and dead letters, kept in the log for audit
        if isinstance(record, RawRecord):
            decoded = decode_envelope(record.data)
            if isinstance(decoded, DecodeError):
                return [self._rejection(record, decoded.code, decoded.reason, decoded.event_id,
                                        decoded.job, decoded.node)]
            envelope: EnvelopeBase = decoded
        else:
            envelope = record.envelope
        out = _Out(record.seq, record.ts)
        try:
            self._dispatch(out, record.subject, envelope)
            effects = out.effects
            if effects:
                _check_encodable(effects)
        except _Reject as exc:
            self._rollback()
            return [self._rejection(record, exc.code, exc.reason, envelope.id, envelope.job, envelope.node)]
        except Exception as exc:  # a bug must not stop the daemon; it is kept, with its cause, in the log
            self._rollback()
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return [self._rejection(record, "internal_error",
                                    f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})",
                                    envelope.id, envelope.job, envelope.node)]
        undo = self._undo
        if undo is not None:  # most heartbeats and steps never open one
            self.cluster.journal = None
            for job, _ in undo.jobs.values():
                job.end_journal()  # the record succeeded: later changes are not its to undo
            self._undo = None
        if effects:
            self._last = (undo, record, envelope)  # what revoke() needs should its effects not encode
        if len(self._finished) > FINISHED_JOBS_KEPT:
            self._forget_finished()  # after the record, never while its handlers walk the jobs
        return effects

    def revoke(self, reason: str) -> Rejection:
        """Undo the record applied last, whose effects could not be written (the caller's encoding failed): it
        becomes a rejection, as if the engine had refused it. Only valid right after `apply`."""
        if self._last is None:
            raise RuntimeError("revoke() follows an apply() that returned effects")
        undo, record, envelope = self._last
        self._undo, self._last = undo, None
        self._rollback()
        return self._rejection(record, "unencodable", reason, envelope.id, envelope.job, envelope.node)

    # -- the journal: what a record changed, to undo it -----------------------------------------------
    def _guard(self, job: Job | None) -> _Undo:
        """Open the journal for this record (most heartbeats and steps never do) and note `job` in it."""
        undo = self._undo
        if undo is None:
            undo = self._undo = _Undo(self)
            self.cluster.journal = undo.nodes
        if job is not None and job.id not in undo.jobs:
            undo.jobs[job.id] = (job, job.memento())
        return undo

    def _touch(self, job: Job) -> None:
        undo = self._undo
        if undo is not None and job.id not in undo.jobs:
            undo.jobs[job.id] = (job, job.memento())

    def _note_timer(self, timer_id: str, removing: bool = False) -> None:
        undo = self._undo
        if undo is None:
            return
        if timer_id not in undo.timers:
            undo.timers[timer_id] = self.timers.get(timer_id)
        if removing and undo.timer_order is None:
            undo.timer_order = list(self.timers)  # a removed timer comes back at its place, not at the end

    def _note_indexes(self) -> None:
        undo = self._undo
        if undo is not None and undo.hungry is None:
            undo.hungry, undo.finished = dict(self._hungry), dict(self._finished)

    def _rollback(self) -> None:
        undo = self._undo
        self._undo = None
        if undo is None:
            return
        self.cluster.journal = None
        for job, memento in undo.jobs.values():
            job.restore(memento)
        if undo.created is not None:
            self.jobs.pop(undo.created, None)
            self._order.pop(undo.created, None)
            self._submissions = undo.submissions
        self.cluster.rollback(undo.nodes)
        for timer_id, before in undo.timers.items():
            if before is None:
                self.timers.pop(timer_id, None)
            else:
                self.timers[timer_id] = before
        if undo.timer_order is not None:
            self.timers = {timer_id: self.timers[timer_id] for timer_id in undo.timer_order}
        if undo.hungry is not None and undo.finished is not None:
            self._hungry, self._finished = undo.hungry, undo.finished
        if undo.seen is not None:
            seen, event_id, evicted = undo.seen
            seen.pop(event_id, None)
            if evicted is not None:  # put the evicted id back in front, where the window's oldest is
                rest = list(seen)
                seen.clear()
                seen[evicted] = None
                seen.update(dict.fromkeys(rest))

    def _forget_finished(self) -> None:
        while len(self._finished) > FINISHED_JOBS_KEPT:
            job_id = next(iter(self._finished))
            del self._finished[job_id]
            job = self.jobs.pop(job_id)
            self._order.pop(job_id, None)
            self._hungry.pop(job_id, None)
            for timer_id in self._job_timers(job):  # none are left by a final state; this keeps it so
                del self.timers[timer_id]

    @staticmethod
    def _rejection(record: Record | RawRecord, code: str, reason: str, event_id: str | None,
                   job: str | None, node: str | None) -> Rejection:
        return Rejection(seq=record.seq, subject=record.subject, code=code, reason=reason, event_id=event_id,
                         job=job, node=node)

    def _dispatch(self, out: _Out, subject: str, env: EnvelopeBase) -> None:
        type_ = env.type
        if type_ in JOB_EVENTS:
            if env.job is None:
                raise _Reject("schema_violation", f"{type_} is a job event but the envelope names no job")
            if subject != job_event(env.job, type_):
                raise _Reject("subject_mismatch", f"{type_} for job {env.job} arrived on {subject!r}, "
                                                  f"expected {job_event(env.job, type_)!r}")
            job = self.jobs.get(env.job)
            if type_ == "job.submitted":
                if job is not None:
                    raise _Reject("duplicate", f"job {env.job} was already submitted")
                self._submit(out, env.job, env.data)
                return
            if job is None:
                raise _Reject("unknown_job", f"{type_} for job {env.job}, which was never submitted")
            seen = job.seen
            if env.id in seen:
                raise _Reject("duplicate", f"event id {env.id!r} already applied to job {env.job}")
            if type_ in _PROGRESS:
                if job.state == "restoring":
                    self._guard(job)  # progress past the resume point closes the incident
                self._progress(out, job, env.data)
            else:
                self._guard(job)
                self._job_event(out, job, type_, env.data)
            if self._undo is None:  # the hot path: Engine._remember without the journal
                seen[env.id] = None
                if len(seen) > DEDUPE_WINDOW:
                    del seen[next(iter(seen))]
            else:
                self._remember(seen, env.id, DEDUPE_WINDOW)
        elif type_ in NODE_EVENTS:
            if env.node is None:
                raise _Reject("schema_violation", f"{type_} is a node event but the envelope names no node")
            if subject != node_event(env.node, type_):
                raise _Reject("subject_mismatch", f"{type_} for node {env.node} arrived on {subject!r}, "
                                                  f"expected {node_event(env.node, type_)!r}")
            if env.id in self._node_seen:
                raise _Reject("duplicate", f"event id {env.id!r} already applied")
            self._guard(None)
            self._node_event(out, env.node, type_, env.data)
            self._remember(self._node_seen, env.id, NODE_DEDUPE_WINDOW)
        else:
            raise _Reject("unknown_type", f"{type_} is not an input event")

    def _remember(self, seen: dict[str, None], event_id: str, window: int) -> None:
        """Note an applied event id for deduplication, once its record has succeeded."""
        seen[event_id] = None
        evicted = None
        if len(seen) > window:
            evicted = next(iter(seen))
            del seen[evicted]
        if self._undo is not None:
            self._undo.seen = (seen, event_id, evicted)

    # -- decisions ------------------------------------------------------------------------------------
    def _decide(self, out: _Out, job: Job, kind: str, reason: str, *, trigger: str | None = None,
                policy: str | None = None, commands: list[Any] | None = None,
                timers: list[TimerRequest] | None = None, cancelled: list[str] | None = None,
                detail: dict[str, Any] | None = None) -> None:
        previous = job.state
        if trigger is not None and previous != _DEST.get(trigger):
            fire(job, trigger)
        incident = job.incident.id if job.incident is not None else None
        out.effects.append(Decision(
            job=job.id, cause_seq=out.seq, index=out.index(job.id), kind=kind, previous=previous,
            state=job.state, incident=incident, policy=policy, reason=reason, commands=commands or [],
            timers=timers or [], cancelled_timers=cancelled or [], detail=detail or {},
        ))
        if _hungry(job):  # every change of state goes through here
            self._note_indexes()
            self._hungry[job.id] = None
        if job.state in FINAL and previous not in FINAL:
            self._note_indexes()
            self._finished[job.id] = None

    def _timer(self, out: _Out, job: Job, purpose: str, after_ns: int, every: int | None = None) -> TimerRequest:
        timer_id = f"{job.id}/{purpose}/{out.seq}"
        if after_ns < 0 or (every is not None and every <= 0):
            raise _Reject("invalid_timer", f"timer {timer_id} would fire after {after_ns} ns every {every} ns")
        due = out.ts + after_ns
        self._note_timer(timer_id)
        self.timers[timer_id] = (job.id, due, every)
        return TimerRequest(id=timer_id, due=due, every=every)

    def _cancel(self, *timer_ids: str | None) -> list[str]:
        gone = []
        for timer_id in timer_ids:
            if timer_id is not None and timer_id in self.timers:
                self._note_timer(timer_id, removing=True)
            if timer_id is not None and self.timers.pop(timer_id, None) is not None:
                gone.append(timer_id)
        return gone

    def _job_timers(self, job: Job) -> list[str]:
        return [t for t, (owner, _, _) in self.timers.items() if owner == job.id]

    # -- lifecycle ------------------------------------------------------------------------------------
    def _submit(self, out: _Out, job_id: str, data: kinds.JobSubmitted) -> None:
        spec = data.spec
        try:
            policies = load_set(spec.policies)
        except PolicyError as exc:
            raise _Reject("invalid_policy", str(exc)) from exc
        for name in spec.nodes:
            node = self.cluster.nodes.get(name)
            if node is not None and node.job is not None:
                raise _Reject("placement_conflict", f"node {name} already runs job {node.job}")
            if node is not None and node.isolated:
                raise _Reject("placement_conflict", f"node {name} is isolated")
        job = Job(job_id, spec, policies)
        undo = self._guard(None)
        undo.created, undo.submissions = job_id, self._submissions
        self.jobs[job_id] = job
        self._order[job_id] = self._submissions
        self._submissions += 1
        for name in spec.nodes:
            self.cluster.assign(name, job_id)
        self._decide(out, job, "job.accepted", f"{spec.layout.world} ranks on {len(spec.nodes)} nodes",
                     detail={"policies": dict(policies.labels)})

    def _job_event(self, out: _Out, job: Job, type_: str, data: Any) -> None:
        if job.state in FINAL and type_ != "checkpoint.saved":
            raise _Reject("invalid_state", f"job {job.id} is {job.state}; {type_} has no effect")
        if type_ == "job.started":
            if job.state != "submitted":
                raise _Reject("invalid_state", f"job {job.id} is already {job.state}")
            # Whole arrays replaced, not written rank by rank: the journal restores the old objects.
            job.alive = bytearray(b"\x01") * job.world
            job.last_seen = [out.ts] * job.world
            job.last_progress = [out.ts] * job.world
            self._decide(out, job, "job.started", "processes started", trigger="start",
                         timers=self._arm_watchdog(out, job))
        elif type_ == "process.started":
            if not self._check_rank(job, data.rank, data.attempt, progress=False):
                job.put(job.alive, data.rank, 1)
                job.put(job.last_seen, data.rank, out.ts)
        elif type_ == "checkpoint.saved":
            bad = [s for s in data.shards if s >= job.layout.shards]
            if bad:
                raise _Reject("schema_violation", f"shards {bad} do not exist: the layout has "
                                                  f"{job.layout.shards}")
            implausible = self._implausible_checkpoint(job, data.step, out.ts)
            if implausible is not None:
                raise _Reject("implausible", implausible)
            job.add_checkpoint(data.step, data.tier, data.shards, data.holder)
            attempt = job.incident.attempt if job.incident is not None else None
            if (attempt is not None and attempt.awaiting is not None and attempt.phase == "saving"
                    and data.step >= attempt.awaiting and job.complete_at(data.step)):
                attempt.awaiting = None
                cancelled = self._cancel(*(timer for _, timer in attempt.pending.values()))
                attempt.pending.clear()
                self._decide(out, job, "checkpoint.dying_done", f"dying checkpoint at step {data.step} complete",
                             cancelled=cancelled)
                self._checkpoint(out, job, attempt)
            if job.drains and job.state == "running" and job.incident is None and job.complete_at(data.step):
                self._drain(out, job, data.step)
        elif type_ == "checkpoint.failed":
            pass  # a save that did not land leaves the catalog as it was; the log keeps the failure
        elif type_ == "command.ack":
            self._ack(out, job, data)
        elif type_ == "timer.fired":
            self._timer_fired(out, job, data)
        elif type_ == "job.completed":
            self._finish(out, job, "complete", "job.completed", "training finished")
        elif type_ == "job.cancelled":
            self._finish(out, job, "cancel", "job.cancelled", data.reason or "cancelled by the scheduler")
        elif type_.startswith("operator."):
            self._operator(out, job, type_, data)
        else:  # process.exited, process.hang, network.collective_timeout
            if hasattr(data, "rank"):
                stale = self._check_rank(job, data.rank, data.attempt, progress=False)
                if stale:
                    return
            if isinstance(data, kinds.CollectiveTimeout):
                if data.attempt > job.generation:
                    raise _Reject("unknown_attempt", f"attempt {data.attempt} is ahead of job {job.id}'s "
                                                     f"generation {job.generation}")
                outside = [r for r in (*data.members, *data.reporters) if r >= job.world]
                if outside:
                    raise _Reject("unknown_rank", f"ranks {sorted(set(outside))} are not in job {job.id}")
                if any(data.attempt < job.rank_gen[r] for r in data.members):
                    return  # a timeout of a group whose processes an earlier attempt already replaced
            if isinstance(data, kinds.ProcessExited):
                job.put(job.alive, data.rank, 0)
                if job.incident is not None and data.rank in job.incident.exiting:
                    return  # the platform stopped the job: each rank's exit was expected, and is no news
            ranks = (data.rank,) if hasattr(data, "rank") else ()
            self._signal(out, job, Signal(type_, data, out.ts, None, ranks, step_time_ns=job.step_time,
                                          world=job.world))

    def _check_rank(self, job: Job, rank: int, attempt: int, progress: bool = True) -> bool:
        """Validate a rank event; True if it is stale, to be ignored.

        Progress from before the newest restart is stale for every rank: each rank rolls back to the resume
        point. A process event is stale only if the rank's process has been replaced since: a rank that was
        rolled back but not restarted is the same process, and its exit is a fault."""
        if rank >= job.world:
            raise _Reject("unknown_rank", f"rank {rank} is not in job {job.id} (world {job.world})")
        if attempt > job.generation:
            raise _Reject("unknown_attempt", f"attempt {attempt} is ahead of job {job.id}'s generation "
                                             f"{job.generation}")
        return attempt < (job.generation if progress else job.rank_gen[rank])

    def _finish(self, out: _Out, job: Job, trigger: str, kind: str, reason: str) -> None:
        cancelled = self._cancel(*self._job_timers(job))
        job.suspects.clear()
        job.watchdog = None
        if job.incident is not None:
            self._close_incident(job, out.ts, kind)
        for name in job.nodes:
            self.cluster.release(name, job.id)
        self._decide(out, job, kind, reason, trigger=trigger, cancelled=cancelled)

    # -- progress: the hot path -----------------------------------------------------------------------
    def _progress(self, out: _Out, job: Job, data: kinds.Heartbeat | kinds.StepReported) -> None:
        rank = data.rank
        current = data.attempt == job.generation
        if (rank >= len(job.steps) or not current) and self._check_rank(job, rank, data.attempt, progress=False):
            return  # from a process that a restart has replaced since, still reporting on its way out
        # Not current but not stale: a process no recovery restarted, reporting the generation it last joined (its
        # agent has not told it the new one yet). It is alive, and its steps are its own: they count for this rank
        # (a watchdog must not call it silent or stuck) but not for the job's step, and a step below its last is
        # the roll-back to the resume point, not a step backwards.
        ts = out.ts
        step = data.step
        if step is not None:
            last = job.steps[rank]
            if step < last:
                if current and not self._implausible_lead(job, rank, last):
                    raise _Reject("step_backwards", f"rank {rank} reported step {step} after step {last}")
                self._correct_step(out, job, rank, step, last, current)
            elif step > last:
                if job.rank_log is not None:  # journaled (restoring): log what is overwritten
                    job.put(job.steps, rank, step)
                    job.put(job.last_progress, rank, ts)
                else:
                    job.steps[rank] = step
                    job.last_progress[rank] = ts
                if step > job.step and current:
                    if job.step_ts is not None:
                        per_step = (ts - job.step_ts) // (step - job.step)
                        job.step_time = per_step if job.step_time is None else (7 * job.step_time + per_step) // 8
                    job.step = step
                    job.step_ts = ts
        if job.rank_log is not None:
            job.put(job.last_seen, rank, ts)
        else:
            job.last_seen[rank] = ts
        if job.state == "restoring" and step is not None:
            self._check_restored(out, job, rank, step)

    @staticmethod
    def _implausible_lead(job: Job, rank: int, step: int) -> bool:
        """Was `step` of `rank` implausible: more than STEP_LEAD ahead of every other rank? Ranks of one job train
        in lockstep (a collective per step), so one rank that far ahead reported a corrupted counter."""
        others = max((s for r, s in enumerate(job.steps) if r != rank), default=None)
        return others is not None and step > others + STEP_LEAD

    @staticmethod
    def _implausible_checkpoint(job: Job, step: int, ts: int) -> str | None:
        """Why a checkpoint at `step` cannot be true, or None. No rank saves a step it has not trained: beyond the
        newest reported step, a checkpoint may be ahead by STEP_LEAD plus what the job could have trained since that
        report at four times its measured pace (reports may be sparse). Before a pace is known (a job may start from
        an older run's checkpoint at any step) every step is plausible. An implausible step kept would become the
        resume point, and the job would wait for progress past a step it never reaches."""
        if job.step_time is None:
            return None
        top = max(job.steps)
        since = job.step_ts if job.step_ts is not None else max(job.last_progress)
        allowance = STEP_LEAD + max(0, ts - since) * 4 // max(job.step_time, 1)
        if step <= top + allowance:
            return None
        return (f"checkpoint at step {step} is beyond what the job can have trained: newest reported step {top}, "
                f"at most {allowance} more by now ({STEP_LEAD} + four times its pace of "
                f"{job.step_time / NS:.3g} s per step)")

    def _correct_step(self, out: _Out, job: Job, rank: int, step: int, last: int, current: bool) -> None:
        """Take a lower step for `rank`: a survivor's roll-back to the resume point, or the correction of a counter
        that had jumped implausibly far ahead (which would otherwise make every true report a step backwards)."""
        self._guard(job)
        job.put(job.steps, rank, step)
        job.put(job.last_progress, rank, out.ts)
        if current and last >= job.step:
            job.step = max(job.steps)
            job.step_ts = out.ts
        if current:
            self._decide(out, job, "progress.corrected",
                         f"rank {rank} reported step {step} after step {last}, which was more than {STEP_LEAD} steps "
                         f"ahead of every other rank: taken as a corrupted counter", detail={"rank": rank,
                                                                                             "step": step,
                                                                                             "implausible": last})

    # -- signals and verdicts -------------------------------------------------------------------------
    def _node_event(self, out: _Out, name: str, type_: str, data: Any) -> None:
        node = self.cluster.node(name)
        device_times: tuple[int, ...] = ()
        node_times: tuple[int, ...] = ()
        if isinstance(data, kinds.DeviceFault):
            device_times, node_times = self.cluster.record_device_fault(name, data.device, out.ts)
        elif isinstance(data, kinds.DeviceRecovered):
            node.bad_devices.discard(data.device)
        elif isinstance(data, kinds.NodeNotReady):
            node.ready = False
        elif isinstance(data, kinds.NodeReady):
            node.ready = True
        elif isinstance(data, kinds.NodeDrained):
            node.drained = True
        elif isinstance(data, kinds.LinkDown):
            if node.links_down is None:
                node.links_down = set()
            node.links_down.add(data.link)
        elif isinstance(data, kinds.LinkUp):
            if node.links_down:
                node.links_down.discard(data.link)
        elif isinstance(data, kinds.NodeJoined):
            node.spare = data.spare and node.job is None
            node.devices = data.devices
            node.ready, node.drained, node.isolated = True, False, False
            node.bad_devices.clear()
            node.links_down = None
            # A node that (re)joins has been booted: whatever it held in host memory is gone.
            for other in self.jobs.values():
                if other.holds_memory_on(name):
                    self._touch(other)
                    other.forget_memory(name)
        job = self.jobs.get(node.job) if node.job is not None else None
        if job is not None:
            self._touch(job)
        if job is not None and job.state not in FINAL and name in job.nodes:
            on_node = job.ranks_on(name)
            if isinstance(data, kinds.DeviceFault | kinds.DeviceRecovered):
                ranks: tuple[int, ...] = (on_node[data.device],) if data.device < job.rpn else ()
            else:
                ranks = tuple(on_node)
            self._signal(out, job, Signal(type_, data, out.ts, name, ranks, device_times, node_times,
                                          job.step_time, job.world, tuple(on_node)))
        elif isinstance(data, kinds.DeviceFault):
            # No job runs here (an idle spare, a node between jobs): its hardware health still decides where the next
            # job or move may go. No job's policy applies, so the built-in detection judges it.
            verdict = self._hardware.classify(Signal(type_, data, out.ts, name, (), device_times, node_times))
            if verdict.kind == "fault":
                self._mark_hardware(verdict)
        if isinstance(data, kinds.NodeJoined | kinds.NodeReady | kinds.DeviceRecovered | kinds.LinkUp) and node.usable:
            self._capacity_returned(out)

    def _signal(self, out: _Out, job: Job, signal: Signal) -> None:
        if job.state in ("submitted", "paused"):
            if isinstance(signal.data, kinds.DeviceFault):  # no recovery now, but the hardware is what it is
                verdict = _ask(job, "detection", job.policies.detection.classify, signal)
                if verdict.kind == "fault":
                    self._mark_hardware(verdict)
            return
        verdict = _ask(job, "detection", job.policies.detection.classify, signal)
        self._verdict(out, job, verdict, type_=signal.type)

    def _mark_hardware(self, verdict: Verdict) -> None:
        """What a confirmed fault says of the hardware, whoever runs there: an isolated node, a bad device."""
        if verdict.node is None:
            return
        if verdict.isolate == "node":
            self.cluster.node(verdict.node).isolated = True
        if verdict.needs_move and verdict.device is not None:
            self.cluster.node(verdict.node).bad_devices.add(verdict.device)

    def _verdict(self, out: _Out, job: Job, verdict: Verdict, type_: str) -> None:
        policy = job.policies.labels["detection"]
        if verdict.kind == "ignore":
            if type_ not in ("network.link_up", "node.ready", "device.recovered"):
                self._decide(out, job, "signal.ignored", verdict.reason, policy=policy,
                             detail={"signal": type_, "code": verdict.code})
        elif verdict.kind == "clear":
            entry = job.suspects.pop(verdict.key or "", None)
            if entry is None:
                return
            cancelled = self._cancel(entry[1])
            trigger = "clear" if job.state == "suspect" and not job.suspects else None
            self._decide(out, job, "fault.cleared", verdict.reason, trigger=trigger, policy=policy,
                         cancelled=cancelled, detail={"key": verdict.key})
        elif verdict.kind == "suspect":
            key = verdict.key or f"{type_}:{out.seq}"
            if key in job.suspects:
                return  # already counting down: a repeated signal does not restart the debounce
            timer = self._timer(out, job, f"confirm/{key}", verdict.confirm_after_ns)
            job.suspects[key] = (verdict, timer.id)
            trigger = "suspect" if job.state == "running" else None
            self._decide(out, job, "fault.suspected", verdict.reason, trigger=trigger, policy=policy,
                         timers=[timer], detail={"key": key, "ranks": list(verdict.ranks)})
        elif verdict.kind == "drain":
            node = verdict.node
            if node is None or node not in job.nodes or node in job.drains:
                return
            job.drains[node] = verdict.reason
            self._decide(out, job, "node.drain_planned", verdict.reason, policy=policy,
                         detail={"node": node, "device": verdict.device, "code": verdict.code})
        else:
            self._fault(out, job, verdict, policy)

    def _drain(self, out: _Out, job: Job, step: int) -> None:
        """Move the ranks off sub-healthy nodes now that `step` is a complete checkpoint: a planned pod-level move
        that loses nothing, instead of a fault later."""
        for gone in [n for n in job.drains if n not in job.nodes]:
            del job.drains[gone]  # the job left it meanwhile
        nodes = list(job.drains)
        if not nodes:
            return
        spares = self._spares_for(job)
        if len(spares) < len(nodes):
            self._decide(out, job, "node.drain_deferred", f"{len(nodes)} node(s) to drain, {len(spares)} spare(s): "
                                                          f"try again at the next checkpoint",
                         detail={"nodes": nodes, "step": step})
            return
        for name in nodes:
            self.cluster.node(name).drained = True  # no new work lands there until it rejoins
        reasons = "; ".join(job.drains[n] for n in nodes)
        job.drains.clear()
        incident = self._open(out, job, "drain")
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=G.MIGRATE, rung=0, purpose="drain",
                          reason=f"checkpoint at step {step} complete: drain {', '.join(nodes)} ({reasons})",
                          started=out.ts)
        self._start(out, job, attempt, 900 * NS, None, nodes)

    def _fault(self, out: _Out, job: Job, verdict: Verdict, policy: str, plan: bool = True) -> None:
        """Record a confirmed fault; with `plan`, decide what to do (off for all but the last of a batch)."""
        commands: list[Any] = []
        if verdict.isolate is not None and verdict.node is not None:
            if verdict.isolate == "node":
                commands.append(IsolateNode(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                            deadline_s=60, node=verdict.node, reason=verdict.reason))
            else:
                commands.append(IsolateDevice(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                              deadline_s=60, node=verdict.node, device=verdict.device or 0,
                                              reason=verdict.reason))
        self._mark_hardware(verdict)
        if not verdict.ranks and verdict.scope != "job":
            # Hardware none of the job's ranks uses: marked out of service, and the job goes on.
            self._decide(out, job, "hardware.marked", verdict.reason, policy=policy, commands=commands,
                         detail={"node": verdict.node, "device": verdict.device, "code": verdict.code})
            return
        if verdict.lost:
            for rank in verdict.ranks:
                job.put(job.alive, rank, 0)
        fault = {"class": verdict.fault_class.value if verdict.fault_class else None, "scope": verdict.scope,
                 "ranks": list(verdict.ranks), "node": verdict.node, "device": verdict.device,
                 "code": verdict.code, "reason": verdict.reason, "seq": out.seq, "ts": out.ts}
        incident = job.incident
        if incident is not None:
            incident.faults.append(fault)
            self._note_exiting(incident, verdict)
            self._note_dead_hosts(job, incident, verdict)
            attempt = incident.attempt
            if job.state == "waiting" or attempt is None:
                self._decide(out, job, "fault.added", verdict.reason, policy=policy, commands=commands)
                if plan and incident.settle_timer is None:  # a settle window decides when it closes
                    self._plan(out, job)
                return
            if attempt.phase in ("rescheduling", "restoring") and verdict.fault_class in _PROCESS_FAULTS and (
                    attempt.granularity is G.RETRY or any(r in attempt.ranks for r in verdict.ranks)):
                # The restarted (or retried) processes themselves crashed or hung: this attempt did not work. New
                # hardware under them (a device, a node, a link) is a new fault instead: it widens the incident.
                self._decide(out, job, "fault.added", verdict.reason, policy=policy, commands=commands)
                why = f"attempt {attempt.number} ({attempt.granularity.value}) failed: {verdict.reason}"
                self._end_attempt(out, job, attempt, "failed", why, plan=plan)
                return
            if self._covered(job, attempt, verdict):
                self._decide(out, job, "fault.absorbed", verdict.reason, policy=policy, commands=commands,
                             detail={"attempt": attempt.number})
                return
            self._decide(out, job, "fault.added", verdict.reason, policy=policy, commands=commands)
            incident.widened = True
            self._end_attempt(out, job, attempt, "superseded", f"new fault outside attempt "
                                                                f"{attempt.number}: {verdict.reason}", plan=plan)
            return
        # Pending suspicions stay: the other nodes behind a failed switch confirm later and join this incident.
        cancelled = self._cancel(job.watchdog)
        job.watchdog = None
        job.incident = Incident(id=job.next_incident_id(), opened_seq=out.seq, opened=out.ts,
                                fault_step=job.step, fault_class=verdict.fault_class, cause="fault",
                                faults=[fault])
        job.incident.enter("detected", out.ts)
        self._note_exiting(job.incident, verdict)
        self._note_dead_hosts(job, job.incident, verdict)
        self._decide(out, job, "fault.confirmed", verdict.reason, policy=policy, commands=commands,
                     cancelled=cancelled, detail={"fault": fault, "step": job.step})
        if plan:
            self._plan(out, job)

    @staticmethod
    def _note_dead_hosts(job: Job, incident: Incident, verdict: Verdict) -> None:
        """A node fault declares its hosts gone (their ranks fell silent together, or a host stayed not ready): what
        they held in memory or on local disk is no source for this incident's restarts, whatever the cluster view
        says of their readiness (a silent host has not said it is not ready)."""
        if verdict.fault_class is FaultClass.NODE and verdict.lost:
            hosts = {job.nodes[r // job.rpn] for r in verdict.ranks if r < job.world}
            if not incident.dead_hosts.issuperset(hosts):
                incident.dead_hosts = incident.dead_hosts | hosts

    @staticmethod
    def _note_exiting(incident: Incident, verdict: Verdict) -> None:
        """Processes the platform stopped (a preemption whose processes are gone) write a dying checkpoint on their
        way out: the checkpoint policy may hold the restart for it."""
        if verdict.fault_class is FaultClass.PREEMPTION and verdict.lost and not incident.exiting.issuperset(
                verdict.ranks):
            incident.exiting = incident.exiting | frozenset(verdict.ranks)

    def _covered(self, job: Job, attempt: Attempt, verdict: Verdict) -> bool:
        """Is this fault already handled by the attempt under way (its ranks restart or stop anyway)?"""
        if attempt.granularity is G.RETRY:
            return not verdict.lost and not verdict.needs_move
        if verdict.node is not None and verdict.node not in attempt.vacate and (
                verdict.needs_move or not self.cluster.usable_by(verdict.node, job.rpn)):
            return False  # the attempt restarts ranks on a node that can take none now: leave it, or wait for it
        if attempt.covered is None:  # built once: a burst of exits during a 16k-rank restart asks per exit
            attempt.covered = frozenset(attempt.ranks) | frozenset(attempt.stopping)
        covered = attempt.covered
        return all(rank in covered for rank in verdict.ranks)

    # -- planning -------------------------------------------------------------------------------------
    def _vacate(self, job: Job) -> list[str]:
        return [name for name in job.nodes if not self.cluster.usable_by(name, job.rpn)]

    def _fault_nodes(self, job: Job) -> list[str]:
        """Nodes of the faulty or dead ranks: what a migration moves when no node is unusable."""
        assert job.incident is not None
        ranks = {r for f in job.incident.faults for r in f["ranks"] if r < job.world}
        ranks.update(r for r in range(job.world) if not job.alive[r])
        indices = {r // job.rpn for r in ranks}
        return [n for i, n in enumerate(job.nodes) if i in indices]

    def _scale_in_dp(self, job: Job, vacate: list[str]) -> int | None:
        elastic = job.spec.elastic
        if elastic is None:
            return None
        # The nodes it keeps and the spares it may take: a job that cannot have its old size runs at the largest size
        # these give, at or above its minimum, rather than wait for the whole of its old size to come back.
        have = len(job.nodes) - len(vacate) + len(self._spares_for(job))
        dp = _fit_dp(job.layout, job.rpn, have, elastic.max_dp)
        return dp if dp is not None and elastic.min_dp <= dp < job.layout.dp else None

    def _spares_for(self, job: Job) -> list[str]:
        """The free spares this job may take now, in the order they joined: within its quota (`spares` in its spec:
        nodes of the pool it may hold at once beyond its own placement), so one job cannot take every spare."""
        free = self.cluster.free_spares()
        quota = job.spec.spares
        if quota is None:
            return free
        own = job.own_nodes
        held = sum(1 for name in job.nodes if name not in own)
        return free[:max(0, quota - held)]

    def _plan(self, out: _Out, job: Job, forced: Granularity | None = None) -> None:
        incident = job.incident
        assert incident is not None
        vacate = self._vacate(job)
        spares = self._spares_for(job)
        fault_class = incident.fault_class or FaultClass.PROCESS
        migrate = vacate or self._fault_nodes(job)
        ctx = RescheduleContext(
            fault_class=fault_class, scope="job", needs_move=bool(vacate),
            any_lost=not all(job.alive), previous=incident.history(), used=_incident_usage(incident),
            restarts_used=job.restarts_used, max_restarts=job.spec.max_restarts,
            nodes_to_replace=len(vacate), nodes_to_migrate=len(migrate), spares_available=len(spares),
            dp=job.layout.dp,
            scale_in_dp=self._scale_in_dp(job, vacate), forced=forced,
            widened=incident.widened, step_time_ns=job.step_time,
        )
        action = _ask(job, "rescheduling", job.policies.rescheduling.decide, ctx)
        policy = job.policies.labels["rescheduling"]
        out.plans += 1
        short = None if action.wait or action.granularity is None else self._unplaceable(
            job, action.granularity, vacate, migrate, len(spares), forced)
        if short is None and out.plans > MAX_PLANS_PER_RECORD:
            short = f"asked {out.plans} times within one record"
        if short is not None:
            # The policy chose what the cluster cannot carry out now. Asking again at once would get the same answer
            # (a policy is a pure function of the same context): wait until nodes come back, and say why.
            incident.enter("waiting", out.ts)
            chose = action.granularity.value if action.granularity is not None else "nothing"
            self._decide(out, job, "attempt.waiting", f"{policy} chose {chose}, which cannot be placed: {short}; "
                                                      f"wait for nodes", trigger="wait", policy=policy,
                         detail={"vacate": vacate, "spares": len(spares), "refused": action.reason})
            return
        if action.settle_ns > 0 and action.granularity is None and not action.wait:
            timer = self._timer(out, job, f"settle/{incident.id}/{len(incident.attempts)}", action.settle_ns)
            incident.settle_timer = timer.id
            incident.enter("settling", out.ts)
            self._decide(out, job, "attempt.settling", action.reason, trigger="settle", policy=policy,
                         timers=[timer], detail={"faults": len(incident.faults)})
            return
        if action.wait:
            incident.enter("waiting", out.ts)
            self._decide(out, job, "attempt.waiting", action.reason, trigger="wait", policy=policy,
                         detail={"vacate": vacate, "spares": len(spares)})
            return
        g = action.granularity or G.FAIL
        if g is G.FAIL:
            self._fail_job(out, job, action.reason, policy)
            return
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=g, rung=action.rung,
                          purpose="dump" if g is G.DUMP else "recover", reason=action.reason, started=out.ts)
        keys = (f"{fault_class.value}/{g.value}", g.value)
        attempt.budget_keys = keys
        for key in keys:
            job.used[key] = job.used.get(key, 0) + 1
        if g in _RESTARTS:
            job.restarts_used += 1
        self._start(out, job, attempt, action.deadline_ns, policy, vacate)

    def _unplaceable(self, job: Job, g: Granularity, vacate: list[str], migrate: list[str], spares: int,
                     forced: Granularity | None) -> str | None:
        """Why an attempt of granularity `g` cannot be carried out on the cluster as it is, or None if it can.
        The engine checks every policy's answer: a third-party ladder that picks a restart the cluster cannot
        place must not make the engine supersede, refund and ask again without end."""
        if g is G.MIGRATE and len(migrate) > spares:
            return f"{len(migrate)} node(s) to move, {spares} spare(s)"
        if g in (G.RESTART_JOB, G.DUMP) and len(vacate) > spares:
            return f"{len(vacate)} node(s) to replace, {spares} spare(s)"
        if g is G.IN_PLACE and vacate and forced is None:
            return f"node(s) {', '.join(vacate)} cannot run processes now"
        if g is G.SCALE_IN:
            elastic = job.spec.elastic
            if elastic is None:
                return "the job is not elastic"
            if self._scale_in_dp(job, vacate) is None:
                return f"no data-parallel size within [{elastic.min_dp}, {elastic.max_dp}] fits the usable nodes"
        if g is G.SCALE_OUT:
            return "scale-out is started by the engine when nodes return, not a recovery"
        return None

    def _start(self, out: _Out, job: Job, attempt: Attempt, deadline_ns: int, policy: str | None,
               vacate: list[str], trigger: str | None = None) -> None:
        incident = job.incident
        assert incident is not None
        # An operator's order can start an attempt while a settle window is open: the window has no more to say.
        settle = self._cancel(incident.settle_timer)
        incident.settle_timer = None
        incident.widened = False
        incident.attempts.append(attempt)
        g = attempt.granularity
        dead = tuple(r for r in range(job.world) if not job.alive[r])
        if g is G.RETRY:
            attempt.ranks = ()
        elif g is G.IN_PLACE:
            # Faults from before a scale-in may name ranks the smaller job no longer has (as in _fault_nodes).
            fault_ranks = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(set(dead) | fault_ranks))
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        elif g is G.MIGRATE:
            vacate = vacate or self._fault_nodes(job)
            attempt.vacate = tuple(vacate)
            moved = {r for n in vacate for r in job.ranks_on(n)}
            # Dead or faulty ranks on the nodes that stay restart where they are, in the same attempt.
            faulty = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(moved | set(dead) | faulty))
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        else:  # job level: restart, scale, dump
            attempt.ranks = tuple(range(job.world))
            attempt.stopping = tuple(r for r in range(job.world) if job.alive[r])
            attempt.vacate = tuple(vacate)
        timer = self._timer(out, job, f"attempt/{incident.id}/{attempt.number}", deadline_ns)
        attempt.deadline_timer = timer.id
        self._decide(out, job, "attempt.started", attempt.reason, trigger=trigger, policy=policy, timers=[timer],
                     cancelled=settle, detail={"attempt": attempt.number, "granularity": g.value, "rung": attempt.rung,
                             "ranks": list(attempt.ranks), "vacate": list(attempt.vacate)})
        if g is G.RETRY:
            self._reschedule(out, job, attempt)
        else:
            self._checkpoint(out, job, attempt)

    def _checkpoint_ctx(self, job: Job, attempt: Attempt, dying_allowed: bool, peer_allowed: bool
                        ) -> CheckpointContext:
        incident = job.incident
        assert incident is not None
        saving_ranks = set(attempt.ranks) if attempt.granularity is G.IN_PLACE else set()
        alive = tuple(bool(job.alive[r]) and r not in saving_ranks for r in range(job.world))
        return CheckpointContext(
            layout=job.layout, catalog=job.frozen_catalog(), placement=tuple(job.nodes[r // job.rpn]
                                                                              for r in range(job.world)),
            unreachable=frozenset(n for n in job.nodes if not self.cluster.reachable(n)) | incident.dead_hosts,
            alive=alive, steps=tuple(job.steps), dying_allowed=dying_allowed, peer_allowed=peer_allowed,
            restarting=frozenset(attempt.ranks),
            exiting=incident.exiting if dying_allowed and not incident.awaited else frozenset(),
        )

    def _refresh_plan(self, out: _Out, job: Job, attempt: Attempt) -> None:
        """The plan a restart carries is made from what is known when the command is sent: while processes were
        stopped, live replicas may have trained on, a newer checkpoint (a dying one written by SIGTERM handlers)
        may have landed, or a holder may have gone. Ask again; a different answer replaces the plan."""
        plan = attempt.plan
        if plan is None:
            return
        peer = any(source.tier is Tier.PEER for source in plan.shards)
        fresh = _ask(job, "checkpoint", job.policies.checkpoint.plan,
                     self._checkpoint_ctx(job, attempt, False, peer)).resume
        if fresh != plan:
            attempt.plan = fresh
            why = (f"{plan.checkpoint_step} is no longer where the live replicas are" if peer else
                   f"step {plan.checkpoint_step} is no longer the newest complete, reachable checkpoint")
            self._decide(out, job, "checkpoint.plan", f"again before the restart: {why}",
                         policy=job.policies.labels["checkpoint"],
                         detail={"checkpoint_step": fresh.checkpoint_step, "next_step": fresh.next_step,
                                 "tiers": _tier_counts(fresh)})

    def _checkpoint(self, out: _Out, job: Job, attempt: Attempt) -> None:
        """Choose the resume point; first ask live replicas for a dying checkpoint if the policy says so."""
        incident = job.incident
        assert incident is not None
        ctx = self._checkpoint_ctx(job, attempt, not incident.dying_tried, not incident.peer_tried)
        plan = _ask(job, "checkpoint", job.policies.checkpoint.plan, ctx)
        policy = job.policies.labels["checkpoint"]
        if plan.save is None and any(source.tier is Tier.PEER for source in plan.resume.shards):
            incident.peer_tried = True  # if the peers fail this attempt, the next one saves a dying checkpoint
        if plan.save is not None:
            incident.dying_tried = True
            attempt.save = plan.save
            attempt.phase = "saving"
            incident.enter("saving", out.ts)
            command = SaveCheckpoint(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                     deadline_s=60, ranks=list(plan.save.ranks), step=plan.save.step)
            timer = self._ack_timer(out, job, command.id, command.deadline_s)
            attempt.pending = {command.id: (command.kind, timer.id)}
            self._decide(out, job, "checkpoint.dying", plan.reason, trigger="save", policy=policy,
                         commands=[command], timers=[timer],
                         detail={"step": plan.save.step, "savers": list(plan.save.ranks)})
            return
        if plan.await_step is not None and plan.await_ns > 0 and not incident.awaited:
            incident.awaited = True  # once per incident: the next plan takes what has landed by then
            attempt.plan = plan.resume
            attempt.awaiting = plan.await_step
            attempt.phase = "saving"
            incident.enter("saving", out.ts)
            timer = self._timer(out, job, f"await/{incident.id}/{attempt.number}", plan.await_ns)
            attempt.pending = {f"await:{plan.await_step}": ("await_dying", timer.id)}
            self._decide(out, job, "checkpoint.awaiting", plan.reason, trigger="save", policy=policy, timers=[timer],
                         detail={"step": plan.await_step, "wait_s": plan.await_ns / NS,
                                 "exiting": len(incident.exiting)})
            return
        attempt.plan = plan.resume
        self._decide(out, job, "checkpoint.plan", plan.reason, policy=policy,
                     detail={"checkpoint_step": plan.resume.checkpoint_step,
                             "next_step": plan.resume.next_step,
                             "tiers": _tier_counts(plan.resume)})
        self._stop(out, job, attempt)

    def _ack_timer(self, out: _Out, job: Job, command_id: str, deadline_s: float) -> TimerRequest:
        return self._timer(out, job, f"ack/{command_id}", int(deadline_s * NS))

    def _stop(self, out: _Out, job: Job, attempt: Attempt) -> None:
        incident = job.incident
        assert incident is not None
        stopping = [r for r in attempt.stopping if job.alive[r]]
        if not stopping:
            self._reschedule(out, job, attempt)
            return
        attempt.phase = "stopping"
        incident.enter("stopping", out.ts)
        # Hung or faulty processes are killed, and so are healthy ones on a node being vacated: the plan takes their
        # state from elsewhere, so a grace period buys nothing. The rest of a job stopped whole gets SIGTERM and a
        # grace period to exit cleanly.
        faulty = {r for f in incident.faults for r in f["ranks"]}
        kill = attempt.granularity in (G.IN_PLACE, G.MIGRATE) or all(r in faulty for r in stopping)
        mode: Literal["graceful", "kill"] = "kill" if kill else "graceful"
        command = StopRanks(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                            ranks=stopping, mode=mode, grace_s=30.0)
        timer = self._ack_timer(out, job, command.id, command.deadline_s)
        attempt.pending = {command.id: (command.kind, timer.id)}
        self._decide(out, job, "ranks.stopping", f"stop {len(stopping)} rank(s) ({mode})", trigger="stop",
                     commands=[command], timers=[timer])

    def _reschedule(self, out: _Out, job: Job, attempt: Attempt) -> None:
        incident = job.incident
        assert incident is not None
        g = attempt.granularity
        attempt.phase = "rescheduling"
        incident.enter("rescheduling", out.ts)
        if g is G.DUMP:
            step = attempt.plan.checkpoint_step if attempt.plan else None
            self._fail_job(out, job, f"dumped: checkpoint at step {step}; the job stops for an operator", None)
            return
        if attempt.purpose == "pause":
            self._cancel(attempt.deadline_timer)
            attempt.outcome = "paused"
            incident.enter("paused", out.ts)
            self._decide(out, job, "job.paused", attempt.reason, trigger="pause",
                         cancelled=[attempt.deadline_timer] if attempt.deadline_timer else [])
            return
        self._refresh_plan(out, job, attempt)
        cid = out.command_id(job.id)
        commands: list[Any] = []
        if g is G.RETRY:
            commands.append(RetryStep(id=cid, job=job.id, attempt=job.generation, deadline_s=60,
                                      step=incident.fault_step + 1))
        else:
            plan = attempt.plan
            assert plan is not None
            job.generation += 1
            gen = job.generation
            if g is G.IN_PLACE:
                commands.append(RestartRanks(id=cid, job=job.id, attempt=gen, deadline_s=120,
                                             ranks=list(attempt.ranks), plan=plan))
            elif g is G.MIGRATE:
                spares = self._spares_for(job)
                if len(spares) < len(attempt.vacate):
                    job.generation -= 1
                    self._end_attempt(out, job, attempt, "superseded", "the spare nodes it needed are gone")
                    return
                for index, name in enumerate(attempt.vacate):
                    target = spares[index]
                    ranks = list(job.ranks_on(name))
                    self.cluster.release(name, job.id)
                    self.cluster.assign(target, job.id)
                    job.nodes[job.nodes.index(name)] = target
                    commands.append(MigrateRanks(id=cid if index == 0 else out.command_id(job.id), job=job.id,
                                                 attempt=gen, deadline_s=300, ranks=ranks, from_node=name,
                                                 to_node=target, plan=plan))
                moved = {r for c in commands for r in c.ranks}  # type: ignore[attr-defined]
                staying = [r for r in attempt.ranks if r not in moved]
                if staying:
                    commands.append(RestartRanks(id=out.command_id(job.id), job=job.id, attempt=gen,
                                                 deadline_s=120, ranks=staying, plan=plan))
            else:
                placement = self._placement(job, attempt)
                if placement is None:
                    job.generation -= 1
                    self._end_attempt(out, job, attempt, "superseded", "not enough usable nodes left")
                    return
                nodes, dp = placement
                for name in job.nodes:
                    if name not in nodes:
                        self.cluster.release(name, job.id)
                for name in nodes:
                    self.cluster.assign(name, job.id)
                if dp != job.layout.dp:
                    job.resize(Layout(dp=dp, tp=job.layout.tp, pp=job.layout.pp), nodes, out.ts)
                    attempt.ranks = tuple(range(job.world))
                    attempt.covered = None
                    commands.append(ScaleJob(id=cid, job=job.id, attempt=gen, deadline_s=600, dp=dp,
                                             nodes=nodes, plan=plan))
                else:
                    job.nodes = nodes
                    commands.append(RestartJob(id=cid, job=job.id, attempt=gen, deadline_s=600, nodes=nodes,
                                               plan=plan))
            for rank in attempt.ranks:
                job.put(job.rank_gen, rank, job.generation)  # these ranks get new processes
            # Every rank rolls back to the resume point, restarted or not.
            start = plan.checkpoint_step or 0
            job.steps = [start] * job.world
            job.step = start
            job.step_ts = None
        timers = [self._ack_timer(out, job, c.id, c.deadline_s) for c in commands]
        attempt.pending = {c.id: (c.kind, t.id) for c, t in zip(commands, timers, strict=True)}
        self._decide(out, job, "ranks.rescheduling", f"{g.value}: {len(commands)} command(s)",
                     trigger="reschedule", commands=commands, timers=timers,
                     detail={"attempt": attempt.number, "generation": job.generation,
                             "nodes": list(job.nodes)})

    def _placement(self, job: Job, attempt: Attempt) -> tuple[list[str], int] | None:
        """Nodes and data-parallel size after a job-level restart or scale."""
        usable = [n for n in job.nodes if self.cluster.usable_by(n, job.rpn)]
        spares = self._spares_for(job)
        per_replica = job.layout.tp * job.layout.pp
        if attempt.granularity is G.SCALE_IN:
            dp = attempt.dp or self._scale_in_dp(job, list(attempt.vacate)) or job.layout.dp
            need = dp * per_replica // job.rpn
            # Nodes may have gone since the attempt was planned (or a forced scale-in had no smaller dp):
            # never place the job on fewer nodes than its ranks need.
            if len(usable) + len(spares) < need:
                return None
            return usable[:need] + spares[: max(0, need - len(usable))], dp
        if attempt.granularity is G.SCALE_OUT:
            dp = attempt.dp or job.layout.dp
            need = dp * per_replica // job.rpn
            if len(usable) + len(spares) < need:
                return None
            return usable[:need] + spares[: max(0, need - len(usable))], dp
        need = len(job.nodes)
        if len(usable) + len(spares) < need:
            return None
        return usable + spares[: need - len(usable)], job.layout.dp

    # -- acks, timers, restore ------------------------------------------------------------------------
    def _ack(self, out: _Out, job: Job, data: kinds.CommandAck) -> None:
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is None or data.command_id not in attempt.pending or attempt.awaiting is not None:
            return  # an ack for a finished or superseded attempt, or for isolate commands: kept in the log
        if data.status == "accepted":
            return
        kind, ack_timer = attempt.pending.pop(data.command_id)
        cancelled = self._cancel(ack_timer)
        if data.status == "failed":
            if kind == "save_checkpoint":
                self._decide(out, job, "checkpoint.dying_failed", data.reason or "dying checkpoint failed",
                             cancelled=cancelled)
                attempt.pending.clear()
                self._checkpoint(out, job, attempt)
                return
            self._end_attempt(out, job, attempt, "failed", f"{kind} failed: {data.reason}".rstrip(": "),
                              cancelled)
            return
        if attempt.pending:
            if cancelled:
                self._decide(out, job, "command.done", f"{kind} done", cancelled=cancelled)
            return
        if attempt.phase == "saving":
            self._decide(out, job, "checkpoint.dying_done", f"dying checkpoint at step "
                                                            f"{attempt.save.step if attempt.save else '?'} saved",
                         cancelled=cancelled)
            self._checkpoint(out, job, attempt)
        elif attempt.phase == "stopping":
            for rank in attempt.stopping:
                job.put(job.alive, rank, 0)
            self._decide(out, job, "ranks.stopped", f"{len(attempt.stopping)} rank(s) stopped",
                         cancelled=cancelled)
            self._reschedule(out, job, attempt)
        elif attempt.phase == "rescheduling":
            attempt.phase = "restoring"
            assert incident is not None
            incident.enter("restoring", out.ts)
            for rank in attempt.ranks:
                job.put(job.alive, rank, 1)
            job.last_seen = [out.ts] * job.world
            job.last_progress = [out.ts] * job.world
            self._decide(out, job, "ranks.restoring", "executors done: waiting for progress past step "
                                                      f"{self._resume_step(job, attempt)}",
                         trigger="restore", cancelled=cancelled)

    def _resume_step(self, job: Job, attempt: Attempt) -> int:
        if attempt.granularity is G.RETRY:
            assert job.incident is not None
            return job.incident.fault_step
        return attempt.plan.checkpoint_step or 0 if attempt.plan else 0

    def _check_restored(self, out: _Out, job: Job, rank: int, step: int) -> None:
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is None or attempt.phase != "restoring":
            return
        if attempt.granularity is not G.RETRY and rank not in attempt.ranks:
            return
        resume = self._resume_step(job, attempt)
        if step <= resume:
            return
        assert incident is not None
        attempt.outcome = "recovered"
        cancelled = self._cancel(attempt.deadline_timer)
        lost = max(0, incident.fault_step - resume) if incident.cause == "fault" else 0
        incident.lost_steps = lost
        self._close_incident(job, out.ts, "recovered")
        self._decide(out, job, "incident.closed", f"progress to step {step} past resume point {resume}",
                     trigger="recovered", cancelled=cancelled, timers=self._arm_watchdog(out, job),
                     detail={"incident": incident.id, "lost_steps": lost, "attempts": len(incident.attempts),
                             "granularity": attempt.granularity.value,
                             "mttr_ns": out.ts - incident.opened})

    def _close_incident(self, job: Job, ts: int, outcome: str) -> None:
        incident = job.incident
        assert incident is not None
        incident.enter("done", ts)
        incident.phases[-1][2] = ts
        incident.closed = ts
        incident.outcome = outcome
        job.closed.append(incident.summary())
        del job.closed[:-CLOSED_INCIDENTS]
        job.incident = None

    def _end_attempt(self, out: _Out, job: Job, attempt: Attempt, outcome: str, reason: str,
                     cancelled: list[str] | None = None, plan: bool = True) -> None:
        attempt.outcome = outcome
        gone = list(cancelled or [])
        gone += self._cancel(attempt.deadline_timer, *(timer for _, timer in attempt.pending.values()))
        attempt.pending.clear()
        if outcome == "superseded":
            # A fault that widened the incident is not the attempt's failure: give back its budget.
            for key in attempt.budget_keys:
                job.used[key] -= 1
            if attempt.granularity in _RESTARTS:
                job.restarts_used -= 1
        self._decide(out, job, f"attempt.{outcome}", reason, cancelled=gone,
                     detail={"attempt": attempt.number, "granularity": attempt.granularity.value})
        if plan:
            self._plan(out, job)

    def _timer_fired(self, out: _Out, job: Job, data: kinds.TimerFired) -> None:
        entry = self.timers.get(data.timer_id)
        if entry is None or entry[0] != job.id:
            return  # stale or cancelled: harmless, and kept in the log
        owner, due, every = entry
        if every is not None:
            if data.due != due:
                return  # a repeated firing of a period already handled
            following = next_due(due, every, out.ts)
            self._note_timer(data.timer_id)
            self.timers[data.timer_id] = (owner, following, every)
        else:
            self._note_timer(data.timer_id, removing=True)
            del self.timers[data.timer_id]
        if data.timer_id == job.watchdog:
            self._watchdog(out, job)
            return
        fired = next((key for key, (_, timer_id) in job.suspects.items() if timer_id == data.timer_id), None)
        if fired is not None:
            # Suspicions due by now confirm together (the nodes behind one failed switch), so that they make
            # one fault set and one attempt rather than a chain of attempts each superseding the last.
            keys = [fired] + [key for key, (_, timer_id) in job.suspects.items()
                              if key != fired and self.timers.get(timer_id, ("", data.due + 1))[1] <= data.due]
            cancelled = self._cancel(*(job.suspects[key][1] for key in keys[1:]))
            confirmed = [v for v in (self._confirm(out, job, key) for key in keys) if v is not None]
            if cancelled:
                self._decide(out, job, "faults.confirmed_together", f"{len(keys)} suspicions due at once",
                             cancelled=cancelled, detail={"keys": keys})
            policy = job.policies.labels["detection"]
            for index, verdict in enumerate(confirmed):
                self._fault(out, job, verdict, policy, plan=index == len(confirmed) - 1)
            return
        incident = job.incident
        if incident is not None and data.timer_id == incident.settle_timer:
            incident.settle_timer = None
            incident.widened = False
            self._plan(out, job)
            return
        attempt = incident.attempt if incident is not None else None
        if attempt is None:
            return
        if data.timer_id == attempt.deadline_timer:
            attempt.deadline_timer = None
            self._end_attempt(out, job, attempt, "timed_out", f"attempt {attempt.number} "
                                                              f"({attempt.granularity.value}) missed its deadline")
            return
        for cid, (kind, timer_id) in list(attempt.pending.items()):
            if data.timer_id == timer_id:
                if kind in ("save_checkpoint", "await_dying"):
                    attempt.pending.clear()
                    why = ("no ack for the dying checkpoint in time" if kind == "save_checkpoint" else
                           f"the dying checkpoint at step {attempt.awaiting} was not complete in time")
                    attempt.awaiting = None
                    self._decide(out, job, "checkpoint.dying_failed", why)
                    self._checkpoint(out, job, attempt)
                else:
                    self._end_attempt(out, job, attempt, "timed_out", f"no ack for {kind} {cid} in time")
                return

    def _confirm(self, out: _Out, job: Job, key: str) -> Verdict | None:
        """Turn the suspicion `key` into a confirmed fault, or drop it (with a decision) if it no longer applies."""
        verdict, _ = job.suspects.pop(key)
        gone = verdict.node is not None and verdict.node not in job.nodes
        if gone or job.state == "paused":
            # The job left that node (migrated or scaled in) while the suspicion counted down, so its ranks there
            # are gone or renumbered; or an operator paused the job, which takes no signals (as in _signal).
            # Either way there is nothing left to confirm.
            why = f"job no longer on {verdict.node}" if gone else "job is paused"
            trigger = "clear" if job.state == "suspect" and not job.suspects else None
            self._decide(out, job, "fault.cleared", f"{verdict.reason}: {why}", trigger=trigger,
                         policy=job.policies.labels["detection"], detail={"key": key})
            return None
        ranks = verdict.ranks
        if verdict.node is not None:
            # A resize since the suspicion may have renumbered the node's ranks: keep each rank's slot on the
            # node (rank % ranks_per_node), not its old number.
            on_node = job.ranks_on(verdict.node)
            ranks = tuple(on_node[r % job.rpn] for r in verdict.ranks)
        return Verdict("fault", f"confirmed: {verdict.reason}", verdict.fault_class, verdict.scope, ranks,
                       verdict.node, verdict.device, verdict.lost, verdict.needs_move, verdict.isolate, verdict.key,
                       0, verdict.code)

    def _arm_watchdog(self, out: _Out, job: Job) -> list[TimerRequest]:
        # One periodic timer per running job: its firings are log events, its re-arming needs no decision.
        interval = int(job.spec.watchdog_interval_s * NS)
        timer = self._timer(out, job, "watchdog", interval, every=interval)
        job.watchdog = timer.id
        return [timer]

    def _watchdog(self, out: _Out, job: Job) -> None:
        if job.state not in ("running", "suspect"):
            return
        view = WatchdogView(out.ts, job.step_time, tuple(
            RankActivity(r, job.last_seen[r], job.last_progress[r], job.steps[r]) for r in range(job.world)),
            tuple(job.nodes), job.rpn)
        verdicts = _ask(job, "detection", job.policies.detection.check, view)
        for verdict in verdicts:
            if job.state not in ("running", "suspect") or job.incident is not None:
                break
            self._verdict(out, job, verdict, type_="watchdog")

    def _capacity_returned(self, out: _Out) -> None:
        """Nodes came back: waiting jobs try again, elastic jobs below their size grow."""
        # Only the jobs in the index can act on it. Visiting them in submission order, re-checking each, gives
        # the decisions of a scan of every job: acting for one job never makes another one hungry.
        for job_id in sorted(self._hungry, key=self._order.__getitem__):
            job = self.jobs[job_id]
            self._touch(job)
            if job.state == "waiting" and job.incident is not None:
                self._plan(out, job)
            elif (job.state == "running" and job.incident is None and job.spec.elastic is not None
                  and job.layout.dp < job.target_dp):
                self._scale(out, job, job.target_dp, "nodes returned: scale out", cause="scale")
            if not _hungry(job):
                self._note_indexes()
                self._hungry.pop(job_id, None)

    # -- operators ------------------------------------------------------------------------------------
    def _operator(self, out: _Out, job: Job, type_: str, data: Any) -> None:
        if type_ == "operator.cancel":
            stopping = [r for r in range(job.world) if job.alive[r]]
            command = StopRanks(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                                ranks=stopping, mode="kill", grace_s=0)
            cancelled = self._cancel(*self._job_timers(job))
            job.suspects.clear()
            job.watchdog = None
            if job.incident is not None:
                self._close_incident(job, out.ts, "cancelled")
            for name in job.nodes:
                self.cluster.release(name, job.id)
            self._decide(out, job, "job.cancelled", data.reason or "cancelled by an operator", trigger="cancel",
                         commands=[command] if stopping else [], cancelled=cancelled)
        elif type_ == "operator.pause":
            if job.state in ("paused", "submitted"):
                raise _Reject("invalid_state", f"job {job.id} is {job.state}: nothing to pause")
            self._supersede(out, job, "operator pause")
            incident = self._open(out, job, "operator")
            attempt = Attempt(number=len(incident.attempts) + 1, granularity=G.RESTART_JOB, rung=0,
                              purpose="pause", reason=data.reason or "paused by an operator", started=out.ts)
            self._start(out, job, attempt, 900 * NS, None, [])
        elif type_ == "operator.resume":
            if job.state != "paused" or job.incident is None:
                raise _Reject("invalid_state", f"job {job.id} is {job.state}, not paused")
            attempt = Attempt(number=len(job.incident.attempts) + 1, granularity=G.RESTART_JOB, rung=0,
                              purpose="resume", reason="resumed by an operator", started=out.ts)
            # Leave `paused` as the attempt starts: the machine allows only `reschedule` out of it, and the
            # resume may first need to save, stop stray processes or wait for nodes (legal from rescheduling).
            self._start(out, job, attempt, 900 * NS, None, self._vacate(job), trigger="reschedule")
        elif type_ == "operator.scale":
            elastic = job.spec.elastic
            if elastic is None or not elastic.min_dp <= data.dp <= elastic.max_dp:
                limits = "not elastic" if elastic is None else f"elastic [{elastic.min_dp}, {elastic.max_dp}]"
                raise _Reject("invalid_request", f"job {job.id} cannot scale to dp={data.dp}: {limits}")
            if job.state != "running":
                raise _Reject("invalid_state", f"job {job.id} is {job.state}; scale when it is running")
            if data.dp != job.layout.dp:
                self._scale(out, job, data.dp, f"operator scale to dp={data.dp}", cause="operator")
            # Only once _scale accepted it: a rejected dp (not whole nodes) kept as the target made every later
            # node.joined/ready fail in _capacity_returned with this job's error.
            job.target_dp = data.dp
            if _hungry(job):
                self._note_indexes()
                self._hungry[job.id] = None
        elif type_ == "operator.force":
            if job.state in ("submitted", "paused"):
                raise _Reject("invalid_state", f"job {job.id} is {job.state}; nothing to recover")
            self._supersede(out, job, f"operator forced {data.granularity.value}")
            self._open(out, job, "operator")
            self._plan(out, job, forced=data.granularity)

    def _supersede(self, out: _Out, job: Job, reason: str) -> None:
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is not None:
            attempt.outcome = "superseded"
            cancelled = self._cancel(attempt.deadline_timer, *(timer for _, timer in attempt.pending.values()))
            attempt.pending.clear()
            self._decide(out, job, "attempt.superseded", reason, cancelled=cancelled,
                         detail={"attempt": attempt.number})

    def _open(self, out: _Out, job: Job, cause: str) -> Incident:
        if job.incident is None:
            cancelled = self._cancel(job.watchdog)
            job.watchdog = None
            job.incident = Incident(id=job.next_incident_id(), opened_seq=out.seq, opened=out.ts,
                                    fault_step=job.step, fault_class=None, cause=cause)
            if cancelled:
                self._decide(out, job, "watchdog.disarmed", f"{cause} incident", cancelled=cancelled)
        return job.incident

    def _scale(self, out: _Out, job: Job, dp: int, reason: str, cause: str) -> None:
        per_replica = job.layout.tp * job.layout.pp
        need = dp * per_replica
        if need % job.rpn:
            raise _Reject("invalid_request", f"dp={dp} needs {need} ranks, not a whole number of "
                                             f"{job.rpn}-rank nodes")
        have = len([n for n in job.nodes if self.cluster.usable_by(n, job.rpn)]) + len(self._spares_for(job))
        dp = min(dp, _fit_dp(job.layout, job.rpn, have, dp) or job.layout.dp)
        if dp == job.layout.dp:
            return
        incident = self._open(out, job, cause)
        g = G.SCALE_OUT if dp > job.layout.dp else G.SCALE_IN
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=g, rung=0, purpose="scale",
                          reason=reason, started=out.ts, dp=dp)
        self._start(out, job, attempt, 900 * NS, None, [])

    def _fail_job(self, out: _Out, job: Job, reason: str, policy: str | None) -> None:
        command = FailJob(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                          reason=reason)
        cancelled = self._cancel(*self._job_timers(job))
        if job.incident is not None:
            self._close_incident(job, out.ts, "failed")
        job.suspects.clear()
        job.watchdog = None
        for name in job.nodes:
            self.cluster.release(name, job.id)
        self._decide(out, job, "job.failed", reason, trigger="fail", policy=policy, commands=[command],
                     cancelled=cancelled)

    # -- views ----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq,
                "jobs": {job_id: self.jobs[job_id].snapshot() for job_id in sorted(self.jobs)},
                "timers": [{"id": t, "job": j, "due": d, "every": e} for t, (j, d, e) in self.timers.items()],
                "nodes": [self.cluster.nodes[n].snapshot() for n in sorted(self.cluster.nodes)]}


class _Undo:
    """What the record being applied changed, as it was before: enough to undo it exactly."""

    __slots__ = ("created", "finished", "hungry", "jobs", "nodes", "seen", "submissions", "timer_order", "timers")

    def __init__(self, engine: Engine) -> None:
        self.jobs: dict[str, tuple[Job, Memento]] = {}
        self.nodes: dict[str, Any] = {}
        self.timers: dict[str, tuple[str, int, int | None] | None] = {}
        self.timer_order: list[str] | None = None
        self.hungry: dict[str, None] | None = None
        self.finished: dict[str, None] | None = None
        self.created: str | None = None
        self.submissions = engine._submissions
        self.seen: tuple[dict[str, None], str, str | None] | None = None


MAX_WIRE_INT = 2**63 - 1
"""the largest integer every consumer of the log can read (a signed 64-bit one); timers are nanoseconds"""


def _check_encodable(effects: list[Effect]) -> None:
    """Numbers the engine computed (due times) must fit the wire; everything else it copies from validated
    input. A decision that cannot be written would stop every consumer of the log on the same record."""
    for effect in effects:
        if isinstance(effect, Decision):
            for timer in effect.timers:
                if not 0 <= timer.due <= MAX_WIRE_INT or (timer.every is not None
                                                         and not 0 < timer.every <= MAX_WIRE_INT):
                    raise _Reject("unencodable", f"timer {timer.id} due at {timer.due} ns every {timer.every} "
                                                 f"ns does not fit a 64-bit integer")


def _ask(job: Job, family: str, call: Callable[[Any], _T], argument: Any) -> _T:
    """Call a policy. Policies are third-party code: an exception fails this record (rolled back, dead-lettered
    as `policy_error` naming the policy), never the engine."""
    try:
        return call(argument)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise _Reject("policy_error", f"{family} policy {job.policies.labels.get(family, '?')} raised "
                                      f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})") from exc


_DEST = {t["trigger"]: t["dest"] for t in TRANSITIONS}
_PROCESS_FAULTS = (FaultClass.PROCESS, FaultClass.HANG, None)


def _hungry(job: Job) -> bool:
    """Can nodes coming back help this job: is it waiting for nodes, or elastic and below its target size?"""
    return ((job.state == "waiting" and job.incident is not None)
            or (job.state == "running" and job.incident is None and job.spec.elastic is not None
                and job.layout.dp < job.target_dp))


def _fit_dp(layout: Layout, rpn: int, nodes: int, cap: int) -> int | None:
    """The largest dp <= cap whose ranks fill whole nodes among `nodes`."""
    per_replica = layout.tp * layout.pp
    dp = min(cap, nodes * rpn // per_replica)
    while dp >= 1 and (dp * per_replica) % rpn:
        dp -= 1
    return dp if dp >= 1 else None


def _incident_usage(incident: Incident) -> dict[str, int]:
    """Attempts of this incident by '<class>/<granularity>' and by granularity: the ladder's rung budgets are
    per incident (how often a rung is tried before the next), and the spec's max_restarts covers the job's
    life; a life-long rung budget ran out within two weeks at 16,384 GPUs and failed healthy jobs."""
    used: dict[str, int] = {}
    for attempt in incident.attempts:
        if attempt.outcome != "superseded":
            for key in attempt.budget_keys:
                used[key] = used.get(key, 0) + 1
    return used


def _tier_counts(plan: ResumePlan) -> dict[str, int]:
    """Shards per tier the plan reads from."""
    counts: dict[str, int] = {}
    for source in plan.shards:
        counts[source.tier.value] = counts.get(source.tier.value, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["Effect", "Engine", "label"]

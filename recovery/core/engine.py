"""The engine: a pure function of the log.

`Engine.apply(record)` reads only the record and the engine's state and returns effects: decisions
(each with its commands and timers) and rejections. It never reads a clock (log time is the record's
`ts`), never does I/O, and iterates only in log order or sorted order, so a replay of the same log
gives the same decisions byte for byte under any PYTHONHASHSEED.

This module is the entry point and the router: it checks each record (subject, duplicate, job, rank), keeps the
jobs' progress (the hot path: heartbeats and steps), keeps the journal that undoes a record which fails half way,
and hands the rest to the engine's parts, one concern each:

- `recovery.core.detection`: signals, suspicions and their confirmation, the watchdog, drains;
- `recovery.core.incidents`: the incident lifecycle (plan, save, stop, reschedule, restore, ack, deadline, close);
- `recovery.core.placement`: vacating nodes, spares, fitting data-parallel replicas;
- `recovery.core.nodes`: a node's own events (devices, links, readiness) and the signals they are for its job;
- `recovery.core.operators`: operator requests;
- `recovery.core.liveness`: signs of life from hosts declared gone, and the control plane's own outages;
- `recovery.core.timers`: the timer table and the periodic rule;
- `recovery.core.record`: the one object per record that collects the effects.
"""

from __future__ import annotations

import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from events import kinds
from events.codec import DecodeError, decode_envelope
from events.envelope import EnvelopeBase, RawRecord, Record
from events.kinds import JOB_EVENTS, NODE_EVENTS
from events.kinds import PolicyOverran as PolicyOverranFact
from events.names import DecisionKind, IncidentCause, IncidentOutcome
from events.outputs import Rejection
from events.subjects import is_output, job_event, node_event
from policies.base import Signal, label
from policies.registry import PolicyError, load_set
from recovery.core.cluster import ClusterView
from recovery.core.containment import contain
from recovery.core.detection import Detection
from recovery.core.failures import exit_text, note_exit, stop_like
from recovery.core.firings import JOINS, SEALED_FACTS, admit_fact, admit_firing, unknown_node
from recovery.core.incidents import MAX_PLANS_PER_RECORD, Incidents
from recovery.core.job import DEDUPE_WINDOW, Job, hungry
from recovery.core.journal import Journal
from recovery.core.liveness import Liveness
from recovery.core.machine import FINAL
from recovery.core.nodes import apply_node_event
from recovery.core.operators import Operators
from recovery.core.overruns import CallKey, PolicyCalls, PolicyOverran
from recovery.core.partition import Partition
from recovery.core.placement import Placement
from recovery.core.processes import AFTER_THE_END, NOTED, note
from recovery.core.progress import Progress, implausible_checkpoint
from recovery.core.record import Effect, RecordEffects, Rejected, check_encodable
from recovery.core.steady import steady
from recovery.core.timers import Timekeeper, TimerEntry

_PROGRESS = ("process.heartbeat", "progress.step", "progress.report", "progress.summary")
_FOLDS = ("progress.report", "progress.summary")  # of several ranks: an agent's period, or the daemon's summary
NODE_DEDUPE_WINDOW = 65_536
FINISHED_JOBS_KEPT = 256
"""completed, failed and cancelled jobs kept for `recovery-ctl` and late events; older ones are forgotten (the log
keeps everything), so that a daemon running for months does not grow with every job it ever saw. A constant, not
a setting: a replay must forget exactly what the daemon forgot."""


class Engine(Progress):
    partition: Partition | None = None
    """the partition of jobs this engine decides for (None: every job); it grants only the spares it owns"""
    firing_seal: Callable[[str], str] | None = None
    """the deployment's seal of timer firings, in the daemon (`recovery.core.firings`); never in a snapshot"""
    firings_sealed = False
    """whether the log has held a sealed timer firing: from there on, every firing must be sealed"""
    sealed_from: int | None = None
    """the log's first sequence from which every daemon-only record must be sealed, whatever came before (the
    daemon's, from the log's metadata; None: a replay that does not know it); never in a snapshot"""
    nodes_from: int | None = None
    """the daemon's: from this sequence on, a node event of a node that never joined is dead-lettered"""
    unknown_nodes_at: frozenset[int] = frozenset()
    """a replay's: the inputs the daemon dead-lettered `unknown_node` (`recovery.core.firings.unknown_nodes_in`)"""
    policy_calls: PolicyCalls | None = None
    """where the host runs third-party policies, within a budget (`recovery.plugins`); never in a snapshot"""
    overruns: Mapping[CallKey, PolicyOverranFact] = MappingProxyType({})
    """the calls the log says were abandoned (`recovery.core.overruns`), set by the driver; never in a snapshot"""

    def __init__(self, partition: Partition | None = None) -> None:
        if partition is not None:  # unset otherwise: a single partition's snapshot is what it always was
            self.partition = partition
        self.cluster = ClusterView()
        self.jobs: dict[str, Job] = {}
        self.last_seq = 0
        self._node_seen: OrderedDict[str, None] = OrderedDict()
        self._order: dict[str, int] = {}  # job id -> submission index: the order of self.jobs
        self._hungry: dict[str, None] = {}  # every job that _hungry() holds for, and maybe some it no longer does
        self._finished: dict[str, None] = {}  # jobs in a final state, in the order they got there
        self._submissions = 0  # jobs ever accepted: the next one's place in _order (forgotten jobs leave gaps)
        self.journal: Journal | None = None  # what the record being applied changed, if it changes anything
        self._last: tuple[Journal | None, Record | RawRecord, EnvelopeBase] | None = None  # for revoke()
        # The parts, each owning one concern of the engine's single state.
        self.timekeeper = Timekeeper()
        self.placement = Placement(self.cluster)
        self.incidents = Incidents(self.cluster, self.timekeeper, self.placement)
        self.detection = Detection(self.cluster, self.timekeeper, self.placement, self.incidents)
        self.operators = Operators(self.cluster, self.timekeeper, self.placement, self.incidents)
        self.liveness = Liveness(self.cluster, self.jobs, self.guard, self.capacity_returned)

    @property
    def timers(self) -> dict[str, TimerEntry]:
        """Outstanding timers, id -> (job, due, every), in request order: what a driver arms."""
        return self.timekeeper.table

    @timers.setter
    def timers(self, table: dict[str, TimerEntry]) -> None:
        self.timekeeper.table = table

    def __getstate__(self) -> dict[str, Any]:
        # The journal and the last record are about the record just applied, not the engine's state: a
        # snapshot leaves them out (and the envelope models made at import time do not pickle).
        state = {**self.__dict__, "journal": None, "_last": None, "closing": False}
        state.pop("firing_seal", None), state.pop("sealed_from", None), state.pop("nodes_from", None)  # the daemon's
        state.pop("policy_calls", None), state.pop("overruns", None)  # the host's, and the log's: set again there
        return state

    def apply(self, record: Record | RawRecord) -> list[Effect]:
        """Apply one log record; return its effects. Bad input becomes a Rejection and changes nothing.

        So does a record whose handling fails half way (a bug, a policy that raises, a value that cannot be
        encoded): everything the record changed is undone from the journal and the record is dead-lettered, so
        that one poisoned record never stops the daemon nor leaves a job half changed."""
        self.last_seq = record.seq
        self.journal = self._last = None
        if isinstance(record, RawRecord):
            if is_output(record.subject):
                return []
            decoded = decode_envelope(record.data)
            if isinstance(decoded, DecodeError):
                return [self._rejection(record, decoded.code, decoded.reason, decoded.event_id,
                                        decoded.job, decoded.node)]
            envelope: EnvelopeBase = decoded
        else:
            envelope = record.envelope
        try:
            # Most records only keep count: applied in place, or declined untouched (`recovery.core.steady`).
            if steady(self.jobs, self.cluster, record.subject, record.ts, envelope):
                if len(self._finished) > FINISHED_JOBS_KEPT:
                    self._forget_finished()  # as after any record (one contained below may have left some)
                return []
            if is_output(record.subject):
                return []  # our own decisions and dead letters, kept in the log for audit
            out = RecordEffects(self, record.seq, record.ts)
            if envelope.type == "timer.fired":
                admit_firing(self, record, envelope)
            elif envelope.type in SEALED_FACTS:
                admit_fact(self, record, envelope)
            self._dispatch(out, record.subject, envelope)
            effects = out.effects
            if effects:
                check_encodable(effects)
        except Exception as exc:  # a bug must not stop the daemon; it is kept, with its cause, in the log
            self.rollback()
            if isinstance(exc, PolicyOverran):
                raise  # the record is undone: its driver writes the fact and applies it again (`core.overruns`)
            if isinstance(exc, Rejected):
                code, reason = exc.code, exc.reason
            else:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                code, reason = "internal_error", f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"
            rejection = self._rejection(record, code, reason, envelope.id, envelope.job, envelope.node)
            if code not in ("internal_error", "policy_error"):
                return [rejection]
            # A bug of ours (or of a built-in policy) must not strand the job: it moves on to a safe action.
            undo = self.journal
            effects = contain(self, record.seq, record.ts, envelope, reason)
            self._last = (undo, record, envelope) if effects else None
            return [rejection, *effects]
        undo = self.journal
        self.commit()
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
        self.journal, self._last = undo, None
        self.rollback()
        return self._rejection(record, "unencodable", reason, envelope.id, envelope.job, envelope.node)

    def guard(self, job: Job | None) -> Journal:
        """Open the journal for this record (most heartbeats and steps never do) and note `job` in it."""
        undo = self.journal
        if undo is None:
            undo = self.journal = Journal(self._submissions)
            self.cluster.journal = undo.nodes
            self.timekeeper.journal = undo
        if job is not None and job.id not in undo.jobs:
            undo.jobs[job.id] = (job, job.memento())
        return undo

    def touch(self, job: Job) -> None:
        undo = self.journal
        if undo is not None and job.id not in undo.jobs:
            undo.jobs[job.id] = (job, job.memento())

    def note_indexes(self) -> None:
        undo = self.journal
        if undo is not None and undo.hungry is None:
            undo.hungry, undo.finished = dict(self._hungry), dict(self._finished)

    def commit(self) -> None:
        """The record succeeded: later changes are not its to undo."""
        undo = self.journal
        if undo is not None:  # most heartbeats and steps never open one
            self.cluster.journal = self.timekeeper.journal = None
            for job, _ in undo.jobs.values():
                job.end_journal()
            self.journal = None

    def rollback(self) -> None:
        undo = self.journal
        self.journal = None
        if undo is None:
            return
        self.cluster.journal = self.timekeeper.journal = None
        for job, memento in undo.jobs.values():
            job.restore(memento)
        if undo.created is not None:
            self.jobs.pop(undo.created, None)
            self._order.pop(undo.created, None)
            self._submissions = undo.submissions
        self.cluster.rollback(undo.nodes)
        self.timekeeper.restore(undo.timers, undo.timer_order)
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
            for timer_id in self.timekeeper.of_job(job):  # none are left by a final state; this keeps it so
                del self.timers[timer_id]

    @staticmethod
    def _rejection(record: Record | RawRecord, code: str, reason: str, event_id: str | None,
                   job: str | None, node: str | None) -> Rejection:
        return Rejection(seq=record.seq, subject=record.subject, code=code, reason=reason, event_id=event_id,
                         job=job, node=node)

    def _dispatch(self, out: RecordEffects, subject: str, env: EnvelopeBase) -> None:
        type_ = env.type
        if type_ in JOB_EVENTS:
            if env.job is None:
                raise Rejected("schema_violation", f"{type_} is a job event but the envelope names no job")
            if subject != job_event(env.job, type_):
                raise Rejected("subject_mismatch", f"{type_} for job {env.job} arrived on {subject!r}, "
                                                  f"expected {job_event(env.job, type_)!r}")
            job = self.jobs.get(env.job)
            if type_ == "job.submitted":
                if job is not None:
                    raise Rejected("duplicate", f"job {env.job} was already submitted")
                self._submit(out, env.job, env.data)
                return
            if job is None:
                raise Rejected("unknown_job", f"{type_} for job {env.job}, which was never submitted")
            seen = job.seen
            if env.id in seen:
                raise Rejected("duplicate", f"event id {env.id!r} already applied to job {env.job}")
            speaker = self.liveness.speaker(job, type_, env)  # before the event may move the job
            if type_ in _PROGRESS:
                incident = job.incident
                entries = env.data.ranks if type_ in _FOLDS else [env.data]
                self.closing = (incident is not None and incident.phase == "restoring"
                                and self.incidents.may_close(job, entries))
                if self.closing:
                    # Progress past the resume point closes the incident: journaled, should a later entry fail it.
                    # Only such a record is (every report of every rank until then would copy the job's state).
                    self.guard(job)
                if type_ in _FOLDS:  # a summary is never refused: what it says that is past is left out
                    if type_ == "progress.report" and len(entries) > 1 and self.report_refused(job, entries):
                        self.guard(job)  # a later rank's entry that is refused must undo the earlier ones
                    self.report_losses(out, job, env.data.ranks)
                    for entry in env.data.ranks:  # each as its rank's own heartbeat or step would be
                        self._progress(out, job, entry)
                    if type_ == "progress.summary" and env.data.watch and job.watchdog is not None:
                        self.guard(job)  # the watchdog's check at the summary, and its next tick moved
                        self.detection.watch(out, job, env.data.period_s)
                else:
                    if getattr(env.data, "loss", None) is not None:
                        self.guard(job)  # the step after its loss may yet be refused (backwards, ahead)
                        self.step_loss(out, job, env.data)
                    self._progress(out, job, env.data)
            else:
                self.guard(job)
                self._job_event(out, job, type_, env.data)
            if speaker is not None:
                # The agent's report is its sign of life too: it sends no node.heartbeat in a period it reported in
                # (half the inputs of a large job). Any event of a host declared gone brings it back.
                self.liveness.heard_from(out, job, speaker, report=type_ == "progress.report")
            if self.journal is None:  # the hot path: Engine._remember without the journal
                seen[env.id] = None
                if len(seen) > DEDUPE_WINDOW:
                    del seen[next(iter(seen))]
            else:
                self._remember(seen, env.id, DEDUPE_WINDOW)
        elif type_ in NODE_EVENTS:
            if env.node is None:
                raise Rejected("schema_violation", f"{type_} is a node event but the envelope names no node")
            if subject != node_event(env.node, type_):
                raise Rejected("subject_mismatch", f"{type_} for node {env.node} arrived on {subject!r}, "
                                                  f"expected {node_event(env.node, type_)!r}")
            if env.id in self._node_seen:
                raise Rejected("duplicate", f"event id {env.id!r} already applied")
            if env.node not in self.cluster.nodes and type_ not in JOINS and unknown_node(self, out.seq):
                raise Rejected("unknown_node", f"{type_} from node {env.node!r}, which never joined: no node.joined "
                                               f"or node.ready (its agent's start), no job placed on it")
            self.guard(None)
            apply_node_event(self, out, env.node, type_, env.data)
            self._remember(self._node_seen, env.id, NODE_DEDUPE_WINDOW)
        else:
            raise Rejected("unknown_type", f"{type_} is not an input event")

    def _remember(self, seen: dict[str, None], event_id: str, window: int) -> None:
        """Note an applied event id for deduplication, once its record has succeeded."""
        seen[event_id] = None
        evicted = None
        if len(seen) > window:
            evicted = next(iter(seen))
            del seen[evicted]
        if self.journal is not None:
            self.journal.seen = (seen, event_id, evicted)

    def indexed(self, job: Job, previous: str) -> None:
        """Keep the indexes of jobs by state up to date after a decision (every change of state is one)."""
        if hungry(job):
            self.note_indexes()
            self._hungry[job.id] = None
        if job.state in FINAL and previous not in FINAL:
            self.note_indexes()
            self._finished[job.id] = None

    def _submit(self, out: RecordEffects, job_id: str, data: kinds.JobSubmitted) -> None:
        spec = data.spec
        try:
            policies = load_set(spec.policies)
        except PolicyError as exc:
            raise Rejected("invalid_policy", str(exc)) from exc
        for name in spec.nodes:
            node = self.cluster.nodes.get(name)
            if node is not None and node.job is not None:
                raise Rejected("placement_conflict", f"node {name} already runs job {node.job}")
            if node is not None and node.isolated:
                raise Rejected("placement_conflict", f"node {name} is isolated")
        job = Job(job_id, spec, policies)
        undo = self.guard(None)
        undo.created, undo.submissions = job_id, self._submissions
        self.jobs[job_id] = job
        self._order[job_id] = self._submissions
        self._submissions += 1
        for name in spec.nodes:
            self.cluster.assign(name, job_id)
        out.decide(job, DecisionKind.JOB_ACCEPTED, f"{spec.layout.world} ranks on {len(spec.nodes)} nodes",
                   detail={"policies": dict(policies.labels)})

    def _job_event(self, out: RecordEffects, job: Job, type_: str, data: Any) -> None:
        if job.state in FINAL and type_ not in AFTER_THE_END and type_ not in ("checkpoint.saved", "policy.overran"):
            raise Rejected("invalid_state", f"job {job.id} is {job.state}; {type_} has no effect")
        if type_ == "job.started":
            if job.state != "submitted":
                raise Rejected("invalid_state", f"job {job.id} is already {job.state}")
            # Whole arrays replaced, not written rank by rank: the journal restores the old objects.
            job.alive = bytearray(b"\x01") * job.world
            job.last_seen = [out.ts] * job.world
            job.last_progress = [out.ts] * job.world
            out.decide(job, DecisionKind.JOB_STARTED, "processes started", trigger="start",
                       timers=self.timekeeper.arm_watchdog(out, job))
        elif type_ in NOTED:
            note(job, type_, data, out.ts, lambda j, rank, attempt: self._check_rank(j, rank, attempt, False))
        elif type_ == "checkpoint.saved":
            shards = job.shards_at(data.step)
            bad = [s for s in data.shards if s >= shards]
            if bad:
                raise Rejected("schema_violation", f"shards {bad} do not exist: step {data.step} is in {shards}")
            implausible = implausible_checkpoint(job, data.step, out.ts)
            if implausible is not None:
                raise Rejected("implausible", implausible)
            job.add_checkpoint(data.step, data.tier, data.shards, data.holder)
            attempt = job.incident.attempt if job.incident is not None else None
            if (attempt is not None and attempt.awaiting is not None and job.phase == "saving"
                    and data.step >= attempt.awaiting and job.complete_at(data.step)):
                attempt.awaiting = None
                cancelled = self.timekeeper.cancel(*(timer for _, timer in attempt.pending.values()))
                attempt.pending.clear()
                out.decide(job, DecisionKind.CHECKPOINT_DYING_DONE, f"dying checkpoint at step {data.step} complete",
                           cancelled=cancelled)
                self.incidents.checkpoint(out, job, attempt)
            if job.drains and job.state == "running" and not job.suspects and job.complete_at(data.step):
                self.detection.drain(out, job, data.step)
        elif type_ in ("checkpoint.failed", "policy.overran"):
            pass  # a save that did not land; a call answered when its input was applied (`core.overruns`)
        elif type_ == "job.unserved":
            self.operators.unserved(out, job, data)
        elif type_ == "control.outage":
            self.liveness.outage(out, job, data)
        elif type_ == "command.ack":
            self.incidents.ack(out, job, data)
        elif type_ == "timer.fired":
            self._timer_fired(out, job, data)
        elif type_ == "job.completed":
            self._finish(out, job, "complete", DecisionKind.JOB_COMPLETED, "training finished")
        elif type_ == "job.cancelled":
            self._finish(out, job, "cancel", DecisionKind.JOB_CANCELLED,
                         data.reason or "cancelled by the scheduler")
        elif type_ == "operator.release":
            if self.operators.release(out, job, data):
                self.capacity_returned(out)
        elif type_.startswith("operator."):
            self.operators.handle(out, job, type_, data)
        else:  # process.exited, process.hang, process.collective_failed, network.collective_timeout
            if hasattr(data, "rank"):
                stale = self._check_rank(job, data.rank, data.attempt, progress=False)
                if stale:
                    note_exit(job, data, out.ts)  # a replaced process's failure still tells how the script fails
                    if isinstance(data, kinds.ProcessExited) and not stop_like(data):
                        out.decide(job, DecisionKind.SIGNAL_IGNORED, f"rank {data.rank}: the process of generation "
                                   f"{data.attempt} exited ({exit_text(data)}) after generation "
                                   f"{job.rank_gen[data.rank]} replaced it: no fault of the running process",
                                   detail={"signal": type_, "rank": data.rank, "attempt": data.attempt})
                    return
            if isinstance(data, kinds.CollectiveTimeout):
                if data.attempt > job.generation:
                    raise Rejected("unknown_attempt", f"attempt {data.attempt} is ahead of job {job.id}'s "
                                                     f"generation {job.generation}")
                outside = [r for r in (*data.members, *data.reporters) if r >= job.world]
                if outside:
                    raise Rejected("unknown_rank", f"ranks {sorted(set(outside))} are not in job {job.id}")
                if any(data.attempt < job.rank_gen[r] for r in data.members):
                    return  # a timeout of a group whose processes an earlier attempt already replaced
            if isinstance(data, kinds.CollectiveFailed) and data.attempt < job.generation:
                # The group of that generation was formed again since (a retry, a restart): its failure is old news.
                out.decide(job, DecisionKind.SIGNAL_IGNORED, f"rank {data.rank}: the collective of generation "
                           f"{data.attempt} failed, and generation {job.generation} has replaced that group since",
                           detail={"signal": type_, "rank": data.rank, "attempt": data.attempt})
                return
            if isinstance(data, kinds.ProcessExited):
                job.put(job.alive, data.rank, 0)
                incident = job.incident
                if incident is not None:
                    # A SIGTERM reads as the whole job's stop and marks every rank gone; which processes have ended
                    # tells the checkpoint policy which shards the exits write and which live ranks still hold
                    incident.ended.add(data.rank)  # a set: a job-wide crash's 100,000 exits add in O(1) each
                if incident is not None and data.rank in incident.exiting:
                    return  # the platform stopped the job: each rank's exit was expected, and is no news
                if incident is not None and data.rank in incident.stopped and (
                        incident.phase == "stopping" or stop_like(data)):
                    return  # the engine's own stop (RANKS_STOPPING): no fault, and never a preemption
            ranks = (data.rank,) if hasattr(data, "rank") else ()
            # Who is gone matters to a collective failure only (a survey of every rank: not for each exit).
            dead = tuple(r for r in range(job.world) if not job.alive[r]) if isinstance(
                data, kinds.CollectiveFailed) else ()
            signal = Signal(type_, data, out.ts, None, ranks, step_time_ns=job.step_time, world=job.world, dead=dead)
            if isinstance(data, kinds.ProcessExited):
                self.detection.ending = data.rank  # the exit that opens an incident is one of its ends
                try:
                    self.detection.signal(out, job, signal)
                finally:
                    self.detection.ending = None
            else:
                self.detection.signal(out, job, signal)

    def _finish(self, out: RecordEffects, job: Job, trigger: str, kind: DecisionKind, reason: str) -> None:
        cancelled = self.timekeeper.cancel(*self.timekeeper.of_job(job))
        job.suspects.clear()
        job.watchdog = None
        if job.incident is not None:
            self.incidents.close(job, out.ts, IncidentOutcome(kind))  # the incident ends as the job did
        for name in job.nodes:
            self.cluster.release(name, job.id)
        out.decide(job, kind, reason, trigger=trigger, cancelled=cancelled)

    def _timer_fired(self, out: RecordEffects, job: Job, data: kinds.TimerFired) -> None:
        timer_id = data.timer_id
        if not self.timekeeper.fired(out, job, timer_id, data.due):
            return  # stale or cancelled: harmless, and kept in the log
        if timer_id == job.watchdog:
            self.detection.tick(out, job, late_ns=out.ts - data.due)
        elif self.detection.release_due(out, job, timer_id):
            self.capacity_returned(out)
        elif not self.detection.suspicion_due(out, job, timer_id, data.due):
            self.incidents.timer_fired(out, job, timer_id)

    def capacity_returned(self, out: RecordEffects) -> None:
        """Nodes came back: waiting jobs try again, elastic jobs below their size grow."""
        # Only the jobs in the index can act on it. Visiting them in submission order, re-checking each, gives
        # the decisions of a scan of every job: acting for one job never makes another one hungry.
        for job_id in sorted(self._hungry, key=self._order.__getitem__):
            job = self.jobs[job_id]
            self.touch(job)
            if job.phase == "waiting":
                self.incidents.plan(out, job)
            elif (job.state == "running" and not job.suspects and job.spec.elastic is not None
                  and job.layout.dp < job.target_dp):
                self.incidents.scale(out, job, job.target_dp, "nodes returned: scale out",
                                     cause=IncidentCause.SCALE)
            if not hungry(job):
                self.note_indexes()
                self._hungry.pop(job_id, None)

    def snapshot(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq,
                "jobs": {job_id: self.jobs[job_id].snapshot() for job_id in sorted(self.jobs)},
                "timers": [{"id": t, "job": j, "due": d, "every": e} for t, (j, d, e) in self.timers.items()],
                "nodes": [self.cluster.nodes[n].snapshot() for n in sorted(self.cluster.nodes)]}


__all__ = ["MAX_PLANS_PER_RECORD", "Effect", "Engine", "label"]

"""Containment: a record whose handling failed (a bug of the engine, an error of a built-in policy) still leaves its
job a way forward.

The engine undoes everything such a record changed and dead-letters it (`internal_error`, `policy_error`). Before
this, that was all: a job whose ack, timer or fault was dead-lettered stayed where it was, in `recovering`, with the
timers that would have moved it on failing the same way each time they fired. Now the job is moved on to a safe
action, in a decision that says why: a job-level restart from the newest complete checkpoint (it replaces every
process and the whole placement, so it depends least on the state the failed handling saw), or, when that cannot be
placed or fails as well, a bounded wait whose deadline asks the rescheduling policy again.

Deterministic like the rest of the engine: it reads only the record, the engine's state and the error's text, which
the same code gives for the same log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from events.envelope import EnvelopeBase
from events.names import AttemptOutcome, AttemptPurpose, DecisionKind, IncidentCause
from events.values import FaultClass, Granularity
from policies.base import NS
from recovery.core.cluster import ClusterView
from recovery.core.incidents import MAX_WAIT_NS, Incidents
from recovery.core.job import Attempt, Job
from recovery.core.machine import FINAL
from recovery.core.overruns import PolicyOverran
from recovery.core.placement import Placement
from recovery.core.record import Effect, RecordEffects, check_encodable
from recovery.core.timers import Timekeeper


class Engine(Protocol):
    """What containment needs of the engine (`recovery.core.engine.Engine`), which calls in."""

    jobs: dict[str, Job]
    cluster: ClusterView
    incidents: Incidents
    placement: Placement
    timekeeper: Timekeeper

    def guard(self, job: Job | None) -> Any: ...

    def rollback(self) -> None: ...

    def commit(self) -> None: ...

G = Granularity
SAFE_RESTART_DEADLINE_NS = 900 * NS
"""the deadline of a contained job-level restart: the ladder's for the same rung"""
_FAULTS = frozenset(("process.exited", "process.hang", "process.collective_failed", "device.fault", "node.not_ready",
                     "network.link_down", "network.collective_timeout"))
"""records that may carry a fault: a running job whose handling of one failed may have lost a rank and not know it;
of any other record (progress, a watchdog tick, a checkpoint), it has lost nothing, and goes on running"""


def contain(engine: Engine, seq: int, ts: int, envelope: EnvelopeBase, error: str) -> list[Effect]:
    """The effects that move the job of a record whose handling failed (already undone) on to a safe action; none
    when the record names no live job, the job is paused by an operator, or it runs and the record carried no
    fault."""
    job = _job_of(engine, envelope)
    if job is None or job.state in FINAL or job.state == "paused" or job.state == "submitted":
        return []
    if job.incident is None and envelope.type not in _FAULTS:
        return []
    why = f"the engine failed handling {envelope.type} (seq {seq}): {error}"

    def safely(out: RecordEffects, action: Callable[[Engine, RecordEffects, Job, str], None]) -> None:
        if envelope.type == "timer.fired":
            # The timer has fired, as far as the engine is concerned: the safe action replaces what it was for (a
            # driver re-fires a timer only when the record changed nothing).
            engine.timekeeper.fired(out, job, envelope.data.timer_id, envelope.data.due)
        action(engine, out, job, why)

    for action in (_restart_whole, _wait):
        effects = _try(engine, seq, ts, job, lambda out, act=action: safely(out, act))
        if effects is not None:
            return effects
    return []


def _try(engine: Engine, seq: int, ts: int, job: Job, action: Callable[[RecordEffects], None]) -> list[Effect] | None:
    """Run `action` under the engine's journal: its effects if it succeeds, else None with everything undone."""
    out = RecordEffects(engine, seq, ts)
    try:
        engine.guard(job)
        action(out)
        effects = out.effects
        if effects:
            check_encodable(effects)
    except Exception as exc:  # the safe action failed too: undo it and try the next, smaller one
        engine.rollback()
        if isinstance(exc, PolicyOverran):
            raise  # a plugin's call abandoned: the driver applies the record again (`recovery.core.overruns`)
        return None
    engine.commit()
    return effects


def _job_of(engine: Engine, envelope: EnvelopeBase) -> Job | None:
    if envelope.job is not None:
        return engine.jobs.get(envelope.job)
    node = engine.cluster.nodes.get(envelope.node) if envelope.node is not None else None
    return engine.jobs.get(node.job) if node is not None and node.job is not None else None


def _end_attempt(engine: Engine, out: RecordEffects, job: Job, why: str) -> None:
    """Open the incident if none is (the failed record may have been its fault) and end its attempt under way."""
    incidents = engine.incidents
    incident = incidents.open(out, job, IncidentCause.FAULT)
    if incident.fault_class is None:
        incident.fault_class = FaultClass.PROCESS
    attempt = incident.attempt
    if attempt is not None:
        incidents.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED, f"superseded: {why}", plan=False)
    cancelled = engine.timekeeper.cancel(incident.settle_timer)
    incident.settle_timer = None
    incident.widened = False
    if cancelled:
        out.decide(job, DecisionKind.ATTEMPT_SUPERSEDED, f"settle window ended: {why}", cancelled=cancelled)


def _restart_whole(engine: Engine, out: RecordEffects, job: Job, why: str) -> None:
    """A job-level restart from the newest complete checkpoint the checkpoint policy finds, on the job's usable nodes
    and spares."""
    incidents = engine.incidents
    vacate = engine.placement.vacate(job)
    if len(vacate) > len(engine.placement.spares_for(job)):
        raise _Unplaceable  # no nodes for it now: the bounded wait instead
    _end_attempt(engine, out, job, why)
    incident = job.incident
    assert incident is not None
    ladder_top = 0
    attempt = Attempt(number=len(incident.attempts) + 1, granularity=G.RESTART_JOB, rung=ladder_top,
                      purpose=AttemptPurpose.RECOVER, started=out.ts,
                      reason=f"{why}: restart the whole job from the newest complete checkpoint (contained)")
    attempt.budget_keys = (f"{incident.fault_class.value if incident.fault_class else 'process'}/restart_job",
                           "restart_job")
    for key in attempt.budget_keys:
        job.used[key] = job.used.get(key, 0) + 1
    job.restarts_used += 1
    deadline = max(SAFE_RESTART_DEADLINE_NS, 3 * (job.step_time or 0))
    incidents.start(out, job, attempt, deadline, "engine", vacate)


def _wait(engine: Engine, out: RecordEffects, job: Job, why: str) -> None:
    """A bounded wait: at its deadline the rescheduling policy is asked again, with whatever has changed by then."""
    _end_attempt(engine, out, job, why)
    incidents = engine.incidents
    incident = job.incident
    assert incident is not None
    if incident.phase != "planning":
        incident.move("plan", out.ts)
    timers, cancelled = incidents._wait(out, job, MAX_WAIT_NS)
    out.decide(job, DecisionKind.ATTEMPT_WAITING, f"{why}: wait for nodes, at most {MAX_WAIT_NS // NS} s, then ask "
               f"the rescheduling policy again (contained)", policy="engine", timers=timers,
               cancelled=cancelled, detail={"contained": why})


class _Unplaceable(Exception):
    """A job-level restart lacks the nodes now."""

"""The closed sets of names the engine writes: decision kinds, incident causes and outcomes, attempt purposes and
outcomes, and the purposes that head its timer ids.

Each is a `StrEnum` whose values are the strings on the wire, so a member encodes to exactly the bytes the plain
string did, compares equal to it, and a recorded log reads back into members. A name outside its set is a typo the
type checker and the decoder catch, where a free string would drift.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class DecisionKind(StrEnum):
    """What a decision says happened to a job (`Decision.kind`), grouped by the part of recovery that takes it."""

    # the job's lifecycle
    JOB_ACCEPTED = "job.accepted"
    JOB_UNSERVED = "job.unserved"  # no agent serves some of its nodes: its ranks there cannot start
    JOB_STARTED = "job.started"
    JOB_PAUSED = "job.paused"
    JOB_COMPLETED = "job.completed"
    JOB_CANCELLED = "job.cancelled"
    JOB_FAILED = "job.failed"
    CONTROL_OUTAGE = "control.outage"  # the control plane was away: whether silence within the outage counts
    PROGRESS_CORRECTED = "progress.corrected"  # a rank's step counter that had jumped implausibly far ahead
    # detection: signals, suspicions, confirmed faults, hardware and drains
    SIGNAL_IGNORED = "signal.ignored"
    FAULT_SUSPECTED = "fault.suspected"
    FAULT_CLEARED = "fault.cleared"
    FAULT_CONFIRMED = "fault.confirmed"  # opens an incident
    FAULTS_CONFIRMED_TOGETHER = "faults.confirmed_together"
    FAULT_ADDED = "fault.added"  # joins the open incident
    FAULT_ABSORBED = "fault.absorbed"  # already covered by the attempt under way
    HARDWARE_MARKED = "hardware.marked"  # hardware no rank of the job uses is out of service
    HARDWARE_RELEASED = "hardware.released"  # an isolated node or device is usable again (repair, expiry, operator)
    NODE_DRAIN_PLANNED = "node.drain_planned"
    NODE_DRAIN_DEFERRED = "node.drain_deferred"
    WATCHDOG_DISARMED = "watchdog.disarmed"
    WATCHDOG_RESUMED = "watchdog.resumed"  # the summaries that paced it stopped: it ticks every interval again
    # an incident's attempts
    ATTEMPT_SETTLING = "attempt.settling"
    ATTEMPT_WAITING = "attempt.waiting"
    WAIT_EXPIRED = "attempt.wait_expired"  # the wait's deadline passed: the policy's fallback follows
    ATTEMPT_STARTED = "attempt.started"
    ATTEMPT_FAILED = "attempt.failed"
    ATTEMPT_TIMED_OUT = "attempt.timed_out"
    ATTEMPT_SUPERSEDED = "attempt.superseded"
    # an attempt's steps: where the state comes from, stopping, restarting, restoring
    CHECKPOINT_PLAN = "checkpoint.plan"
    CHECKPOINT_DYING = "checkpoint.dying"
    CHECKPOINT_AWAITING = "checkpoint.awaiting"
    CHECKPOINT_DYING_DONE = "checkpoint.dying_done"
    CHECKPOINT_DYING_FAILED = "checkpoint.dying_failed"
    RANKS_STOPPING = "ranks.stopping"
    RANKS_STOPPED = "ranks.stopped"
    RANKS_RESCHEDULING = "ranks.rescheduling"
    RANKS_RESTORING = "ranks.restoring"
    COMMAND_DONE = "command.done"  # one of several pending commands acknowledged
    INCIDENT_CLOSED = "incident.closed"
    # policies
    POLICY_FAILED = "policy.failed"  # a plugin raised, answered out of bounds or looped: the built-in answered


@unique
class IncidentCause(StrEnum):
    """Why an incident was opened."""

    FAULT = "fault"  # a confirmed fault; the only cause whose incident counts lost steps
    DRAIN = "drain"  # sub-health: a planned move off a node at a complete checkpoint
    OPERATOR = "operator"  # pause, force or scale by an operator
    SCALE = "scale"  # nodes came back: an elastic job grows to its target size


@unique
class IncidentOutcome(StrEnum):
    """How an incident ended. A job that ends while an incident is open closes it with the kind of the decision
    that ended the job (`job.completed`, `job.cancelled` from the scheduler); an operator's cancel closes it as
    `cancelled`."""

    RECOVERED = "recovered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    JOB_COMPLETED = "job.completed"
    JOB_CANCELLED = "job.cancelled"


@unique
class AttemptPurpose(StrEnum):
    """What a recovery attempt is for."""

    RECOVER = "recover"  # a rung of the rescheduling policy's ladder
    DUMP = "dump"  # save what can be saved and stop for an operator
    DRAIN = "drain"  # move the ranks off sub-healthy nodes
    SCALE = "scale"  # resize an elastic job
    PAUSE = "pause"  # stop every rank for an operator
    RESUME = "resume"  # restart a paused job


@unique
class AttemptOutcome(StrEnum):
    """How an attempt ended. An attempt that failed, timed out or was superseded ends with the decision
    `attempt.<outcome>` (`ATTEMPT_ENDED`); one that recovered closes its incident; a pause ends as `paused`."""

    RECOVERED = "recovered"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    SUPERSEDED = "superseded"  # a fault outside it widened the incident, or an operator took over: not a failure
    PAUSED = "paused"


ATTEMPT_ENDED: dict[AttemptOutcome, DecisionKind] = {
    AttemptOutcome.FAILED: DecisionKind.ATTEMPT_FAILED,
    AttemptOutcome.TIMED_OUT: DecisionKind.ATTEMPT_TIMED_OUT,
    AttemptOutcome.SUPERSEDED: DecisionKind.ATTEMPT_SUPERSEDED,
}
"""the decision that ends an attempt without recovering, by its outcome"""


@unique
class TimerPurpose(StrEnum):
    """What a timer is for: the segment after the job in its id, `<job>/<purpose>[/<what>]/<seq>`."""

    WATCHDOG = "watchdog"  # the job's periodic heartbeat check
    CONFIRM = "confirm"  # a suspicion's debounce: `confirm/<key>`
    SETTLE = "settle"  # the window that collects a widened incident's faults: `settle/<incident>/<attempts>`
    ATTEMPT = "attempt"  # an attempt's deadline: `attempt/<incident>/<number>`
    ACK = "ack"  # a command's acknowledgement deadline: `ack/<command id>`
    AWAIT = "await"  # the wait for a dying checkpoint on its way: `await/<incident>/<number>`
    WAIT = "wait"  # the deadline of a wait for nodes: `wait/<incident>/<attempts>`
    RELEASE = "release"  # the expiry of an isolation the policy set: `release/<node>[/<device>]`
    GRACE = "grace"  # a stock script's restarted processes have run long enough: `grace/<incident>/<number>`


__all__ = ["ATTEMPT_ENDED", "AttemptOutcome", "AttemptPurpose", "DecisionKind", "IncidentCause", "IncidentOutcome",
           "TimerPurpose"]

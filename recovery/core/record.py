"""What one record does: the effects it collects, and the refusal that undoes all of it.

Every unit of the engine writes into the one `RecordEffects` of the record being applied: the decisions (each
with its commands and timers), and the counters that make command ids and decision indexes. A unit that finds
the record cannot be applied raises `Rejected`; the engine then undoes whatever the record had changed, so that
a rejection changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from events.names import DecisionKind
from events.outputs import Decision, Rejection, TimerRequest
from recovery.core.machine import JOB_DEST, fire
from recovery.core.overruns import CallKey, PolicyCalls

if TYPE_CHECKING:
    from recovery.core.job import Job

Effect = Decision | Rejection
_T = TypeVar("_T")
MAX_WIRE_INT = 2**63 - 1
"""the largest integer every consumer of the log can read (a signed 64-bit one); timers are nanoseconds"""


class Rejected(Exception):
    """The record cannot be applied: it becomes a rejection (a dead letter) with this code and reason."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class StateIndex(Protocol):
    overruns: Mapping[CallKey, Any]
    """calls of third-party policies the log says were abandoned (`recovery.core.overruns`)"""
    policy_calls: PolicyCalls | None
    """where the host runs third-party policies' calls (None: in-process, with no budget)"""

    def indexed(self, job: Job, previous: str) -> None:
        """Keep the indexes of jobs by state up to date after `job` left `previous`."""


class RecordEffects:
    """Effects of one record, with the counters that make command ids and decision indexes (made on first
    use: most records, the heartbeats and steps, decide nothing)."""

    __slots__ = ("calls", "commands", "decisions", "effects", "engine", "plans", "seq", "ts")

    def __init__(self, engine: StateIndex, seq: int, ts: int) -> None:
        self.engine = engine
        self.seq = seq
        self.ts = ts
        self.plans = 0  # rescheduling decisions asked for within this record: bounded by MAX_PLANS_PER_RECORD
        self.effects: list[Effect] = []
        self.commands: dict[str, int] | None = None
        self.decisions: dict[str, int] | None = None
        self.calls: dict[tuple[str, str, str], int] | None = None

    def call_index(self, job: str, family: str, method: str) -> int:
        """Which call of the job's `family` policy's `method` this is within the record, from 0: what names a call
        in a `policy.overran` fact (a record applied again makes the same calls in the same order)."""
        if self.calls is None:
            self.calls = {}
        key = (job, family, method)
        index = self.calls.get(key, 0)
        self.calls[key] = index + 1
        return index

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

    def decide(self, job: Job, kind: DecisionKind, reason: str, *, trigger: str | None = None,
               policy: str | None = None, commands: list[Any] | None = None, timers: list[TimerRequest] | None = None,
               cancelled: list[str] | None = None, detail: dict[str, Any] | None = None) -> None:
        """Record one decision for `job`, firing the machine's `trigger` first (if the job is not there yet):
        every change of a job's state goes through here."""
        previous = job.state
        if trigger is not None and previous != JOB_DEST.get(trigger):
            fire(job, trigger)
        incident = job.incident
        self.effects.append(Decision(
            job=job.id, cause_seq=self.seq, index=self.index(job.id), kind=kind, previous=previous,
            state=job.state, phase=None if incident is None else incident.phase,
            incident=None if incident is None else incident.id, policy=policy, reason=reason, commands=commands or [],
            timers=timers or [], cancelled_timers=cancelled or [], detail=detail or {},
        ))
        self.engine.indexed(job, previous)

    def reindex(self, job: Job) -> None:
        """Keep the indexes of jobs by state up to date after a change to `job` that is no decision."""
        self.engine.indexed(job, job.state)


def expect(job: Job, family: str, answer: Any, types: tuple[type, ...]) -> None:
    """A policy's answer must be one of its family's result types: anything else fails the record as a
    `policy_error` naming the policy, like an exception would."""
    if not isinstance(answer, types):
        names = ", ".join(t.__name__ for t in types)
        raise Rejected("policy_error", f"{family} policy {job.policies.labels.get(family, '?')} answered "
                                       f"{answer!r}, not one of {names}")


def check_encodable(effects: list[Effect]) -> None:
    """Numbers the engine computed (due times) must fit the wire; everything else it copies from validated
    input. A decision that cannot be written would stop every consumer of the log on the same record."""
    for effect in effects:
        if isinstance(effect, Decision):
            for timer in effect.timers:
                if not 0 <= timer.due <= MAX_WIRE_INT or (timer.every is not None
                                                         and not 0 < timer.every <= MAX_WIRE_INT):
                    raise Rejected("unencodable", f"timer {timer.id} due at {timer.due} ns every {timer.every} "
                                                  f"ns does not fit a 64-bit integer")

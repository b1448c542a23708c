"""A third-party policy's call that does not answer in time: abandoned by the host, a fact in the log, answered by
the built-in.

The engine reads no clock, so it cannot tell a slow call from a fast one: its host can. A host that runs plugins
where it can walk away from them (`recovery.plugins`: a worker process per plugin) gives each call a budget; a call
past it is abandoned (`Abandoned`), the engine undoes the record that made it and raises `PolicyOverran` to the
driver (`recovery.core.router.EffectRouter`), which writes the fact `policy.overran` into the log, notes it in
`Engine.overruns` and applies the record again. This time the engine finds the call in `overruns` and never makes
it: the built-in of the family answers, with a `policy.failed` decision, as for a plugin that raised.

A replay reads the facts before it applies anything (`overruns_in`): a fact comes after the input it is about, and
the call it names must be answered by the built-in there too, however long the plugin would take on the replaying
machine. The decisions are then the daemon's, byte for byte, on any machine.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any, Protocol

from events import subjects
from events.envelope import EnvelopeBase, RawRecord, Record, make_envelope
from events.kinds import PolicyOverran as OverranFact
from recovery.core.seals import MSG_ID, SEALED_FACTS, sealed_form

CallKey = tuple[int, str, str, str, int]
"""(input seq, job, family, method, call): one call of a job's policy within one input's handling"""
OVERRAN = "policy.overran"
FACT_SOURCE = "recovery-policy-calls"


class Abandoned(Exception):
    """A host's `PolicyCalls.call` ran past its budget: the call was abandoned (its worker killed)."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"no answer within {budget_s:g} s")
        self.budget_s = budget_s


class PolicyRaised(Exception):
    """A policy raised in a worker; `problem` says so as an in-process call's error would (`raised_problem`)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class PolicyOverran(Exception):
    """Raised out of `Engine.apply`, the record undone: a plugin's call was abandoned. The driver records `fact`,
    notes it in `Engine.overruns` and applies the record again."""

    def __init__(self, job: str, fact: OverranFact) -> None:
        super().__init__(f"{fact.family} policy {fact.policy} of job {job} overran {fact.budget_s:g} s at seq "
                         f"{fact.seq}")
        self.job = job
        self.fact = fact


class PolicyCalls(Protocol):
    """Where a host runs a third-party policy's calls (`recovery.plugins.PolicyWorkers`)."""

    def call(self, policy: Any, method: str, argument: Any) -> Any:
        """`getattr(policy, method)(argument)`, or `Abandoned` past the budget, or `PolicyRaised`."""
        ...


def raised_problem(exc: BaseException) -> str:
    """How a policy's exception is named in its `policy.failed` decision: the same text wherever it ran."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"raised {type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"


def key_of(job: str, fact: OverranFact) -> CallKey:
    return fact.seq, job, fact.family, fact.method, fact.call


def fact_message(job: str, fact: OverranFact) -> tuple[str, EnvelopeBase]:
    """The subject and envelope a driver writes the fact under; the id is the call's, so a daemon that applies the
    input again after a restart, and abandons the call again, publishes a duplicate JetStream drops."""
    ident = f"overran:{job}:{fact.seq}:{fact.family}:{fact.method}:{fact.call}"
    return subjects.job_event(job, OVERRAN), make_envelope(OVERRAN, fact, id=ident, job=job, source=FACT_SOURCE)


def overruns_in(records: Iterable[Record | RawRecord], sealed_from: int | None = None) -> dict[CallKey, OverranFact]:
    """Every call the log says was abandoned, for a replay to answer by the built-in. Only a fact about an earlier
    input counts (a fact is written after the input it is about), and only one the engine admits: sealed, or
    unsealed where the log needs no seal yet (before `sealed_from` and before its first sealed daemon-only record:
    `recovery.core.firings`), and not dead-lettered by the daemon (a seal's form on a forged digest, which only the
    daemon's secret tells). A forged fact must not skip a call the daemon made."""
    from events.subjects import is_output

    found: dict[int, tuple[CallKey, OverranFact]] = {}  # by the fact's own record
    refused: set[int] = set()  # inputs the daemon dead-lettered
    sealing = False
    for record in records:
        if type(record) is not Record:
            continue
        envelope = record.envelope
        if envelope.type == "rejection" and is_output(record.subject):
            refused.add(getattr(envelope.data, "seq", -1))
            continue
        if envelope.type != "timer.fired" and envelope.type not in SEALED_FACTS:
            continue
        sealed = sealed_form(record.headers.get(MSG_ID), envelope.id)
        sealing = sealing or sealed
        if envelope.type != OVERRAN or envelope.job is None:
            continue
        if not sealed and (sealing or (sealed_from is not None and record.seq >= sealed_from)):
            continue
        fact = envelope.data
        if isinstance(fact, OverranFact) and fact.seq < record.seq:
            found[record.seq] = (key_of(envelope.job, fact), fact)
    return dict(entry for seq, entry in found.items() if seq not in refused)

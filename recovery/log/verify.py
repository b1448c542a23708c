"""Verifying a log: re-derive its decisions from its inputs and find the first that differs from what it recorded,
with why (a changed policy, a plugin not installed, or, with the same policies, a bug) and whether the replay can be
exact at all (a log cut by a filter lacks the state before it). `recovery-replay verify` prints what this finds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from events.codec import DecodeError, decode_envelope
from events.envelope import RawRecord, Record
from events.outputs import Decision, Rejection
from events.subjects import PREFIX, is_output
from policies import registry
from recovery.core.effects import apply_encoded
from recovery.core.engine import Engine
from recovery.core.firings import FORGED_FIRING_CODES, sealed_from_in, unknown_nodes_in
from recovery.core.overruns import CallKey, OverranFact, overruns_in
from recovery.log.export import ExportHeader, rejection_jobs
from recovery.log.recorder import Replay, decision_order, rejection_order

DECISION_SUBJECTS = f"{PREFIX}.dec."
DEAD_LETTER_SUBJECTS = f"{PREFIX}.dlq."

Located = tuple[str, Record | RawRecord]
"""A record and where it came from, for messages: `LOG:<line>` for a file, `seq <n>` for the stream."""


class UnreadableLog(ValueError):
    """The log cannot be checked as it is (exit 2): a recorded output this version cannot read."""


def canonical(model: Any) -> bytes:
    """A decision or rejection as sorted JSON: what two of them are compared by."""
    try:
        return orjson.dumps(model.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        # An integer beyond 64 bits read from a hand-made log line: compared and shown all the same.
        return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Divergence:
    index: int
    cause_seq: int | None
    recorded: Decision | None
    derived: Decision | None
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "cause_seq": self.cause_seq, "verdict": self.verdict,
                "recorded": None if self.recorded is None else self.recorded.model_dump(mode="json"),
                "derived": None if self.derived is None else self.derived.model_dump(mode="json")}


@dataclass
class LogReplay(Replay):
    """A replay of a log as `recovery-replay` reads it: what it re-derived and what the log recorded, plus
    what decides how far the comparison can be trusted."""

    job: str | None = None
    """the job whose outputs are compared (a per-job export, or `verify --job`); None: every job's"""
    header: ExportHeader | None = None
    first_seq: int | None = None
    missing: int = 0
    """records absent from the sequence (left out by a filter, or lost)"""
    first_gap: int | None = None
    backwards: int | None = None
    """the first seq that is not above the one before it (lines out of order, or repeated)"""
    failed: list[Rejection] = field(default_factory=list)
    """inputs the replay itself turned into rejections: their handling raised, or their effects cannot be
    encoded (the daemon could not have written them)"""
    foreign: list[str] = field(default_factory=list)
    """where records sit on output subjects that the engine never writes (not a decision or a dead letter)"""
    unreadable: list[str] = field(default_factory=list)
    """recorded outputs this version cannot read (a newer schema): where, and why"""
    daemon_ts: int = 0
    """the log time of the last record the daemon itself wrote (an output or a timer firing): it was alive then"""
    refused_policies: dict[int, dict[str, str]] = field(default_factory=dict)
    """seq of a job.submitted the replay rejected as invalid_policy -> the policy names it chose, by family"""


def replay_log(located: Iterable[Located], engine: Engine | None = None, job: str | None = None,
               header: ExportHeader | None = None, overruns: dict[CallKey, OverranFact] | None = None) -> LogReplay:
    """Apply every input record to a fresh engine; collect derived and recorded outputs separately.

    The subject says what a record is, never the envelope's type: recorded decisions are only those on
    decision subjects and dead letters only those on dead-letter subjects, and anything on an input subject is
    an input, whatever its type (a message typed `decision` published on an event subject is hostile input the
    daemon dead-letters). No single record stops the replay: one whose handling raises or whose effects cannot
    be encoded becomes a rejection, as the daemon must treat it."""
    engine = engine or Engine()
    if overruns is None:  # read off the records, which are then held in memory (`replay` says why)
        located = located if isinstance(located, list | tuple) else list(located)
        if engine.sealed_from is None:  # where the daemon's seals began, as its dead letters say
            engine.sealed_from = sealed_from_in(record for _, record in located)
        engine.unknown_nodes_at = unknown_nodes_in(record for _, record in located)
        overruns = overruns_in((record for _, record in located), engine.sealed_from)
    if overruns:  # calls the daemon abandoned: answered by the built-in here too, however long they would take
        engine.overruns = overruns
    result = LogReplay(engine, [], [], [], [], 0, job=job, header=header)
    previous: int | None = None
    for where, record in located:
        seq = record.seq
        if previous is None:
            result.first_seq = seq
        elif seq > previous + 1:
            result.missing += seq - previous - 1
            if result.first_gap is None:
                result.first_gap = previous + 1
        elif seq <= previous and result.backwards is None:
            result.backwards = seq
        previous = seq
        subject = record.subject
        if is_output(subject):
            result.daemon_ts = max(result.daemon_ts, record.ts)
            _recorded_output(result, where, record)
            continue
        if isinstance(record, Record) and record.envelope.type == "timer.fired":
            result.daemon_ts = max(result.daemon_ts, record.ts)
        result.inputs += 1
        try:
            effects = [effect for effect, _, _, _ in apply_encoded(engine, record)]
        except Exception as exc:  # a bug in the engine must not end a postmortem: the record is reported
            _failed(result, record, f"its handling raised {type(exc).__name__}: {exc}")
            continue
        for effect in effects:
            if isinstance(effect, Rejection) and effect.code == "unencodable":
                result.failed.append(effect)
        for effect in effects:
            if isinstance(effect, Decision):
                result.decisions.append(effect)
            else:
                result.rejections.append(effect)
                if (effect.code == "invalid_policy" and isinstance(record, Record)
                        and record.envelope.type == "job.submitted"):
                    chosen = record.envelope.data.spec.policies
                    result.refused_policies[seq] = {family: getattr(chosen, family).name
                                                    for family in ("detection", "rescheduling", "checkpoint")}
    result.recorded_decisions = decision_order(result.recorded_decisions, result.decisions)
    result.recorded_rejections = rejection_order(result.recorded_rejections)
    return result


def _failed(result: LogReplay, record: Record | RawRecord, reason: str) -> None:
    envelope = record.envelope if isinstance(record, Record) else None
    rejection = Rejection(seq=record.seq, subject=record.subject, code="internal_error", reason=reason,
                          event_id=envelope.id if envelope else None, job=envelope.job if envelope else None,
                          node=envelope.node if envelope else None)
    result.failed.append(rejection)
    result.rejections.append(rejection)


def _recorded_output(result: LogReplay, where: str, record: Record | RawRecord) -> None:
    subject = record.subject
    expected = "decision" if subject.startswith(DECISION_SUBJECTS) else "rejection"
    if isinstance(record, Record):
        if record.envelope.type == expected:
            if expected == "decision":
                result.recorded_decisions.append(record.envelope.data)
            else:
                result.recorded_rejections.append(record.envelope.data)
            return
        result.foreign.append(where)
        return
    decoded = decode_envelope(record.data)
    try:
        claimed = orjson.loads(record.data).get("type")
    except (orjson.JSONDecodeError, AttributeError):
        claimed = None
    if claimed == expected and isinstance(decoded, DecodeError):
        # The engine's own output that this version cannot read (a newer schema, most likely): comparing
        # without it would report a divergence that is not there.
        result.unreadable.append(f"{where}: a recorded {expected} this version cannot read: {decoded.reason}")
        return
    result.foreign.append(where)


def in_scope(decision: Decision, job: str | None) -> bool:
    """The decisions a per-job check compares: the job's own, and every job's acceptance (which a per-job
    export keeps: the policies each job sharing the cluster ran with)."""
    return job is None or decision.job == job or decision.kind == "job.accepted"


def rejection_in_scope(rejection: Rejection, job: str | None) -> bool:
    """The dead letters a per-job check compares: those of the job's records and of records that name no job."""
    if job is None:
        return True
    jobs = rejection_jobs(rejection)
    return not jobs or job in jobs


TIMER_SLACK_NS = 60 * 1_000_000_000
"""how late a timer may fire (a daemon busy or restarting) before verify calls it never fired"""


def unfired_timers(result: LogReplay, job: str | None = None) -> list[str]:
    """Timers the engine still holds after the replay although they were due well before the daemon last wrote
    into the log: the daemon was alive and never fired them (a timer service that lost them, or a firing dropped
    as the duplicate of another message). One line each, the most overdue first."""
    if not result.daemon_ts:
        return []
    overdue = sorted((due, timer_id, owner) for timer_id, entry in result.engine.timers.items() if entry is not None
                     for owner, due, _ in (entry,) if due + TIMER_SLACK_NS < result.daemon_ts
                     and (job is None or owner == job))
    return [f"timer {timer_id} of job {owner} was due {(result.daemon_ts - due) / 1e9:,.1f}s before the daemon's "
            f"last record and never fired" for due, timer_id, owner in overdue]


def forged_timers(result: Replay, job: str | None = None) -> list[str]:
    """Timer firings that were not real (`recovery.core.firings`): published by someone other than the timer
    service, or before their due time. The replay dead-letters them as the daemon did, so the decisions match; they
    are reported all the same, since a publisher that forges firings is trying to end or hurry a job. The daemon's
    own verdicts count too: only it can check a seal's digest. One line each, in log order."""
    found: dict[int, Rejection] = {}
    for rejection in [*result.rejections, *result.recorded_rejections]:
        if rejection.code in FORGED_FIRING_CODES and rejection_in_scope(rejection, job):
            found.setdefault(rejection.seq, rejection)
    return [f"seq {r.seq} [{r.code}]: {r.reason}" for _, r in sorted(found.items())]


def caveats(result: Replay) -> list[str]:
    """Why the replay of this log cannot be exact, if it cannot: a divergence is then no evidence of a bug."""
    if not isinstance(result, LogReplay):
        return []
    out = []
    header = result.header
    narrow = header is not None and header.inputs == "job"
    if result.first_seq is not None and result.first_seq > 1 and not narrow:
        out.append(f"the log starts at seq {result.first_seq}, not 1: the state the engine built from the records "
                   f"before it is missing (an export cut by --since or --start-seq, or a stream that lost its head)")
    if narrow and header is not None:
        out.append(f"this export holds only job {header.job}'s own records: the node events and other jobs' "
                   f"records that the engine's decisions also depend on were left out")
    elif result.missing and header is None:
        out.append(f"{result.missing} records are missing from the sequence (the first at seq {result.first_gap}):"
                   f" if any was an input, the replay cannot be exact")
    if result.backwards is not None:
        out.append(f"the sequence goes back to seq {result.backwards}: records out of order or repeated (logs "
                   f"joined together?), which the daemon never read")
    return out


def _labels(decision: Decision) -> dict[str, str]:
    labels = decision.detail.get("policies")
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def _render(labels: dict[str, str]) -> str:
    return ", ".join(labels[family] for family in sorted(labels)) or "no policies named"


class PolicyCheck:
    """The policies in force for each job, in the log and in this installation: the recorded `job.accepted` names
    each policy as `name@version`, and the replay's names what is installed now. Indexed once (a divergence may
    look at every job of a long log)."""

    def __init__(self, result: Replay) -> None:
        self.result = result
        self.recorded: dict[str, list[Decision]] = {}  # job -> its acceptances, in log order (ids can be reused)
        for decision in result.recorded_decisions:
            if decision.kind == "job.accepted":
                self.recorded.setdefault(decision.job, []).append(decision)
        self.derived = {(d.job, d.cause_seq): d for d in result.decisions if d.kind == "job.accepted"}
        self.rejections: dict[int, Rejection] = {}
        for rejection in result.rejections:
            self.rejections.setdefault(rejection.seq, rejection)
        self.refused: dict[str, Rejection] = {}
        for rejection in result.recorded_rejections:
            if rejection.code == "invalid_policy":
                for job in rejection_jobs(rejection):
                    self.refused[job] = rejection

    def _acceptance(self, job: str, before: int | None) -> Decision | None:
        """The job's newest recorded job.accepted at or before seq `before`."""
        found = None
        for decision in self.recorded.get(job, ()):
            if before is None or decision.cause_seq <= before:
                found = decision
        return found

    def jobs_before(self, before: int | None) -> list[str]:
        """Jobs accepted in the log up to seq `before`, in order of acceptance."""
        firsts = [(accepted[0].cause_seq, job) for job, accepted in self.recorded.items()
                  if before is None or accepted[0].cause_seq <= before]
        return [job for _, job in sorted(firsts)]

    def cause(self, job: str, before: int | None = None) -> str | None:
        """How the policies in force for `job` differ between the log and this installation; None when they agree
        or when the log does not hold the job's acceptance."""
        recorded = self._acceptance(job, before)
        if recorded is None:
            refused = self.refused.get(job)
            derived = next((d for (j, _), d in self.derived.items() if j == job), None) if refused else None
            if refused is not None and derived is not None:
                return (f"changed policy: the log refused job {job}'s policies ({refused.reason}); installed now: "
                        f"{_render(_labels(derived))}")
            return None
        seq = recorded.cause_seq
        derived = self.derived.get((job, seq))
        if derived is None:
            refusal = self.rejections.get(seq)
            if refusal is None:
                return None
            if refusal.code != "invalid_policy":
                return (f"the replay rejects job {job}'s submission (seq {seq}) [{refusal.code}]: {refusal.reason}; "
                        f"the log accepted it")
            result = self.result
            names = result.refused_policies.get(seq, {}) if isinstance(result, LogReplay) else {}
            installed = registry.available()
            missing = [f"{family} policy {name!r}" for family, name in names.items() if name not in installed]
            ran = _render(_labels(recorded))
            if missing:
                return (f"policy not installed: the {', '.join(missing)} that job {job} ran with ({ran}) is not "
                        f"installed here, so the replay rejects the job (invalid_policy); install its plugin to "
                        f"verify this log")
            return f"changed policy: job {job} ran with {ran}; the installed policies now refuse it: {refusal.reason}"
        was, now = _labels(recorded), _labels(derived)
        if was != now:
            changed = [f"{family} {was.get(family, '-')} -> {now.get(family, '-')}" for family in sorted({*was, *now})
                       if was.get(family) != now.get(family)]
            return f"changed policy for job {job} (recorded -> installed): {', '.join(changed)}"
        return None


def policy_cause(result: Replay, job: str, before: int | None = None) -> str | None:
    """Whether the policies in force for `job` (at seq `before`) differ between the log and this installation,
    and how (see `PolicyCheck`)."""
    return PolicyCheck(result).cause(job, before)


def explain(result: Replay, rec: Decision | None, der: Decision | None) -> str:
    """Why a recorded and a derived decision differ, as truthfully as the log allows. The policies in force for
    the job come first (a diverging decision's own `policy` is often empty: job.accepted, incident.closed)."""
    cause_seq = (rec or der).cause_seq if (rec or der) is not None else None  # type: ignore[union-attr]
    jobs = list(dict.fromkeys(d.job for d in (rec, der) if d is not None))
    policies = PolicyCheck(result)
    for name in jobs:
        cause = policies.cause(name, cause_seq)
        if cause is not None:
            return cause
    forged = next((r for r in result.recorded_rejections if r.code in FORGED_FIRING_CODES and r.seq == cause_seq), None)
    if forged is not None and rec is None:
        return (f"the daemon dead-lettered seq {forged.seq} as a forged timer firing [{forged.code}]: {forged.reason}; "
                f"this replay, without the deployment's secret, cannot check the seal and fired it")
    refused = None if rec is None else policies.rejections.get(rec.cause_seq)
    if refused is not None:
        return (f"the replay rejects seq {refused.seq} [{refused.code}]: {refused.reason}; the log has decisions "
                f"caused by it")
    if rec is not None and der is not None and rec.policy != der.policy:
        return f"changed policy: recorded {rec.policy}, replayed {der.policy}"
    for name in policies.jobs_before(cause_seq):
        if name in jobs:
            continue
        cause = policies.cause(name, cause_seq)
        if cause is not None:
            return f"{cause}; job {name} shares the cluster with job {jobs[0]}, which may explain this divergence"
    limits = caveats(result)
    if limits:
        return "the replay cannot be exact here, so this need not be a bug: " + "; ".join(limits)
    if rec is None:
        return "the replay made a decision the log does not have (log cut short, or new behaviour)"
    if der is None:
        return "the log has a decision the replay does not make"
    return ("same policies, different decision: an engine or policy change without a version "
            "bump, or non-determinism: a bug")


_Output = TypeVar("_Output", Decision, Rejection)


def first_divergence(result: Replay, job: str | None = None) -> Divergence | None:
    """Compare derived decisions with recorded ones in order; the first difference, explained. With `job` (or
    a per-job log's own job) only that job's decisions and every job's acceptance are compared."""
    if job is None and isinstance(result, LogReplay):
        job = result.job
    recorded = [d for d in result.recorded_decisions if in_scope(d, job)]
    derived = [d for d in result.decisions if in_scope(d, job)]
    first = _first_difference(recorded, derived)
    if first is None:
        return None
    index, rec, der = first
    cause = (rec or der).cause_seq if (rec or der) is not None else None  # type: ignore[union-attr]
    return Divergence(index, cause, rec, der, explain(result, rec, der))


def _first_difference(recorded: Sequence[_Output], derived: Sequence[_Output]
                      ) -> tuple[int, _Output | None, _Output | None] | None:
    """The first place two output sequences differ (one may be shorter), compared as they are written."""
    for index in range(max(len(recorded), len(derived))):
        rec = recorded[index] if index < len(recorded) else None
        der = derived[index] if index < len(derived) else None
        if rec is None or der is None or canonical(rec) != canonical(der):
            return index, rec, der
    return None


@dataclass(frozen=True)
class RejectionDivergence:
    recorded: Rejection | None
    derived: Rejection | None
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict,
                "recorded": None if self.recorded is None else self.recorded.model_dump(mode="json"),
                "derived": None if self.derived is None else self.derived.model_dump(mode="json")}


def dead_letters_compared(result: Replay) -> bool:
    """Whether the log's dead letters are compared. A log that holds none at all may be an export that left them
    out (as per-job exports once did): it is compared only if it says it keeps them (a per-job export's header),
    or if the replay itself had to reject a record it cannot handle."""
    if result.recorded_rejections:
        return True
    if isinstance(result, LogReplay):
        return bool(result.failed) or (result.header is not None and result.header.inputs == "all")
    return False


def rejection_divergence(result: Replay, job: str | None = None) -> RejectionDivergence | None:
    """The first dead letter the replay and the log disagree on (see `dead_letters_compared`)."""
    if job is None and isinstance(result, LogReplay):
        job = result.job
    if not dead_letters_compared(result):
        return None
    recorded = [r for r in result.recorded_rejections if rejection_in_scope(r, job)]
    derived = [r for r in result.rejections if rejection_in_scope(r, job)]
    first = _first_difference(recorded, derived)
    if first is not None:
        _, rec, der = first
        if rec is not None and der is not None and rec.seq == der.seq:
            verdict = (f"seq {rec.seq}: the log dead-lettered it [{rec.code}]: {rec.reason}; the replay rejects it "
                       f"[{der.code}]: {der.reason}")
        elif der is not None and (rec is None or der.seq < rec.seq):
            verdict = f"the replay rejects seq {der.seq} [{der.code}]: {der.reason}; the log has no such dead letter"
        else:
            assert rec is not None
            verdict = f"the log dead-lettered seq {rec.seq} [{rec.code}]: {rec.reason}; the replay does not reject it"
        concerned = (der or rec).job  # type: ignore[union-attr]
        cause = None if concerned is None else policy_cause(result, concerned, (der or rec).seq)  # type: ignore[union-attr]
        if cause is not None:
            verdict += f" ({cause})"
        limits = caveats(result)
        if limits:
            verdict += "; the replay cannot be exact here: " + "; ".join(limits)
        return RejectionDivergence(rec, der, verdict)
    return None

"""`recovery-replay`: rebuild every state and decision from a log, for postmortems and audit.

    recovery-replay run LOG              final state of each job, incidents and decision counts
    recovery-replay verify LOG [--job J] re-derive every decision and diff against the recorded ones
    recovery-replay timeline LOG --job J events, states and decisions of one job, in order
    recovery-replay export --nats URL [--job J] [--since T] [-o FILE]
                                         the JetStream log as JSONL (the format LOG is in)

Each of run, verify and timeline reads a JSONL export (LOG) or, with `--nats URL`, the live JetStream
stream (`--stream`, default RECOVERY). Each takes `--json` for machine-readable output. Exit status: 0
fine, 1 divergence, 2 bad usage or unreadable log (a line that is not a record, a last line cut short, a
recorded decision of a schema this version cannot read: each named with its line).

A per-job export (`export --job J`) keeps every input record, since the engine's decisions for J depend on
the whole cluster (node events, spares other jobs took), and leaves out only other jobs' outputs except
their job.accepted; its header names J, and verify then compares J's decisions, J's dead letters and those
naming no job, and every job's acceptance: exact whenever verify of the whole log is. An export cut by
--since or --start-seq lacks the state before it: verify says it cannot be exact instead of calling a
divergence a bug.

verify explains a divergence from the policies in force for the job (`job.accepted` names each policy as
name@version; the replay names what is installed now): a changed policy, a policy whose plugin is not
installed (named), or, with the same policies, a bug. Records are told apart by subject: only records on
decision and dead-letter subjects are recorded outputs; anything on an event subject is an input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson

from events.codec import DecodeError, decode_envelope
from events.envelope import RawRecord, Record
from events.outputs import Decision, Rejection
from events.subjects import PREFIX, is_output
from policies import registry
from recovery.core.effects import apply_encoded
from recovery.core.engine import Engine
from recovery.log import ExportHeader, export_filter, iter_numbered, read_header, rejection_jobs
from recovery.log.recorder import Replay

NS = 1_000_000_000
DECISION_SUBJECTS = f"{PREFIX}.dec."
DEAD_LETTER_SUBJECTS = f"{PREFIX}.dlq."

Located = tuple[str, Record | RawRecord]
"""A record and where it came from, for messages: `LOG:<line>` for a file, `seq <n>` for the stream."""


class UnreadableLog(ValueError):
    """The log cannot be checked as it is (exit 2): a recorded output this version cannot read."""


def _dump(model: Any) -> bytes:
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
    refused_policies: dict[int, dict[str, str]] = field(default_factory=dict)
    """seq of a job.submitted the replay rejected as invalid_policy -> the policy names it chose, by family"""


def replay_log(located: Iterable[Located], engine: Engine | None = None, job: str | None = None,
               header: ExportHeader | None = None) -> LogReplay:
    """Apply every input record to a fresh engine; collect derived and recorded outputs separately.

    The subject says what a record is, never the envelope's type: recorded decisions are only those on
    decision subjects and dead letters only those on dead-letter subjects, and anything on an input subject is
    an input, whatever its type (a message typed `decision` published on an event subject is hostile input the
    daemon dead-letters). No single record stops the replay: one whose handling raises or whose effects cannot
    be encoded becomes a rejection, as the daemon must treat it."""
    engine = engine or Engine()
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
            _recorded_output(result, where, record)
            continue
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
        if rec is None or der is None or _dump(rec) != _dump(der):
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


def _records(source: str | argparse.Namespace) -> Iterator[Record | RawRecord]:
    """The records of a JSONL file, or of the JetStream stream when the arguments carry `--nats`."""
    return (record for _, record in _located(source)[1])


def _located(source: str | argparse.Namespace) -> tuple[ExportHeader | None, Iterator[Located]]:
    """The export header (if the file has one) and the records with where each is: `LOG:<line>` or `seq <n>`."""
    if isinstance(source, str):
        path = source
    elif getattr(source, "nats", None):
        if source.log:
            raise ValueError("give either a LOG file or --nats, not both")
        records = asyncio.run(_read_nats(source.nats, source.stream))
        return None, ((f"seq {record.seq}", record) for record in records)
    elif not source.log:
        raise ValueError("give a LOG file or --nats URL")
    else:
        path = source.log
    return read_header(path), ((f"{path}:{number}", record) for number, record in iter_numbered(path))


async def _connect_log(url: str, stream: str) -> Any:
    """A read-only view of the stream: it is neither created nor reconfigured (that is the daemon's job)."""
    import nats
    import nats.errors
    import nats.js.errors

    from recovery.log.jetstream import JetStreamLog

    try:
        nc = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=3, name="recovery-replay")
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise OSError(f"cannot connect to {url}: {exc!r}") from None
    js = nc.jetstream(timeout=10)
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        await nc.close()
        raise OSError(f"no stream {stream!r} on {url}") from None
    return JetStreamLog(nc, js, stream, owns_connection=True)


async def _read_nats(url: str, stream: str) -> list[Record | RawRecord]:
    log = await _connect_log(url, stream)
    try:
        return [record async for record in log.read()]
    finally:
        await log.close()


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str, now_ns: int | None = None) -> int:
    """`--since`: nanoseconds since the epoch, an ISO 8601 time (UTC unless it says), or an age such as
    `90s`, `15m`, `2h`, `1d` before now."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    match = _RELATIVE.match(text)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86_400}[match.group(2)]
        now = time.time_ns() if now_ns is None else now_ns
        return now - int(float(match.group(1)) * unit * NS)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: give nanoseconds, an ISO 8601 time or an age like 15m") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp()) * NS + when.microsecond * 1000


def cmd_export(args: argparse.Namespace) -> int:
    since = parse_since(args.since) if args.since else None
    count = asyncio.run(_export(args.nats, args.stream, args.output, args.job, since, args.start_seq))
    if args.output != "-":
        print(f"{count} records written to {args.output}", file=sys.stderr)
    return 0


async def _export(url: str, stream: str, output: str, job: str | None, since: int | None, start_seq: int) -> int:
    from events.codec import encode_record

    log = await _connect_log(url, stream)
    try:
        if output != "-":
            return int(await log.export(output, start_seq, job, since, replayable=True))
        # The same header and filter as the file export above (recovery.log.export_log), to standard output.
        count = 0
        out = sys.stdout.buffer
        header = ExportHeader.for_filters(job, since, start_seq, replayable=True)
        if header is not None:
            out.write(header.encode() + b"\n")
        keep = export_filter(job, since, replayable=True)
        async for record in log.read(start_seq):
            if keep(record):
                out.write(encode_record(record) + b"\n")
                count += 1
        out.flush()
        return count
    finally:
        await log.close()


def _clock(ts: int, origin: int) -> str:
    return f"+{(ts - origin) / NS:10.3f}s"


def _utc(ts: int) -> str:
    return datetime.fromtimestamp(ts / NS, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _summary(envelope: Any) -> str:
    data = envelope.data.model_dump(mode="json", exclude_defaults=True)
    if envelope.type == "job.submitted":
        spec = data["spec"]
        return f"{len(spec['nodes'])} nodes, layout {spec['layout']}"
    return " ".join(f"{k}={v}" for k, v in data.items())


def _json(obj: Any) -> bytes:
    """Indented JSON; integers beyond 64 bits (which orjson refuses) through the standard library."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2)
    except orjson.JSONEncodeError:
        return json.dumps(obj, indent=2, default=str).encode()


def _replay_args(args: argparse.Namespace, job: str | None = None) -> LogReplay:
    """Replay the log the arguments name, for the job a per-job export holds (or `job`)."""
    header, located = _located(args)
    if header is not None and header.job is not None:
        if job is not None and job != header.job:
            raise ValueError(f"this export holds only job {header.job}'s outputs, not job {job}'s")
        job = header.job
    return replay_log(located, job=job, header=header)


def cmd_run(args: argparse.Namespace) -> int:
    result = _replay_args(args)
    snapshot = result.engine.snapshot()
    if args.json:
        out = {"inputs": result.inputs, "jobs": snapshot["jobs"],
               "decisions": [d.model_dump(mode="json") for d in result.decisions],
               "rejections": [r.model_dump(mode="json") for r in result.rejections]}
        sys.stdout.buffer.write(_json(out) + b"\n")
        return 0
    print(f"{result.inputs} input records, {len(result.decisions)} decisions, {len(result.rejections)} rejections")
    for job_id, job in snapshot["jobs"].items():
        print(f"\njob {job_id}: {job['state']} at step {job['step']}, generation {job['generation']}, "
              f"{job['alive']}/{job['world']} ranks alive, nodes {', '.join(job['nodes'])}")
        print(f"  policies: {', '.join(job['policies'].values())}; restarts used {job['restarts_used']}")
        for inc in job["incidents"] + ([job["incident"]] if job["incident"] else []):
            mttr = "" if inc["closed"] is None else f", {(inc['closed'] - inc['opened']) / NS:.1f}s"
            grans = " -> ".join(f"{a['granularity']}({a['outcome']})" for a in inc["attempts"])
            print(f"  incident {inc['id']}: {inc['fault_class'] or inc['cause']}, {inc['outcome'] or 'open'}"
                  f"{mttr}, lost steps {inc['lost_steps']}; {grans}")
    for rej in result.rejections:
        print(f"rejected seq {rej.seq} [{rej.code}]: {rej.reason}")
    for note in caveats(result):
        print(f"note: the replay cannot be exact: {note}")
    for unreadable in result.unreadable:
        print(f"note: {unreadable}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    result = _replay_args(args, args.job)
    if result.unreadable:
        more = f" (and {len(result.unreadable) - 1} more)" if len(result.unreadable) > 1 else ""
        raise UnreadableLog(f"{result.unreadable[0]}{more}: use the recovery-replay of the version that wrote it")
    job = result.job
    divergence = first_divergence(result)
    letters = rejection_divergence(result)
    ok = divergence is None and letters is None
    limits = caveats(result)
    notes = [f"{len(result.foreign)} records on output subjects are not decisions or dead letters, so the engine "
             f"did not write them (first: {result.foreign[0]}); not compared"] if result.foreign else []
    rejected = [r for r in result.rejections if rejection_in_scope(r, job)]
    if rejected and not dead_letters_compared(result):
        notes.append(f"the log holds no dead letters; the replay rejects {len(rejected)} records "
                     f"(first: seq {rejected[0].seq} [{rejected[0].code}]); not compared")
    compared = [d for d in result.decisions if in_scope(d, job)]
    recorded = [d for d in result.recorded_decisions if in_scope(d, job)]
    if args.json:
        out = {"ok": ok, "job": job, "exact": not limits, "caveats": limits, "notes": notes,
               "inputs": result.inputs, "decisions": len(compared), "recorded": len(recorded),
               "divergence": None if divergence is None else divergence.as_dict(),
               "rejections_match": letters is None,
               "rejection_divergence": None if letters is None else letters.as_dict()}
        sys.stdout.buffer.write(_json(out) + b"\n")
        return 0 if ok else 1
    if divergence is not None:
        print(f"DIVERGENCE at decision #{divergence.index} (caused by seq {divergence.cause_seq}): "
              f"{divergence.verdict}")
        if divergence.recorded is not None:
            print(f"  recorded: {_dump(divergence.recorded).decode()}")
        if divergence.derived is not None:
            print(f"  replayed: {_dump(divergence.derived).decode()}")
    elif letters is not None:
        print(f"DIVERGENCE in rejections: {letters.verdict}")
    else:
        which = "" if job is None else f" (job {job}'s and every job's acceptance)"
        print(f"ok: {len(compared)} decisions{which} from {result.inputs} inputs match the {len(recorded)} recorded")
    for note in notes:
        print(f"note: {note}")
    if ok:
        for limit in limits:
            print(f"note: the replay cannot be exact, so this check is not either: {limit}")
    return 0 if ok else 1


def timeline_rows(records: Sequence[Record | RawRecord] | Iterator[Record | RawRecord], job: str,
                  include_progress: bool = False) -> list[dict[str, Any]]:
    """The job's inputs and decisions in log order, with the state after each decision. Decisions and dead
    letters are what sits on their subjects; a record of another type there, or one typed `decision` on an
    event subject, is not the engine's."""
    rows: list[dict[str, Any]] = []
    nodes: set[str] = set()
    state = "submitted"
    for record in records:
        if isinstance(record, RawRecord):
            continue
        env = record.envelope
        if is_output(record.subject):
            if env.type == "decision" and record.subject.startswith(DECISION_SUBJECTS):
                if env.data.job != job:
                    continue
                d = env.data
                state = d.state
                nodes.update(d.detail.get("nodes", ()))  # nodes the job moved to are its nodes from then on
                rows.append({"seq": record.seq, "ts": record.ts, "what": f"decision {d.kind}",
                             "detail": d.reason + (f" [{', '.join(c.kind for c in d.commands)}]" if d.commands else ""),
                             "state": state, "policy": d.policy})
            elif (env.type == "rejection" and record.subject.startswith(DEAD_LETTER_SUBJECTS)
                  and job in rejection_jobs(env.data)):
                rows.append({"seq": record.seq, "ts": record.ts, "what": f"rejected {env.data.code}",
                             "detail": env.data.reason, "state": state, "policy": None})
            continue
        if env.job == job:
            if env.type == "job.submitted":
                nodes.update(env.data.spec.nodes)
            if env.type in ("process.heartbeat", "progress.step") and not include_progress:
                continue
            if env.type == "timer.fired" and "/watchdog/" in env.data.timer_id and not include_progress:
                continue
        elif not (env.node is not None and env.node in nodes):
            continue
        # An input typed like an output is hostile or broken input (the daemon rejects it): never shown as one.
        what = env.type if env.type not in ("decision", "rejection") else f"input typed {env.type}"
        rows.append({"seq": record.seq, "ts": record.ts, "what": what, "detail": _summary(env),
                     "state": state, "policy": None})
    return rows


def cmd_timeline(args: argparse.Namespace) -> int:
    rows = timeline_rows(_records(args), args.job, include_progress=args.all)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    if not rows:
        print(f"nothing in the log for job {args.job}")
        return 2
    origin = rows[0]["ts"]
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # pragma: no cover - rich is a dependency; plain text keeps the CLI usable without it
        for r in rows:
            print(f"{_clock(r['ts'], origin)} {r['seq']:>7} {r['what']:<28} {r['state']:<13} {r['detail']}")
        return 0
    table = Table(title=f"job {args.job} from {_utc(origin)}", show_lines=False)
    for column in ("time", "seq", "event / decision", "state", "detail"):
        table.add_column(column, overflow="fold")
    for r in rows:
        style = "bold" if r["what"].startswith("decision") else ("red" if r["what"].startswith("rejected") else "")
        # Text cells: details such as "[migrate_ranks]" are data, not console markup.
        table.add_row(*(Text(c) for c in (_clock(r["ts"], origin), str(r["seq"]), r["what"], r["state"], r["detail"])),
                      style=style)
    console = Console()
    # Piped output has no terminal width: give the table room rather than folding every cell.
    Console(width=console.width if console.is_terminal else 200).print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, helptext in (("run", cmd_run, "final state of each job and the decisions"),
                                 ("verify", cmd_verify, "re-derive decisions and diff with the recorded ones"),
                                 ("timeline", cmd_timeline, "events, states and decisions of one job")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("log", nargs="?", help="JSONL export of the log (or --nats)")
        p.add_argument("--nats", metavar="URL", help="read the live JetStream log instead of a file")
        p.add_argument("--stream", default="RECOVERY", help="the log's stream with --nats (default RECOVERY)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name == "timeline":
            p.add_argument("--job", required=True)
            p.add_argument("--all", action="store_true", help="include heartbeats, steps and watchdog ticks")
        if name == "verify":
            p.add_argument("--job", help="compare only this job's decisions and dead letters, and every job's "
                                         "acceptance (a per-job export names its job itself)")
    p = sub.add_parser("export", help="write the JetStream log as JSONL",
                       description="Write the JetStream log as JSONL. A per-job export starts with a header line "
                                   "naming the job and its filters, which verify reads.")
    p.add_argument("--nats", metavar="URL", required=True, help="NATS server of the log")
    p.add_argument("--stream", default="RECOVERY", help="the log's stream (default RECOVERY)")
    p.add_argument("--job", help="an incident of this job: every input record (every job's and node's events: the "
                                 "job's decisions depend on them), the job's decisions and dead letters, the dead "
                                 "letters of records naming no job, and every job's job.accepted; only other "
                                 "jobs' other outputs are left out, so verify re-derives the job's decisions exactly")
    p.add_argument("--since", help="only records at or after this log time: ns, ISO 8601, or an age (15m, 2h); "
                                   "a replay then lacks the state before it, and verify says it cannot be exact")
    p.add_argument("--start-seq", type=int, default=1, help="first stream sequence to read (cuts like --since)")
    p.add_argument("-o", "--output", default="-", help="JSONL file to write (default: standard output)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"recovery-replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

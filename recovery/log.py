"""Event logs: the one door between the engine's world and storage.

Every log keeps records in a strict sequence, stamps each with its own time (logical time for the
engine), and drops a message whose id it has already stored within its duplicate window, as JetStream
does with `Nats-Msg-Id`. The memory and JSONL file logs here and the JetStream log in
`recovery.jetstream` pass one contract suite (tests/log_contract.py).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path
from typing import Protocol, runtime_checkable

import orjson
from pydantic import ValidationError

from events import RawRecord, Record, decode_record_line, encode_record
from events.codec import decode_envelope, encode_envelope
from events.envelope import EnvelopeBase
from events.outputs import Rejection
from events.subjects import PREFIX, is_output

MSG_ID = "Nats-Msg-Id"
Clock = Callable[[], int]


@dataclass(frozen=True, slots=True)
class Appended:
    seq: int
    duplicate: bool
    record: Record | RawRecord | None = None
    """the stored record, where the log has it at hand (memory and file logs)"""


@runtime_checkable
class EventLog(Protocol):
    """An append-only, totally ordered log of records."""

    async def append(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        """Store one message. An envelope is encoded and its id sent as the message id; raw bytes are
        stored as given (that is how bad input reaches the log). A repeated message id within the
        duplicate window stores nothing and returns the first one's sequence with duplicate=True."""
        ...

    def read(self, start_seq: int = 1) -> AsyncIterator[Record | RawRecord]:
        """Every record from `start_seq` on, in sequence order, then stop."""
        ...

    async def last_seq(self) -> int: ...

    async def close(self) -> None: ...


def to_record(seq: int, ts: int, subject: str, headers: dict[str, str], data: bytes) -> Record | RawRecord:
    """Decode a stored message for the engine: a Record, or a RawRecord that the engine will reject."""
    envelope = decode_envelope(data)
    if isinstance(envelope, EnvelopeBase):
        return Record.model_construct(seq=seq, ts=ts, subject=subject, headers=headers, envelope=envelope)
    return RawRecord(seq=seq, ts=ts, subject=subject, headers=headers, data=data)


class _Dedupe:
    """Ids seen within the duplicate window, measured in messages (a log has no wall clock to age them)."""

    def __init__(self, window: int) -> None:
        self._window = window
        self._seen: OrderedDict[str, int] = OrderedDict()

    def check(self, msg_id: str | None) -> int | None:
        return None if msg_id is None else self._seen.get(msg_id)

    def add(self, msg_id: str | None, seq: int) -> None:
        if msg_id is None:
            return
        self._seen[msg_id] = seq
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)


def _prepare(payload: EnvelopeBase | bytes, headers: dict[str, str] | None,
             encoded: bytes | None = None) -> tuple[bytes, dict[str, str]]:
    hdrs = dict(headers or {})
    if isinstance(payload, EnvelopeBase):
        hdrs.setdefault(MSG_ID, payload.id)
        return encoded if encoded is not None else encode_envelope(payload), hdrs
    return payload, hdrs


def _stored(seq: int, ts: int, subject: str, headers: dict[str, str], payload: EnvelopeBase | bytes,
            data: bytes) -> Record | RawRecord:
    """The record as read back. The engine's own outputs are kept as the envelope it made (decoding the bytes just
    written would give it again); inputs are decoded from their bytes, as the daemon receives them."""
    if isinstance(payload, EnvelopeBase) and is_output(subject):
        return Record.model_construct(seq=seq, ts=ts, subject=subject, headers=headers, envelope=payload)
    return to_record(seq, ts, subject, headers, data)


class MemoryLog:
    """A log in a list: for tests, the simulator and what-if replays."""

    def __init__(self, clock: Clock = time.time_ns, dedupe_window: int = 100_000) -> None:
        self._clock = clock
        self._last_ts = 0
        self._count = 0
        self._records: list[Record | RawRecord] = []
        self._dedupe = _Dedupe(dedupe_window)

    def _stamp(self) -> int:
        # Log time never goes backwards, whatever the clock does: order is the sequence, and time follows it.
        self._last_ts = max(self._last_ts, self._clock())
        return self._last_ts

    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended:
        """Append and return the stored record; `encoded`: the envelope's bytes, if the caller has them already."""
        data, hdrs = _prepare(payload, headers, encoded)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._count += 1
        record = _stored(self._count, self._stamp(), subject, hdrs, payload, data)
        self._keep(record)
        self._dedupe.add(hdrs.get(MSG_ID), self._count)
        return Appended(self._count, False, record)

    def _keep(self, record: Record | RawRecord) -> None:
        self._records.append(record)

    async def append(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        return self.append_sync(subject, payload, headers)

    def records(self, start_seq: int = 1) -> Iterator[Record | RawRecord]:
        return iter(self._records[max(start_seq, 1) - 1 :])

    async def read(self, start_seq: int = 1) -> AsyncIterator[Record | RawRecord]:
        for record in self.records(start_seq):
            yield record

    async def last_seq(self) -> int:
        return self._count

    async def export(
        self, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
        since_ns: int | None = None, *, replayable: bool = False,
    ) -> int:
        return await export_log(self, path, start_seq, job, since_ns, replayable=replayable)

    async def close(self) -> None:
        return None


class CountingLog(MemoryLog):
    """Numbers, stamps and deduplicates records like `MemoryLog` but keeps none: for a simulation whose log
    nobody reads (54 days of a 16,384-GPU job are a million records)."""

    def _keep(self, record: Record | RawRecord) -> None:
        pass

    def records(self, start_seq: int = 1) -> Iterator[Record | RawRecord]:
        raise TypeError("a CountingLog keeps no records")


class FileLog:
    """A JSONL file in the export format, one record per line; appends are flushed line by line."""

    def __init__(self, path: str | os.PathLike[str], clock: Clock = time.time_ns, dedupe_window: int = 100_000):
        self.path = Path(path)
        self._clock = clock
        self._dedupe = _Dedupe(dedupe_window)
        self._last_seq = 0
        self._last_ts = 0
        if self.path.exists():
            for record in iter_file(self.path):
                self._last_seq = record.seq
                self._last_ts = record.ts
                self._dedupe.add(record.headers.get(MSG_ID), record.seq)
        self._fh = self.path.open("ab")

    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended:
        data, hdrs = _prepare(payload, headers, encoded)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._last_seq += 1
        self._last_ts = max(self._last_ts, self._clock())
        record = _stored(self._last_seq, self._last_ts, subject, hdrs, payload, data)
        self._fh.write(encode_record(record) + b"\n")
        self._fh.flush()
        self._dedupe.add(hdrs.get(MSG_ID), self._last_seq)
        return Appended(self._last_seq, False, record)

    async def append(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        return self.append_sync(subject, payload, headers)

    def records(self, start_seq: int = 1) -> Iterator[Record | RawRecord]:
        self._fh.flush()
        end = self._last_seq  # what the log holds now: appends made while reading are not read
        for record in iter_file(self.path):
            if record.seq > end:
                break
            if record.seq >= start_seq:
                yield record

    async def read(self, start_seq: int = 1) -> AsyncIterator[Record | RawRecord]:
        for record in self.records(start_seq):
            yield record

    async def last_seq(self) -> int:
        return self._last_seq

    async def export(
        self, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
        since_ns: int | None = None, *, replayable: bool = False,
    ) -> int:
        return await export_log(self, path, start_seq, job, since_ns, replayable=replayable)

    def close_sync(self) -> None:
        self._fh.close()

    async def close(self) -> None:
        self.close_sync()


def iter_file(path: str | os.PathLike[str]) -> Iterator[Record | RawRecord]:
    """Read a JSONL export. A broken line raises ValueError naming the line: the file itself is corrupt."""
    return map(itemgetter(1), iter_numbered(path))  # no generator frame per record: replay reads millions


def iter_numbered(path: str | os.PathLike[str]) -> Iterator[tuple[int, Record | RawRecord]]:
    """The records of a JSONL export with their line numbers, after the export header if there is one. A
    broken line raises ValueError naming the file and the line, and saying when it is a last line cut short."""
    with open(path, "rb") as fh:
        first = True
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if first:
                first = False
                try:
                    header = ExportHeader.from_line(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from exc
                if header is not None:
                    continue
            try:
                record = decode_record_line(line)
            except ValueError as exc:
                reason = _brief(exc)
                if not line.endswith(b"\n"):
                    # Only the last line can lack its newline, and that is how a log line usually breaks: the file
                    # was copied or cut while the line was being written.
                    raise ValueError(f"{path}:{number}: the last line is cut short (no newline at its end, and "
                                     f"it does not parse: {reason})") from exc
                raise ValueError(f"{path}:{number}: not a log record: {reason}") from exc
            if record.seq > MAX_SEQ or record.ts > MAX_SEQ:
                # A stream sequence and a JetStream timestamp are unsigned 64-bit integers: this line was not
                # written from a log.
                raise ValueError(f"{path}:{number}: not a log record: seq {record.seq} or ts {record.ts} does not "
                                 f"fit 64 bits")
            yield number, record


MAX_SEQ = 2**64 - 1


def _brief(exc: ValueError) -> str:
    """One line for a reader: a pydantic error's fields and messages, without its multi-line layout."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'line'}: {err['msg']}"
                         for err in exc.errors(include_url=False)[:3])
    return str(exc)


def read_header(path: str | os.PathLike[str]) -> ExportHeader | None:
    """The export header of a JSONL export (None for a whole log, which has none)."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    return ExportHeader.from_line(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from exc
    return None


EXPORT_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ExportHeader:
    """The first line of a per-job JSONL export: `{"export": {...}}`, saying what the filters left out, so that
    `recovery-replay verify` knows what it can check exactly. A whole log, or a slice of one, has no header.

    `inputs` is "all" when every input record from `start_seq` (and `since_ns`) on is kept and only other jobs'
    outputs are left out (the `recovery-replay export --job` filter: a replay re-derives `job`'s decisions
    exactly), or "job" when only `job`'s own records are kept (the log API's narrow filter)."""

    job: str | None = None
    inputs: str = "all"
    since_ns: int | None = None
    start_seq: int = 1
    format: int = EXPORT_FORMAT

    def encode(self) -> bytes:
        return orjson.dumps({"export": asdict(self)}, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_line(cls, line: bytes) -> ExportHeader | None:
        """The header a line holds, None if the line is a record (or anything else: the record reader judges
        it), ValueError for a header this version cannot read."""
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or "seq" in obj or not isinstance(obj.get("export"), dict):
            return None
        fields = obj["export"]
        version = fields.get("format")
        if not isinstance(version, int) or version > EXPORT_FORMAT or version < 1:
            raise ValueError(f"export header of format {version!r}: this version reads format {EXPORT_FORMAT} "
                             f"(written by a newer recovery?)")
        job, inputs = fields.get("job"), fields.get("inputs", "all")
        since, start = fields.get("since_ns"), fields.get("start_seq", 1)
        if (not (job is None or isinstance(job, str)) or inputs not in ("all", "job")
                or not (since is None or isinstance(since, int)) or not isinstance(start, int)):
            raise ValueError(f"export header is damaged: {orjson.dumps(fields).decode()}")
        return cls(job=job, inputs=inputs, since_ns=since, start_seq=start, format=version)

    @classmethod
    def for_filters(cls, job: str | None, since_ns: int | None, start_seq: int,
                    replayable: bool) -> ExportHeader | None:
        """The header an export with these filters gets: only a per-job export has one (it names the job whose
        outputs it holds). A cut by time or sequence alone is a plain slice of the log, which a reader sees from
        its first sequence."""
        if job is None:
            return None
        return cls(job=job, inputs="all" if replayable else "job", since_ns=since_ns, start_seq=max(start_seq, 1))


def write_file(path: str | os.PathLike[str], records: Iterator[Record | RawRecord] | list[Record | RawRecord]) -> int:
    """Write records as a JSONL export; returns how many."""
    count = 0
    with open(path, "wb") as fh:
        for record in records:
            fh.write(encode_record(record) + b"\n")
            count += 1
    return count


def subject_job(subject: str) -> str | None:
    """The job a decision subject (`recovery.dec.<job>`) or job-event subject (`recovery.ev.job.<job>.<kind>`)
    names, else None."""
    tokens = subject.split(".")
    if len(tokens) >= 3 and tokens[0] == PREFIX and tokens[1] == "dec":
        return tokens[2]
    if len(tokens) >= 4 and tokens[0] == PREFIX and tokens[1] == "ev" and tokens[2] == "job":
        return tokens[3]
    return None


def record_jobs(record: Record | RawRecord) -> set[str]:
    """The jobs a record belongs to: its envelope's job, and the job named by a decision subject
    (`recovery.dec.<job>`) or a job-event subject (`recovery.ev.job.<job>.<kind>`), so that a bad input
    on a job's subject, which has no decoded envelope, still belongs to that job."""
    jobs: set[str] = set()
    if isinstance(record, Record) and record.envelope.job:
        jobs.add(record.envelope.job)
    named = subject_job(record.subject)
    if named is not None:
        jobs.add(named)
    return jobs


def rejection_jobs(rejection: Rejection) -> set[str]:
    """The jobs a rejection concerns: the rejected envelope's job and the job its subject names. Empty for a
    node event's or an unattributable input's: such a rejection concerns every job (a per-job export keeps it)."""
    jobs = {rejection.job} if rejection.job else set()
    named = subject_job(rejection.subject)
    if named is not None:
        jobs.add(named)
    return jobs


def record_matches(record: Record | RawRecord, job: str | None = None, since_ns: int | None = None) -> bool:
    """The narrow export filters: `job` is one of the record's jobs, and the log time is at or after `since_ns`.
    A log narrowed to one job's records cannot be replayed exactly (the engine's decisions for a job depend on
    node events and other jobs): `replay_matches` is the filter for that."""
    if since_ns is not None and record.ts < since_ns:
        return False
    return job is None or job in record_jobs(record)


def replay_matches(record: Record | RawRecord, job: str | None = None, since_ns: int | None = None) -> bool:
    """The `recovery-replay export` filter: log time at or after `since_ns`, and for `job`, every input record
    (any job's or node's, and bad input: the engine's decisions for `job` depend on the whole cluster, such as
    a spare another job took), `job`'s decisions, every job's `job.accepted` decision (the policies each job
    ran with, so that verify can tell a changed policy of a job sharing the cluster from a bug), and the dead
    letters that concern `job` or no job. Only the other jobs' other outputs are left out."""
    if since_ns is not None and record.ts < since_ns:
        return False
    if job is None or not is_output(record.subject):
        return True
    if isinstance(record, Record):
        envelope = record.envelope
        if envelope.type == "rejection" and record.subject.startswith(f"{PREFIX}.dlq."):
            jobs = rejection_jobs(envelope.data)
            return not jobs or job in jobs
        if envelope.type == "decision" and envelope.data.kind == "job.accepted":
            return True
    jobs = record_jobs(record)
    # An undecodable record on a dead-letter subject names no job: kept, like a rejection of no job.
    return job in jobs or (not jobs and record.subject.startswith(f"{PREFIX}.dlq."))


def export_filter(job: str | None, since_ns: int | None, replayable: bool
                  ) -> Callable[[Record | RawRecord], bool]:
    """The filter of an export: `replay_matches` for a replayable one (what `recovery-replay export` writes),
    else the narrow `record_matches`."""
    match = replay_matches if replayable else record_matches
    return lambda record: match(record, job, since_ns)


async def export_log(
    log: EventLog, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
    since_ns: int | None = None, *, replayable: bool = False,
) -> int:
    """Write the records of `log` from `start_seq` that match the filters as a JSONL export; returns how
    many. A per-job export starts with its `ExportHeader`. `replayable` keeps every input record for a `job`
    export (see `replay_matches`); without it only the job's own records are kept. The file appears complete
    or not at all (written beside it, then renamed)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    count = 0
    header = ExportHeader.for_filters(job, since_ns, start_seq, replayable)
    keep = export_filter(job, since_ns, replayable)
    try:
        with tmp.open("wb") as fh:
            if header is not None:
                fh.write(header.encode() + b"\n")
            async for record in log.read(start_seq):
                if keep(record):
                    fh.write(encode_record(record) + b"\n")
                    count += 1
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return count

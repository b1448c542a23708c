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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from events import RawRecord, Record, decode_record_line, encode_record
from events.codec import decode_envelope, encode_envelope
from events.envelope import EnvelopeBase
from events.subjects import PREFIX

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


def _prepare(payload: EnvelopeBase | bytes, headers: dict[str, str] | None) -> tuple[bytes, dict[str, str]]:
    hdrs = dict(headers or {})
    if isinstance(payload, EnvelopeBase):
        hdrs.setdefault(MSG_ID, payload.id)
        return encode_envelope(payload), hdrs
    return payload, hdrs


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
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        data, hdrs = _prepare(payload, headers)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._count += 1
        record = to_record(self._count, self._stamp(), subject, hdrs, data)
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
        since_ns: int | None = None,
    ) -> int:
        return await export_log(self, path, start_seq, job, since_ns)

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
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        data, hdrs = _prepare(payload, headers)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._last_seq += 1
        self._last_ts = max(self._last_ts, self._clock())
        record = to_record(self._last_seq, self._last_ts, subject, hdrs, data)
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
        since_ns: int | None = None,
    ) -> int:
        return await export_log(self, path, start_seq, job, since_ns)

    def close_sync(self) -> None:
        self._fh.close()

    async def close(self) -> None:
        self.close_sync()


def iter_file(path: str | os.PathLike[str]) -> Iterator[Record | RawRecord]:
    """Read a JSONL export. A broken line raises ValueError naming the line: the file itself is corrupt."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield decode_record_line(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc


def write_file(path: str | os.PathLike[str], records: Iterator[Record | RawRecord] | list[Record | RawRecord]) -> int:
    """Write records as a JSONL export; returns how many."""
    count = 0
    with open(path, "wb") as fh:
        for record in records:
            fh.write(encode_record(record) + b"\n")
            count += 1
    return count


def record_jobs(record: Record | RawRecord) -> set[str]:
    """The jobs a record belongs to: its envelope's job, and the job named by a decision subject
    (`recovery.dec.<job>`) or a job-event subject (`recovery.ev.job.<job>.<kind>`), so that a bad input
    on a job's subject, which has no decoded envelope, still belongs to that job."""
    jobs: set[str] = set()
    if isinstance(record, Record) and record.envelope.job:
        jobs.add(record.envelope.job)
    tokens = record.subject.split(".")
    if len(tokens) >= 3 and tokens[0] == PREFIX and tokens[1] == "dec":
        jobs.add(tokens[2])
    elif len(tokens) >= 4 and tokens[0] == PREFIX and tokens[1] == "ev" and tokens[2] == "job":
        jobs.add(tokens[3])
    return jobs


def record_matches(record: Record | RawRecord, job: str | None = None, since_ns: int | None = None) -> bool:
    """The export filters: `job` is one of the record's jobs, and the log time is at or after `since_ns`."""
    if since_ns is not None and record.ts < since_ns:
        return False
    return job is None or job in record_jobs(record)


async def export_log(
    log: EventLog, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
    since_ns: int | None = None,
) -> int:
    """Write the records of `log` from `start_seq` that match the filters as a JSONL export; returns how
    many. The file appears complete or not at all (written beside it, then renamed)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    count = 0
    try:
        with tmp.open("wb") as fh:
            async for record in log.read(start_seq):
                if record_matches(record, job, since_ns):
                    fh.write(encode_record(record) + b"\n")
                    count += 1
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return count

"""The JSONL file log, in the export format (one record per line), and the readers and writer of that format."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from pathlib import Path

from pydantic import ValidationError

from events import RawRecord, Record, decode_record_line, encode_record
from events.envelope import EnvelopeBase
from recovery.core.overruns import OVERRAN, CallKey, OverranFact, overruns_in
from recovery.log.base import MSG_ID, Appended, Clock, Dedupe, prepare, stored
from recovery.log.export import ExportHeader, export_log


class FileLog:
    """A JSONL file in the export format, one record per line; appends are flushed line by line."""

    def __init__(self, path: str | os.PathLike[str], clock: Clock = time.time_ns, dedupe_window: int = 100_000):
        self.path = Path(path)
        self._clock = clock
        self._dedupe = Dedupe(dedupe_window)
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
        data, hdrs = prepare(payload, headers, encoded)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._last_seq += 1
        self._last_ts = max(self._last_ts, self._clock())
        record = stored(self._last_seq, self._last_ts, subject, hdrs, payload, data)
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


def overruns_in_file(path: str | os.PathLike[str]) -> dict[CallKey, OverranFact]:
    """The abandoned policy calls a JSONL export records (`recovery.core.overruns`), read before a replay of the
    same file: a fact is written after the input it is about, so a replay must know it first. Only the lines that
    name the fact are decoded, so that a replay of a large export keeps streaming its records."""
    marker = OVERRAN.encode()
    with open(path, "rb") as fh:
        lines = [line for line in fh if marker in line]
    return overruns_in(decode_record_line(line) for line in lines)


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


def write_file(path: str | os.PathLike[str], records: Iterator[Record | RawRecord] | list[Record | RawRecord]) -> int:
    """Write records as a JSONL export; returns how many."""
    count = 0
    with open(path, "wb") as fh:
        for record in records:
            fh.write(encode_record(record) + b"\n")
            count += 1
    return count

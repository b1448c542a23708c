"""Logs in memory: `MemoryLog` for tests, the simulator and what-if replays, and `CountingLog`, which keeps
nothing, for a simulation whose log nobody reads."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator

from events import RawRecord, Record
from events.envelope import EnvelopeBase
from recovery.log.base import MSG_ID, Appended, Clock, Dedupe, prepare, stored
from recovery.log.export import export_log


class MemoryLog:
    """A log in a list: for tests, the simulator and what-if replays."""

    def __init__(self, clock: Clock = time.time_ns, dedupe_window: int = 100_000) -> None:
        self._clock = clock
        self._last_ts = 0
        self._count = 0
        self._records: list[Record | RawRecord] = []
        self._dedupe = Dedupe(dedupe_window)

    def _stamp(self) -> int:
        # Log time never goes backwards, whatever the clock does: order is the sequence, and time follows it.
        self._last_ts = max(self._last_ts, self._clock())
        return self._last_ts

    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended:
        """Append and return the stored record; `encoded`: the envelope's bytes, if the caller has them already."""
        data, hdrs = prepare(payload, headers, encoded)
        first = self._dedupe.check(hdrs.get(MSG_ID))
        if first is not None:
            return Appended(first, True)
        self._count += 1
        record = stored(self._count, self._stamp(), subject, hdrs, payload, data)
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

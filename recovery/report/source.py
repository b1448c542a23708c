"""Where a report's records come from: a JSONL export read line by line, or the JetStream log read message by
message. Both yield plain dicts (`seq`, `ts`, `subject`, `envelope`), one at a time, so that a report over a log of
any length holds one record at a time: the reports read recorded decisions and inputs, they re-derive nothing, so
they need no pydantic model of each record (decoding a million models would take most of the time budget).

A partitioned log's job events come out on the subjects they were published on (`events.subjects.unpartitioned`),
and its fence claims (no envelope) not at all: a report reads a partitioned log as one log.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from queue import Queue
from typing import Any

import orjson

from events.codec import encode_record
from events.envelope import RawRecord, Record
from events.subjects import PARTITIONED_EVENTS, unpartitioned

RawDict = dict[str, Any]
CHUNK = 256
"""records handed from the JetStream reader's thread to the fold at once"""
_PARTITIONED = f"{PARTITIONED_EVENTS}."


def iter_file(path: str | os.PathLike[str]) -> Iterator[RawDict]:
    """The records of a JSONL export as dicts, after the export header if there is one. A line that is not a record
    raises ValueError naming the file and the line (and saying when it is a last line cut short)."""
    loads = orjson.loads
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except orjson.JSONDecodeError as exc:
                cut = "" if line.endswith(b"\n") else " (the last line is cut short: no newline at its end)"
                raise ValueError(f"{path}:{number}: not a log record{cut}: {exc}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{number}: not a log record: a JSON {type(obj).__name__}")
            if "seq" not in obj and "export" in obj:
                continue  # a per-job export's header: what its filters kept, which the report does not need
            if not isinstance(obj.get("ts"), int) or not isinstance(obj.get("seq"), int) or not isinstance(
                    obj.get("subject"), str):
                raise ValueError(f"{path}:{number}: not a log record (no sequence, log time or subject)")
            if not isinstance(obj.get("envelope"), dict):
                # input kept as received because it could not be decoded ("raw"): the engine rejected it, and its
                # dead letter is what the reports count
                continue
            if obj["subject"].startswith(_PARTITIONED):
                obj["subject"] = unpartitioned(obj["subject"])
            yield obj


def as_dict(record: Record | RawRecord) -> RawDict | None:
    """A decoded record as the dict its JSONL line holds; None for a record whose envelope could not be decoded."""
    if isinstance(record, RawRecord):
        return None
    obj: RawDict = orjson.loads(encode_record(record))
    if record.subject.startswith(_PARTITIONED):
        obj["subject"] = unpartitioned(record.subject)
    return obj


def iter_nats(url: str, stream: str, connect: Any) -> Iterator[RawDict]:
    """The records of the live JetStream log, streamed: a reader thread runs the async pull reader and hands records
    over through a small queue in chunks, so the fold runs as records arrive and at most `4 * CHUNK` wait in memory.
    `connect` is `async (url, stream) -> log` (the CLI's read-only connection)."""
    queue: Queue[list[RawDict] | BaseException | None] = Queue(maxsize=4)
    stop = threading.Event()

    async def pump() -> None:
        log = await connect(url, stream)
        try:
            records: AsyncIterator[Record | RawRecord] = log.read()
            chunk: list[RawDict] = []
            async for record in records:
                if stop.is_set():
                    return
                obj = as_dict(record)
                if obj is not None:
                    chunk.append(obj)
                if len(chunk) >= CHUNK:  # one hand-over per chunk: a thread hop per record would cost more
                    await asyncio.to_thread(queue.put, chunk)
                    chunk = []
            if chunk:
                await asyncio.to_thread(queue.put, chunk)
        finally:
            await log.close()

    def run() -> None:
        try:
            asyncio.run(pump())
        except BaseException as exc:  # handed to the reading thread, which raises it
            queue.put(exc)
            return
        queue.put(None)

    reader = threading.Thread(target=run, name="report-nats-reader", daemon=True)
    reader.start()
    try:
        while True:
            item = queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item
    finally:
        stop.set()
        while reader.is_alive():  # unblock a reader waiting on a full queue, then let it finish
            while not queue.empty():
                queue.get_nowait()
            reader.join(timeout=0.1)

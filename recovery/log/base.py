"""The event-log contract: what every log is (`EventLog`, and `SyncLog` for the synchronous ones the recorder
drives), what an append returns, and what all logs share: message ids, deduplication, decoding a stored message.

Every log keeps records in a strict sequence, stamps each with its own time (logical time for the engine), and
drops a message whose id it has already stored within its duplicate window, as JetStream does with
`Nats-Msg-Id`. The memory, JSONL file and JetStream logs pass one contract suite
(`recovery.testing.log_contract`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from events import RawRecord, Record
from events.codec import decode_envelope, encode_envelope
from events.envelope import EnvelopeBase, stored_record
from events.subjects import is_output
from policies.base import NS

MSG_ID = "Nats-Msg-Id"
Clock = Callable[[], int]
EPOCH = 1_767_225_600 * NS
"""2026-01-01T00:00:00Z: where virtual log time starts (scenarios, the simulator), so their logs are byte-stable"""


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


class SyncLog(Protocol):
    """A log appended to in the caller's thread (memory, file): what the `Recorder` drives."""

    def append_sync(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None,
        encoded: bytes | None = None,
    ) -> Appended: ...


def to_record(seq: int, ts: int, subject: str, headers: dict[str, str], data: bytes) -> Record | RawRecord:
    """Decode a stored message for the engine: a Record, or a RawRecord that the engine will reject."""
    envelope = decode_envelope(data)
    if isinstance(envelope, EnvelopeBase):
        return stored_record(seq, ts, subject, headers, envelope)
    return RawRecord(seq=seq, ts=ts, subject=subject, headers=headers, data=data)


class Dedupe:
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


def prepare(payload: EnvelopeBase | bytes, headers: dict[str, str] | None,
            encoded: bytes | None = None) -> tuple[bytes, dict[str, str]]:
    """The bytes and headers a message is stored with: an envelope's id goes out as its message id."""
    hdrs = dict(headers or {})
    if isinstance(payload, EnvelopeBase):
        hdrs.setdefault(MSG_ID, payload.id)
        return encoded if encoded is not None else encode_envelope(payload), hdrs
    return payload, hdrs


def stored(seq: int, ts: int, subject: str, headers: dict[str, str], payload: EnvelopeBase | bytes,
           data: bytes) -> Record | RawRecord:
    """The record as read back. The engine's own outputs are kept as the envelope it made (decoding the bytes just
    written would give it again); inputs are decoded from their bytes, as the daemon receives them."""
    if isinstance(payload, EnvelopeBase) and is_output(subject):
        return stored_record(seq, ts, subject, headers, payload)
    return to_record(seq, ts, subject, headers, data)

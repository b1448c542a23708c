"""The JetStream event log: the audit log of `recovery` in one NATS JetStream stream.

Only the event-log adapters (this module) import `nats`; the engine, `events/` and `policies/` never do.

- The stream keeps every record (retention LIMITS, no age or size limit set here), on file storage,
  with `deny_delete`/`deny_purge`, and a duplicate window that covers a daemon restart: an envelope's
  id goes out as `Nats-Msg-Id`, so a republished event is dropped by the server.
- Order is the stream sequence; logical time is the JetStream message timestamp, taken as integer
  nanoseconds from the delivery metadata (never through a float or a datetime).
- `read` pulls from an ephemeral, memory-backed, no-ack pull consumer in pipelined batches, checks the
  consumer sequence for gaps and, if delivery stalls or a gap shows (a NATS outage, a lost consumer),
  recreates the consumer at the next sequence it needs: every record comes once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.nuid import NUID

from events.envelope import EnvelopeBase, RawRecord, Record
from events.subjects import DEAD_LETTERS, DECISIONS, EVENTS
from recovery.log.base import MSG_ID, Appended, prepare, to_record
from recovery.log.export import export_log

logger = logging.getLogger("recovery.jetstream")  # the name operators filter on: kept since it moved

DEFAULT_STREAM = "RECOVERY"
DEFAULT_SUBJECTS = [EVENTS, DECISIONS, DEAD_LETTERS]
API_PREFIX = "$JS.API"

# Errors after which a publish or a pull may simply be tried again (the connection reconnects forever).
_TRANSIENT: tuple[type[Exception], ...] = (
    asyncio.TimeoutError,  # nats.errors.TimeoutError derives from it
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.TooManyStalledMsgsError,  # `publish_async` waited out its stall time for a slot: a timeout
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
)

TOO_MANY_REQUESTS = 429
"""JetStream's answer when a stream's ingest buffer is full (`max_buffered_msgs`/`max_buffered_size`, 10,000
messages by default): the message was turned away before it was stored, so sending it again is always safe."""


def describe_error(exc: BaseException) -> str:
    """For logs: nats-py's errors have an empty repr (`APIError()`) and asyncio's timeout an empty str."""
    return str(exc) or type(exc).__name__


def is_too_many_requests(exc: BaseException) -> bool:
    """A JetStream 429. nats-py raises it as a plain `APIError` with `code == 429` (err_code 10167)."""
    return isinstance(exc, nats.js.errors.APIError) and exc.code == TOO_MANY_REQUESTS


def is_retryable(exc: BaseException, idempotent: bool) -> bool:
    """Whether a failed publish may be sent again. A 429 always: the server refused it, nothing was stored.
    The other transient failures (a timeout, an outage) may hide a publish that was stored after all, so only a
    message with a `Nats-Msg-Id` (`idempotent`), whose repeat the server drops, is sent again after them."""
    if is_too_many_requests(exc):
        return True
    return idempotent and isinstance(exc, _TRANSIENT)


class Backoff:
    """Doubling delays between retries, jittered so that publishers refused together do not come back
    together, within an optional overall budget of seconds."""

    def __init__(self, budget: float | None = None, first: float = 0.05, cap: float = 1.0) -> None:
        self.deadline = None if budget is None else time.monotonic() + budget
        self.first = first
        self.cap = cap
        self.delay = first

    def next_delay(self) -> float | None:
        """The next pause, or None when it would end past the budget (give up)."""
        delay = self.delay * random.uniform(0.5, 1.0)
        if self.deadline is not None and time.monotonic() + delay > self.deadline:
            return None
        self.delay = min(self.delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.first


async def publish_with_retry(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    headers: dict[str, str] | None = None,
    retry_for: float = 30.0,
    timeout: float | None = None,
) -> PubAck:
    """One JetStream publish, waiting for its acknowledgement, sent again with backoff while `is_retryable`
    says so, for up to `retry_for` seconds; then the last error is raised. The one publish-retry policy of every
    publisher here (the log, the daemon's pipelined effects, the benches)."""
    idempotent = bool(headers) and MSG_ID in (headers or {})
    backoff = Backoff(retry_for)
    while True:
        try:
            # A copy: nats-py may add headers of its own to the dict it is given.
            return await js.publish(subject, data, timeout=timeout, headers=dict(headers) if headers else None)
        except Exception as exc:
            if not is_retryable(exc, idempotent):
                raise
            delay = backoff.next_delay()
            if delay is None:
                raise
            logger.warning("publish to %s failed (%s), retrying in %.2fs", subject, describe_error(exc), delay)
            await asyncio.sleep(delay)  # retry backoff: the server is overloaded or unreachable


def surface_async_ack_errors(js: JetStreamContext) -> bool:
    """Make `js.publish_async` futures fail with the server's error (a 429 above all) instead of staying pending.

    nats-py 2.16 calls `APIError.from_error`, which raises instead of returning, inside its ack handler: the error
    goes to the connection's error callback and the publish's future is never resolved (nats-io/nats.py#985).
    A caller that waits without a timeout hangs; one with a timeout retries only after it. This wraps the
    handler of this context so that the future gets the error. It must run before the first `publish_async`
    (which subscribes the handler); it returns False, changing nothing, if that has happened or if nats-py's
    internals are not the ones it knows - callers must still bound their waits."""
    handler = getattr(js, "_handle_async_reply", None)
    if getattr(handler, "surfaces_ack_errors", False):
        return True  # wrapped already (the daemon's and the tests' helpers may both ask)
    if getattr(js, "_async_reply_prefix", True) is not None or not hasattr(js, "_publish_async_futures"):
        return False
    assert handler is not None

    async def handle_async_reply(msg: Msg) -> None:
        try:
            await handler(msg)
        except nats.js.errors.APIError as exc:
            prefix = js._async_reply_prefix
            future = js._publish_async_futures.get(msg.subject[len(prefix):]) if prefix else None
            if future is not None and not future.done():
                future.set_exception(exc)

    handle_async_reply.surfaces_ack_errors = True  # type: ignore[attr-defined]
    js._handle_async_reply = handle_async_reply  # type: ignore[method-assign]
    return True


_NUID = NUID()


FOLLOW_END = 2**63 - 1
"""the end of a reader that follows the stream: no sequence reaches it"""


class _ReaderLost(Exception):
    """The pull consumer stopped delivering in order (gap, stall, deletion): recreate it."""


def _parse_ack_reply(reply: str) -> tuple[int, int, int, int]:
    """(stream seq, consumer seq, timestamp ns, pending) from a JetStream delivery's reply subject:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (v1) or
    `$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]`
    (v2). The timestamp is the server's integer nanoseconds, kept exact."""
    tokens = reply.split(".")
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5]), int(tokens[6]), int(tokens[7]), int(tokens[8])
    if len(tokens) >= 11 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[7]), int(tokens[8]), int(tokens[9]), int(tokens[10])
    raise ValueError(f"not a JetStream delivery reply subject: {reply!r}")


class _Reader:
    """One ephemeral pull consumer over [start, end] with pipelined pull requests on one inbox."""

    def __init__(self, owner: JetStreamLog, start: int, end: int, filter_subject: str | None = None) -> None:
        self._owner = owner
        self._start = start
        self._end = end
        self._filter = filter_subject
        self._follow = end == FOLLOW_END  # a tail: never exhausted, it waits for the next message
        self._batch = owner.read_batch
        self._inbox = owner.nc.new_inbox()
        self._name = _NUID.next().decode()
        self._next_subject = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{owner.stream}.{self._name}"
        self._sub: Subscription | None = None
        self._created = False
        self._buffer: deque[Msg] = deque()
        self._arrived = asyncio.Event()
        self._outstanding = 0  # messages asked for and not yet delivered
        self._highest = start - 1  # highest stream sequence delivered
        self._cseq = 0  # last consumer sequence delivered
        self._connection = owner.connection_generation  # a reconnect may have lost the consumer
        self.exhausted = False  # nothing left in [start, end]

    async def open(self) -> None:
        nc = self._owner.nc
        self._sub = await nc.subscribe(self._inbox, cb=self._on_msg)
        config = ConsumerConfig(
            name=self._name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self._start,
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=max(self._owner.stall_timeout, 5.0),
            filter_subject=self._filter,
        )
        info = await self._owner.js.add_consumer(self._owner.stream, config=config)
        self._created = True
        if info.num_pending == 0 and not self._follow:
            self.exhausted = True
            return
        await self._pull()

    async def _on_msg(self, msg: Msg) -> None:
        self._buffer.append(msg)
        self._arrived.set()

    def wake(self) -> None:
        self._arrived.set()

    async def _pull(self) -> None:
        # Keep between one and two batches asked for, never more than the range still needs (the range
        # is contiguous unless the stream lost messages; a short count only means one more pull).
        needed = self._end - self._highest - self._outstanding
        while self._outstanding < self._batch and needed > 0:
            count = min(self._batch, needed)
            request = {"batch": count, "expires": int(self._owner.pull_expires * 1e9)}
            await self._owner.nc.publish(self._next_subject, orjson.dumps(request), reply=self._inbox)
            self._outstanding += count
            needed -= count

    async def next_batch(self) -> list[Record | RawRecord]:
        """The records delivered since the last call (at least one unless the range is exhausted)."""
        out: list[Record | RawRecord] = []
        # A healthy server answers every pull within its expiry, with messages or a timeout status.
        idle = 2 * self._owner.pull_expires + 1
        if self._follow and not self._outstanding:
            await self._pull()  # a tail asks again after each expired pull
        while not out and not self.exhausted:
            if not self._buffer:
                self._arrived.clear()
                if self._owner.connection_generation != self._connection:
                    raise _ReaderLost("reconnected")
                try:
                    async with asyncio.timeout(idle):
                        await self._arrived.wait()
                except TimeoutError as exc:
                    raise _ReaderLost(f"no delivery for {idle}s") from exc
            while self._buffer and not self.exhausted:
                self._take(self._buffer.popleft(), out)
            if not self.exhausted:
                await self._pull()
        return out

    def _take(self, msg: Msg, out: list[Record | RawRecord]) -> None:
        reply = msg.reply
        if not reply:
            # A status message ends a pull request: 404/408 (no messages, expired) or 409 (limits,
            # leadership change, consumer deleted). Ask again, or start over if the consumer is gone.
            status = (msg.headers or {}).get("Status", "")
            description = (msg.headers or {}).get("Description", "")
            if status == "409" and "Consumer Deleted" in description:
                raise _ReaderLost("consumer deleted")
            if status in ("404", "408", "409"):
                self._outstanding = 0
            return
        sseq, cseq, ts, pending = _parse_ack_reply(reply)
        if cseq <= self._cseq:
            return  # already seen
        if cseq != self._cseq + 1:
            raise _ReaderLost(f"gap in consumer sequence: {self._cseq} then {cseq}")
        self._cseq = cseq
        self._outstanding = max(self._outstanding - 1, 0)
        if sseq > self._end:
            self.exhausted = True
            return
        self._highest = sseq
        out.append(to_record(sseq, ts, msg.subject, msg.headers or {}, msg.data))
        if sseq >= self._end or (pending == 0 and not self._follow):
            self.exhausted = True

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._created and self._owner.nc.is_connected:
            # Best effort: the inactive threshold removes it anyway if this does not get through.
            with contextlib.suppress(Exception):
                await self._owner.js.delete_consumer(self._owner.stream, self._name)
        self._created = False


class JetStreamLog:
    """An `EventLog` over one JetStream stream. Create it with `await JetStreamLog.connect(url)`."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        stream: str,
        *,
        read_batch: int = 2048,
        stall_timeout: float = 30.0,
        pull_expires: float = 5.0,
        publish_retry: float = 30.0,
        owns_connection: bool = True,
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.read_batch = read_batch
        self.stall_timeout = stall_timeout
        self.pull_expires = pull_expires
        self.publish_retry = publish_retry
        self._owns_connection = owns_connection
        self.connection_generation = 0  # counts reconnects
        self._readers: set[_Reader] = set()

    async def _reconnected(self) -> None:
        """nats-py's reconnected callback (set by `connect`): readers re-create their consumers, which a
        restarted server no longer has, instead of waiting for their pulls to time out."""
        self.connection_generation += 1
        logger.info("reconnected to %s", self.nc.connected_url.netloc if self.nc.connected_url else "?")
        for reader in self._readers:
            reader.wake()

    @classmethod
    async def connect(
        cls,
        url: str,
        stream: str = DEFAULT_STREAM,
        subjects: list[str] | None = None,
        duplicate_window_s: float = 600,
        replicas: int = 1,
        request_timeout: float = 5.0,
        **options: Any,
    ) -> JetStreamLog:
        """Connect (reconnecting forever) and create or update the stream. `request_timeout` bounds one
        JetStream API request or publish acknowledgement (a publish lost in a disconnect is retried after
        it); `options` go to the constructor (read_batch, stall_timeout, pull_expires, publish_retry)."""
        created: list[JetStreamLog] = []

        async def reconnected() -> None:
            for instance in created:
                await instance._reconnected()

        nc = await nats.connect(
            url,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            reconnected_cb=reconnected,
            name=f"recovery-log-{os.getpid()}",
        )
        try:
            js = nc.jetstream(timeout=request_timeout)
            await ensure_stream(js, stream_config(stream, subjects, duplicate_window_s, replicas))
        except BaseException:
            await nc.close()
            raise
        instance = cls(nc, js, stream, **options)
        created.append(instance)
        return instance

    open = connect

    async def append(
        self, subject: str, payload: EnvelopeBase | bytes, headers: dict[str, str] | None = None
    ) -> Appended:
        """Publish and wait for the stream's acknowledgement. A message with an id is retried on a timeout
        or an outage until `publish_retry` seconds have passed (the server drops the repeat, so a retry
        whose first try was stored returns duplicate=True with that sequence); one without is sent again only
        after a 429 (the server refused it: nothing was stored)."""
        data, hdrs = prepare(payload, headers)
        ack = await publish_with_retry(self.js, subject, data, hdrs or None, retry_for=self.publish_retry)
        if ack.stream != self.stream:
            # Streams in one account cannot share subjects, so this is a misconfiguration, not a race.
            raise RuntimeError(f"{subject} was stored in stream {ack.stream!r} (seq {ack.seq}), not {self.stream!r}")
        return Appended(ack.seq, bool(ack.duplicate))

    async def stream_info(self) -> StreamInfo:
        """The stream's configuration and state, asked again through an outage for up to `stall_timeout`."""
        deadline = time.monotonic() + self.stall_timeout
        delay = 0.05
        while True:
            try:
                return await self.js.stream_info(self.stream)
            except _TRANSIENT:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)  # retry backoff during an outage
                delay = min(delay * 2, 1.0)

    async def last_seq(self) -> int:
        info = await self.stream_info()
        return int(info.state.last_seq)

    async def read(self, start_seq: int = 1) -> AsyncIterator[Record | RawRecord]:
        """Every record from `start_seq` to the stream's last sequence when iteration starts, in order."""
        state = (await self.stream_info()).state
        end = int(state.last_seq)
        next_seq = max(start_seq, int(state.first_seq), 1)
        reader: _Reader | None = None
        progress = time.monotonic()
        delay = 0.05
        try:
            while next_seq <= end:
                try:
                    if reader is None:
                        reader = _Reader(self, next_seq, end)
                        self._readers.add(reader)
                        await reader.open()
                    batch = await reader.next_batch()
                except (_ReaderLost, *_TRANSIENT) as exc:  # type: ignore[misc]  # mypy cannot see a starred tuple
                    if reader is not None:
                        self._readers.discard(reader)
                        await reader.close()
                        reader = None
                    if time.monotonic() - progress > self.stall_timeout:
                        raise TimeoutError(
                            f"reading {self.stream} stalled at sequence {next_seq} for {self.stall_timeout}s"
                        ) from exc
                    logger.warning("reading %s at %d: %s; resuming", self.stream, next_seq, exc)
                    await asyncio.sleep(delay)  # retry backoff during an outage
                    delay = min(delay * 2, 1.0)
                    continue
                if batch:
                    progress = time.monotonic()
                    delay = 0.05
                for record in batch:
                    if record.seq < next_seq:
                        continue
                    yield record
                    next_seq = record.seq + 1
                if reader.exhausted:
                    break
        finally:
            if reader is not None:
                self._readers.discard(reader)
                await reader.close()

    async def follow(self, start_seq: int, filter_subject: str | None = None) -> AsyncIterator[Record | RawRecord]:
        """Every record from `start_seq` on (those on `filter_subject` only, when given), in order, waiting for new
        ones forever: the same reader as `read`, re-created at the next sequence it needs after an outage."""
        next_seq = max(start_seq, 1)
        reader: _Reader | None = None
        delay = 0.05
        try:
            while True:
                try:
                    if reader is None:
                        reader = _Reader(self, next_seq, FOLLOW_END, filter_subject)
                        self._readers.add(reader)
                        await reader.open()
                    batch = await reader.next_batch()
                except (_ReaderLost, *_TRANSIENT) as exc:  # type: ignore[misc]  # mypy cannot see a starred tuple
                    if reader is not None:
                        self._readers.discard(reader)
                        await reader.close()
                        reader = None
                    logger.warning("following %s at %d: %s; resuming", self.stream, next_seq, exc)
                    await asyncio.sleep(delay)  # retry backoff during an outage
                    delay = min(delay * 2, 1.0)
                    continue
                delay = 0.05
                for record in batch:
                    if record.seq < next_seq:
                        continue
                    yield record
                    next_seq = record.seq + 1
        finally:
            if reader is not None:
                self._readers.discard(reader)
                await reader.close()

    async def export(
        self, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
        since_ns: int | None = None, *, replayable: bool = False,
    ) -> int:
        """Write the JSONL export of the records from `start_seq` (of `job`, at or after `since_ns`; with
        `replayable`, every input and only `job`'s outputs: see `recovery.log.replay_matches`)."""
        return await export_log(self, path, start_seq, job, since_ns, replayable=replayable)

    async def close(self) -> None:
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.close()


def stream_config(
    name: str = DEFAULT_STREAM,
    subjects: list[str] | None = None,
    duplicate_window_s: float = 600,
    replicas: int = 1,
) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=list(subjects) if subjects is not None else list(DEFAULT_SUBJECTS),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
        deny_delete=True,
        deny_purge=True,
    )


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    """Create the stream, or bring an existing one to `config` (a no-op when it already matches)."""
    try:
        return await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # stream name already in use with a different configuration
            raise
    return await js.update_stream(config)

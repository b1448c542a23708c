"""The JetStream event log: the audit log of `recovery` in one NATS JetStream stream.

Only the event-log adapters (this module) import `nats`; the engine, `events/` and `policies/` never do.

- The stream keeps every record (retention LIMITS, no age or size limit set here), on file storage,
  with `deny_delete`/`deny_purge`, and a duplicate window that covers a daemon restart: an envelope's
  id goes out as `Nats-Msg-Id`, so a republished event is dropped by the server.
- Order is the stream sequence; logical time is the JetStream message timestamp, taken as integer
  nanoseconds from the delivery metadata (never through a float or a datetime).
- `read` reads through the one pull reader (`recovery.log.pull`): an ephemeral, memory-backed, no-ack
  consumer over the range, and, when the reader loses order (a NATS outage, a lost consumer), a new one at the
  next sequence it needs: every record comes once, in order.
- `TRANSIENT` is the one list of errors after which a NATS operation may simply be tried again; a publish goes
  by `is_retryable`, which adds what makes repeating it safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)

from events.envelope import EnvelopeBase, RawRecord, Record
from events.subjects import DEAD_LETTERS, DECISIONS, EVENTS
from recovery.log.base import MSG_ID, Appended, prepare, to_record
from recovery.log.export import export_log
from recovery.log.pull import PullReader, ReaderLost

logger = logging.getLogger("recovery.jetstream")  # the name operators filter on: kept since it moved

DEFAULT_STREAM = "RECOVERY"
DEFAULT_SUBJECTS = [EVENTS, DECISIONS, DEAD_LETTERS]

TRANSIENT: tuple[type[BaseException], ...] = (
    asyncio.TimeoutError,  # nats.errors.TimeoutError derives from it
    OSError,  # the socket under a connection that is reconnecting
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,  # and UnexpectedEOF
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.TooManyStalledMsgsError,  # `publish_async` waited out its stall time for a slot: a timeout
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    ReaderLost,  # a reader that lost order: opened again, it goes on where it is needed
)
"""Errors after which a NATS operation may simply be tried again (the connection reconnects forever): an outage,
an overloaded or restarting server, a reader that lost its consumer. Everything else (a bad request, a subject no
stream takes, a message over the payload limit, a closed connection) fails again however often it is tried. A
publish is retried by `is_retryable`, which also knows when repeating one cannot store it twice."""

TOO_MANY_REQUESTS = 429
"""JetStream's answer when a stream's ingest buffer is full (`max_buffered_msgs`/`max_buffered_size`, 10,000
messages by default): the message was turned away before it was stored, so sending it again is always safe."""


def describe_error(exc: BaseException) -> str:
    """For logs: nats-py's errors have an empty repr (`APIError()`) and asyncio's timeout an empty str."""
    return str(exc) or type(exc).__name__


def is_too_many_requests(exc: BaseException) -> bool:
    """A JetStream 429. nats-py raises it as a plain `APIError` with `code == 429` (err_code 10167)."""
    # Some of nats-py's APIError subclasses (KeyNotFoundError) are raised without a code attribute at all.
    return isinstance(exc, nats.js.errors.APIError) and getattr(exc, "code", None) == TOO_MANY_REQUESTS


def is_transient(exc: BaseException) -> bool:
    """Whether a failed NATS operation may simply be tried again: one of `TRANSIENT`, or a 429 (a publish the
    server turned away, the lease's and the snapshots' included)."""
    return isinstance(exc, TRANSIENT) or is_too_many_requests(exc)


DUPLICATE_IN_PROCESS = 10158
"""JetStream's answer to a message whose `Nats-Msg-Id` is that of one it is still storing (the first send of a
publish retried after its acknowledgement was late, on a replicated stream): asked again, it says stored or
duplicate"""


def is_retryable(exc: BaseException, idempotent: bool) -> bool:
    """Whether a failed publish may be sent again. A 429 always: the server refused it, nothing was stored.
    The other transient failures (a timeout, an outage) may hide a publish that was stored after all, so only a
    message with a `Nats-Msg-Id` (`idempotent`), whose repeat the server drops, is sent again after them; so is one
    whose first send the server is still storing (`DUPLICATE_IN_PROCESS`)."""
    if is_too_many_requests(exc):
        return True
    in_process = isinstance(exc, nats.js.errors.APIError) and exc.err_code == DUPLICATE_IN_PROCESS
    return idempotent and (in_process or isinstance(exc, TRANSIENT))


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
        self._readers: set[PullReader] = set()

    async def _reconnected(self) -> None:
        """nats-py's reconnected callback (set by `connect`): readers re-create their consumers, which a
        restarted server no longer has, instead of waiting for their pulls to time out."""
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
            except TRANSIENT:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)  # retry backoff during an outage
                delay = min(delay * 2, 1.0)

    async def last_seq(self) -> int:
        info = await self.stream_info()
        return int(info.state.last_seq)

    async def read(self, start_seq: int = 1, end_seq: int | None = None,
                   filter_subject: str | list[str] | None = None) -> AsyncIterator[Record | RawRecord]:
        """Every record from `start_seq` to `end_seq` (default: the stream's last sequence when iteration starts),
        in order; only those on `filter_subject` (one subject, or several), when given."""
        state = (await self.stream_info()).state
        end = int(state.last_seq) if end_seq is None else min(end_seq, int(state.last_seq))
        next_seq = max(start_seq, int(state.first_seq), 1)
        if next_seq > end:
            return
        async for record in self._records(next_seq, end, filter_subject):
            yield record

    async def follow(self, start_seq: int,
                     filter_subject: str | list[str] | None = None) -> AsyncIterator[Record | RawRecord]:
        """Every record from `start_seq` on (those on `filter_subject` only, when given), in order, waiting for new
        ones forever: the same reader as `read` with no end, opened again at the next sequence it needs after an
        outage."""
        async for record in self._records(max(start_seq, 1), None, filter_subject):
            yield record

    async def _records(self, next_seq: int, end: int | None,
                       filter_subject: str | list[str] | None) -> AsyncIterator[Record | RawRecord]:
        """The records from `next_seq` through `end` (None: forever), through one pull reader opened again at the
        next sequence needed after an outage. With an end, an outage longer than `stall_timeout` is an error; a
        follower waits for NATS to come back however long it takes."""
        # Memory storage and no acks: a read holds no state worth keeping, and the server none worth writing.
        consumer = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
                                  inactive_threshold=max(self.stall_timeout, 5.0))
        if isinstance(filter_subject, list) and len(filter_subject) > 1:
            consumer.filter_subjects = filter_subject
        else:  # one filter where one will do: JetStream serves a consumer of several far slower
            consumer.filter_subject = filter_subject[0] if isinstance(filter_subject, list) else filter_subject
        reader = PullReader(self.nc, self.js, self.stream, consumer, batch=self.read_batch,
                            pull_expires_s=self.pull_expires, end_seq=end)
        what = "reading" if end is not None else "following"
        self._readers.add(reader)
        opened = False
        progress = time.monotonic()
        delay = 0.05
        try:
            while (end is None or next_seq <= end) and not reader.done:
                try:
                    if not opened:
                        await reader.open(next_seq)
                        opened = True
                    batch = await reader.next_batch(reader.stall_s)
                except TRANSIENT as exc:
                    opened = False
                    await reader.close()
                    if end is not None and time.monotonic() - progress > self.stall_timeout:
                        raise TimeoutError(
                            f"reading {self.stream} stalled at sequence {next_seq} for {self.stall_timeout}s"
                        ) from exc
                    logger.warning("%s %s at %d: %s; resuming", what, self.stream, next_seq, describe_error(exc))
                    await asyncio.sleep(delay)  # retry backoff during an outage
                    delay = min(delay * 2, 1.0)
                    continue
                delay = 0.05  # the reader answers again
                if batch:
                    progress = time.monotonic()
                for d in batch:
                    if d.seq < next_seq:
                        continue  # delivered before the reader was opened again
                    yield to_record(d.seq, d.ts, d.subject, d.headers or {}, d.data)
                    next_seq = d.seq + 1
        finally:
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
    """Create the stream, or bring an existing one to `config` (a no-op when it already matches). The existing
    stream's metadata is kept beside `config`'s: what a daemon recorded there (`recovery.service.streams`) stays."""
    try:
        return await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # stream name already in use with a different configuration
            raise
    existing = (await js.stream_info(config.name)).config.metadata or {}
    config = replace(config, metadata={**existing, **(config.metadata or {})})
    return await js.update_stream(config)

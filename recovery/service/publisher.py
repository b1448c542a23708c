"""Publishing to JetStream until every message is acknowledged: the daemon's effects, the control service's and
the demo cluster's inputs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from nats.js import JetStreamContext
from nats.js.api import PubAck as JsPubAck

from recovery.log.base import MSG_ID
from recovery.log.jetstream import (
    Backoff,
    describe_error,
    is_retryable,
    is_too_many_requests,
    surface_async_ack_errors,
)
from recovery.service.fence import Fenced, fenced_stream, is_fence_refusal, is_in_flight_refusal

logger = logging.getLogger("recovery.daemon")  # its lines are the daemon's, as before the publisher had a module

@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish, with its deterministic id."""

    subject: str
    data: bytes
    msg_id: str
    kind: str  # command | decision | rejection | input | timer
    plain: str = ""
    """the output's own id where `msg_id` is its sealed form (a decision's, a dead letter's): stored before seals,
    it was stored under this one"""


class Publisher:
    """Publish to JetStream and wait for every acknowledgement, pipelined. A publish that is not acknowledged in
    time, or fails the way an outage or an overloaded server fails it (`recovery.log.jetstream.is_retryable`: a
    timeout, no responders, a connection that is reconnecting, a 429 because the stream's ingest buffer is full),
    is sent again after a backoff, with the same `Nats-Msg-Id`, until it is acknowledged (the server drops a
    repeat of one that was stored): nothing is lost through an outage, and nothing is stored twice. Any other
    error (a message over the payload limit, a subject no stream takes, a closed connection) would fail again
    however often it is sent: it is raised at once."""

    def __init__(self, js: JetStreamContext, timeout: float = 5.0) -> None:
        self.js = js
        self.timeout = timeout
        self.retries = 0
        self.duplicates = 0
        self.fence: Callable[[str], dict[str, str]] | None = None
        """the headers that fence an output to its partition's owner (`recovery.service.fence`), when partitioned"""
        # Without this a refused publish's future never resolves (a nats-py bug): it would cost `timeout`.
        surface_async_ack_errors(js)

    async def publish(self, items: Sequence[Outgoing], deadline: float | None = None) -> list[JsPubAck]:
        """Publish `items` (in order) and return their acknowledgements; TimeoutError if some are still not
        acknowledged at `deadline` (monotonic), the error itself if one is not worth sending again."""
        if self.fence is not None:
            return await self._publish_fenced(items, deadline)
        acks: list[JsPubAck | None] = [None] * len(items)
        remaining = list(range(len(items)))
        backoff = Backoff(None if deadline is None else deadline - time.monotonic())
        while remaining:
            futures: dict[int, asyncio.Future[JsPubAck]] = {}
            error: BaseException | None = None
            try:
                for i in remaining:
                    item = items[i]
                    headers = {MSG_ID: item.msg_id}
                    futures[i] = await self.js.publish_async(item.subject, item.data, wait_stall=self.timeout,
                                                             headers=headers)
            except Exception as exc:
                reraise_cancel(exc)  # nats-py turns a cancellation while waiting for a slot into an error
                if not is_retryable(exc, idempotent=True):
                    raise
                error = exc
            if futures:
                _, pending = await asyncio.wait(futures.values(), timeout=self.timeout)
                for future in pending:
                    future.cancel()
            failed = []
            for i in remaining:
                maybe = futures.get(i)
                if maybe is not None and maybe.done() and not maybe.cancelled() and maybe.exception() is None:
                    ack = maybe.result()
                    acks[i] = ack
                    if ack.duplicate:
                        self.duplicates += 1
                else:
                    if maybe is not None and maybe.done() and not maybe.cancelled():
                        failure = maybe.exception()
                        assert failure is not None
                        if not is_retryable(failure, idempotent=True):
                            raise failure  # every message carries its id: only what cannot succeed is not sent again
                        error = error or failure
                    failed.append(i)
            remaining = failed
            if remaining:
                self.retries += 1
                delay = backoff.next_delay()
                if delay is None:
                    raise TimeoutError(f"{len(remaining)} publishes not acknowledged before the deadline")
                logger.warning("publish not acknowledged, retrying", extra={"fields": {
                    "pending": len(remaining), "error": describe_error(error) if error else "timeout",
                    "refused": error is not None and is_too_many_requests(error)}})
                await anyio.sleep(delay)  # retry backoff through an outage or an overloaded server
        return [ack for ack in acks if ack is not None]


    async def _publish_fenced(self, items: Sequence[Outgoing], deadline: float | None) -> list[JsPubAck]:
        """A partition owner's outputs: each stream's in order, one acknowledged before the next is sent, the two
        streams side by side (`recovery.service.fence` says why)."""
        acks: list[JsPubAck | None] = [None] * len(items)
        streams: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            streams.setdefault(fenced_stream(item.subject), []).append(i)

        async def in_order(indices: list[int]) -> None:
            for i in indices:
                acks[i] = await self._publish_one_fenced(items[i], deadline)

        if len(streams) == 1:
            await in_order(next(iter(streams.values())))
        else:
            try:
                async with anyio.create_task_group() as group:
                    for indices in streams.values():
                        group.start_soon(in_order, indices)
            except BaseExceptionGroup as failed:  # callers handle `Fenced` and the publish errors, not a group
                fenced = [exc for exc in failed.exceptions if isinstance(exc, Fenced)]
                raise (fenced or list(failed.exceptions))[0] from failed
        return [ack for ack in acks if ack is not None]

    async def _publish_one_fenced(self, item: Outgoing, deadline: float | None) -> JsPubAck:
        budget = None if deadline is None else deadline - time.monotonic()
        backoff = Backoff(budget)
        # The leader's in-flight mark on the fence subject lasts one replicated write: come back within ms.
        busy = Backoff(budget, first=0.001, cap=0.05)
        while True:
            fence = self.fence
            assert fence is not None
            try:
                ack = await self.js.publish(item.subject, item.data, timeout=self.timeout,
                                            headers={MSG_ID: item.msg_id, **fence(item.subject)})
            except Exception as exc:
                reraise_cancel(exc)
                if is_fence_refusal(exc):
                    raise Fenced(f"{item.subject}: another owner claimed the partition") from exc
                if is_in_flight_refusal(exc):
                    delay = busy.next_delay()
                elif is_retryable(exc, idempotent=True):
                    self.retries += 1
                    delay = backoff.next_delay()
                    logger.warning("publish not acknowledged, retrying", extra={"fields": {
                        "pending": 1, "error": describe_error(exc), "refused": is_too_many_requests(exc)}})
                else:
                    raise  # every message carries its id: only what cannot succeed is not sent again
                if delay is None:
                    raise TimeoutError("a publish not acknowledged before the deadline") from exc
                await anyio.sleep(delay)  # retry backoff: an in-flight write, an outage or an overloaded server
                continue
            if ack.duplicate:
                self.duplicates += 1
            return ack


def reraise_cancel(exc: BaseException) -> None:
    """Raise a cancellation that nats-py turned into another error while the current task was being cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc

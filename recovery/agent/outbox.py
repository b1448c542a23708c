"""Events to JetStream in the order they happened, kept while NATS is away.

Training never waits for the control plane: `put` only appends to a bounded queue, and one task publishes from its
head, each event with its own id as `Nats-Msg-Id` (so a retry after a lost acknowledgement is stored once), taking
the next only when JetStream has acknowledged it. Past the capacity an event is dropped and counted: the oldest
heartbeat while one is waiting (the next heartbeat says the same, newer), else the oldest event. A process's exit, a
step or a checkpoint is what the engine decides from; a heartbeat only refreshes what the next one will refresh again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import anyio
from nats.js import JetStreamContext

from recovery.log.base import MSG_ID
from recovery.log.jetstream import Backoff, describe_error, publish_with_retry

logger = logging.getLogger("recovery.agent")

RETRY_FOR_S = 5.0
"""one publish's retries before the outbox logs the outage and starts over with the same event"""


@dataclass(frozen=True, slots=True)
class Pending:
    subject: str
    data: bytes
    msg_id: str
    heartbeat: bool = False


class Outbox:
    def __init__(self, js: JetStreamContext, capacity: int) -> None:
        self.js = js
        self.capacity = capacity
        self.queue: deque[Pending] = deque()
        self.dropped = 0
        self.published = 0
        self._heartbeats = 0  # heartbeats in the queue: none to look for when it is 0
        self._arrived = anyio.Event()

    def put(self, subject: str, data: bytes, msg_id: str, heartbeat: bool = False) -> None:
        if len(self.queue) >= self.capacity:
            self._drop_one()
        self.queue.append(Pending(subject, data, msg_id, heartbeat))
        self._heartbeats += heartbeat
        self._arrived.set()

    def _drop_one(self) -> None:
        """Make room: the oldest heartbeat but the head (being published now), else the oldest event."""
        self.dropped += 1
        if self._heartbeats:
            for index in range(1, len(self.queue)):
                if self.queue[index].heartbeat:
                    del self.queue[index]
                    self._heartbeats -= 1
                    return
        self._heartbeats -= self.queue.popleft().heartbeat

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            if not self.queue:
                self._arrived = anyio.Event()
                await self._arrived.wait()
                continue
            head = self.queue[0]
            try:
                await publish_with_retry(self.js, head.subject, head.data, {MSG_ID: head.msg_id},
                                         retry_for=RETRY_FOR_S)
            except Exception as exc:  # NATS away for longer than one publish's retries: keep the event, wait
                delay = backoff.next_delay() or 1.0
                logger.warning("events not published (%s): %d waiting, %d dropped", describe_error(exc),
                               len(self.queue), self.dropped)
                await anyio.sleep(delay)  # retry backoff through an outage
                continue
            backoff.reset()
            if self.queue and self.queue[0] is head:
                self._heartbeats -= self.queue.popleft().heartbeat
            self.published += 1

    async def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queue to empty (at shutdown)."""
        with anyio.move_on_after(timeout):
            while self.queue:
                await anyio.sleep(0.01)  # polling interval of a deadline-bounded wait
            return True
        return False

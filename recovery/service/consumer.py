"""What the daemon reads from JetStream: its durable input consumer (`InputReader`), in stream order and in batches,
and the ids of what is already stored (`scan_ids`), so that a restart does not publish an effect twice."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime

import anyio
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import subjects
from recovery.log import MSG_ID
from recovery.service.publisher import TRANSIENT

INPUTS = subjects.EVENTS


class ReaderLost(Exception):
    """The consumer stopped delivering in stream order (gap, redelivery ahead, stall, reconnect)."""


@dataclass(slots=True)
class Delivery:
    seq: int
    ts: int
    pending: int
    delivered: int
    subject: str
    headers: dict[str, str] | None
    data: bytes
    reply: str


def parse_reply(reply: str) -> tuple[int, int, int, int, int]:
    """(delivered count, stream seq, consumer seq, timestamp ns, pending) of a JetStream delivery."""
    t = reply.split(".")
    if len(t) == 9 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[4]), int(t[5]), int(t[6]), int(t[7]), int(t[8])
    if len(t) >= 11 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[6]), int(t[7]), int(t[8]), int(t[9]), int(t[10])
    raise ValueError(f"not a JetStream delivery reply subject: {reply!r}")


class InputReader:
    """A durable pull consumer over the input subjects, with pipelined pull requests on one inbox.

    It is (re)created at a given stream sequence: at start (the sequence after the restored snapshot) and
    whenever order cannot be guaranteed any more (a gap in the consumer sequence, a redelivery of a record not
    yet applied, a reconnect, a stall). Inputs are acknowledged (AckPolicy.ALL) only after their effects."""

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, durable: str, batch: int,
                 ack_wait_s: float, replicas: int, pull_expires_s: float = 2.0) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.durable = durable
        self.batch = batch
        self.ack_wait_s = ack_wait_s
        self.replicas = replicas
        self.pull_expires_s = pull_expires_s
        self.lag = 0
        self.caught_up = False
        self._sub: Subscription | None = None
        self._inbox = ""
        self._buffer: deque[Msg] = deque()
        self._arrived: anyio.Event | None = None  # set by the next delivery while the loop waits for one
        self._outstanding = 0
        self._cseq = 0
        self._activity = time.monotonic()

    async def open(self, start_seq: int) -> int:
        await self.close()
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(self.stream, self.durable)
        config = ConsumerConfig(
            durable_name=self.durable, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            ack_policy=AckPolicy.ALL, ack_wait=self.ack_wait_s, max_deliver=-1, filter_subject=INPUTS,
            max_ack_pending=max(4 * self.batch, 4096), num_replicas=self.replicas, max_waiting=512,
        )
        info = await self.js.add_consumer(self.stream, config=config)
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)
        self._buffer.clear()
        self._outstanding = 0
        self._cseq = 0
        self._activity = time.monotonic()
        self.lag = int(info.num_pending or 0)
        if self.lag == 0:
            self.caught_up = True
        await self._pull()
        return self.lag

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        self._buffer.append(msg)
        if self._arrived is not None:
            self._arrived.set()

    async def _pull(self) -> None:
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        request = orjson.dumps({"batch": self.batch, "expires": int(self.pull_expires_s * 1e9)})
        while self._outstanding < 2 * self.batch:
            await self.nc.publish(subject, request, reply=self._inbox)
            self._outstanding += self.batch

    async def next_batch(self, wait_s: float, last_applied: int) -> list[Delivery]:
        """Up to `batch` deliveries in stream order (none if nothing arrived within `wait_s`)."""
        if not self._buffer:
            self._arrived = arrived = anyio.Event()
            with anyio.move_on_after(wait_s):
                await arrived.wait()
            self._arrived = None
        out: list[Delivery] = []
        while self._buffer and len(out) < self.batch:
            msg = self._buffer.popleft()
            self._activity = time.monotonic()
            reply = msg.reply
            if not reply:
                self._status(msg)
                continue
            delivered, sseq, cseq, ts, pending = parse_reply(reply)
            if cseq <= self._cseq:
                continue  # a repeat of something already seen
            if cseq != self._cseq + 1:
                raise ReaderLost(f"gap in the consumer sequence: {self._cseq} then {cseq}")
            self._cseq = cseq
            self._outstanding = max(self._outstanding - 1, 0)
            self.lag = pending
            if pending == 0:
                self.caught_up = True
            if sseq <= last_applied or (out and sseq <= out[-1].seq):
                continue  # a redelivery of an input already applied (its ack was lost or late)
            if delivered > 1:
                raise ReaderLost(f"redelivery of {sseq}, ahead of the last applied {last_applied}")
            out.append(Delivery(sseq, ts, pending, delivered, msg.subject, msg.headers, msg.data, reply))
        if time.monotonic() - self._activity > 2 * self.pull_expires_s + 1:
            raise ReaderLost(f"no delivery or status for {2 * self.pull_expires_s + 1:.0f}s")
        await self._pull()
        return out

    def _status(self, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status", "")
        description = headers.get("Description", "")
        if status == "409" and "Consumer Deleted" in description:
            raise ReaderLost("consumer deleted")
        if status == "408" and "Nats-Pending-Messages" in headers:
            self._outstanding = max(self._outstanding - int(headers["Nats-Pending-Messages"]), 0)
        elif status in ("404", "408", "409"):
            self._outstanding = 0
        if status in ("404", "408") and not self._buffer and self.lag == 0:
            self.caught_up = True

    async def ack(self, delivery: Delivery) -> None:
        """Acknowledge this delivery and every one before it (AckPolicy.ALL)."""
        with contextlib.suppress(*TRANSIENT):
            await self.nc.publish(delivery.reply, b"+ACK")


async def scan_ids(nc: Client, js: JetStreamContext, stream: str, filters: list[str], start_seq: int,
                   start_time: datetime | None, batch: int = 4096, idle_s: float = 5.0) -> set[str]:
    """The `Nats-Msg-Id` of every message on `filters` in `stream` from `start_seq` (or `start_time`), read
    headers-only through an ephemeral consumer."""
    if start_time is None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(start_seq, 1))
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start_time)
    config.ack_policy = AckPolicy.NONE
    config.headers_only = True
    config.mem_storage = True
    config.num_replicas = 1
    config.inactive_threshold = 30.0
    if len(filters) == 1:
        config.filter_subject = filters[0]
    else:
        config.filter_subjects = filters
    info = await js.add_consumer(stream, config=config)
    name = info.name
    total = int(info.num_pending or 0)
    ids: set[str] = set()
    if total == 0:
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)
        return ids
    inbox = nc.new_inbox()
    send, receive = anyio.create_memory_object_stream[Msg](math.inf)

    async def on_msg(msg: Msg) -> None:
        send.send_nowait(msg)

    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        seen = 0
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"
        while seen < total:
            await nc.publish(subject, orjson.dumps({"batch": batch, "expires": int(idle_s * 1e9)}), reply=inbox)
            got = 0
            while got < batch and seen < total:
                with anyio.fail_after(idle_s + 1):
                    msg = await receive.receive()
                if not msg.reply:
                    break  # the pull expired or ended
                got += 1
                seen += 1
                msg_id = (msg.headers or {}).get(MSG_ID)
                if msg_id:
                    ids.add(msg_id)
            if got == 0:
                break
    finally:
        with anyio.move_on_after(2, shield=True):  # the ephemeral consumer goes away by itself if this cannot
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)
        send.close()
        receive.close()
    return ids


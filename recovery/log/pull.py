"""The one JetStream pull reader: a pull consumer read in stream order, in pipelined batches on one inbox.

Every reader of a stream goes through `PullReader`: `JetStreamLog.read` (an ephemeral, no-ack consumer over a
range of the log, for `recovery-replay --nats`, exports and the tests), the daemon's durable input consumer
(acknowledged after its effects) and its scan of the ids it already published. The caller chooses the consumer's
configuration (durable or ephemeral, ack policy, filter, headers only) and where it starts; the reader creates it,
keeps pull requests outstanding, reads JetStream's status messages, and checks order by the consumer sequence.

Whenever order cannot be guaranteed any more (a gap in the consumer sequence, a consumer deleted under it, a
reconnect, no delivery or status for longer than a pull may take) it raises `ReaderLost`, and the caller opens
it again at the sequence it needs: a caller that does so sees every message once, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass

import anyio
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.nuid import NUID

API_PREFIX = "$JS.API"

_NUID = NUID()


UNHEARD_PAUSE_S = 0.02
"""how long a reader waits before it asks again after a pull that reached no consumer"""


class ReaderLost(Exception):
    """The consumer stopped delivering in stream order (a gap, a deleted consumer, a reconnect, a stall, or, for
    the daemon, a redelivery ahead of what it applied): open the reader again where it is needed."""


@dataclass(slots=True)
class Delivery:
    """One message as the consumer delivered it, with the metadata of its reply subject."""

    seq: int
    """stream sequence"""
    ts: int
    """the stream's timestamp of the message, integer nanoseconds (exact: never through a float)"""
    pending: int
    """messages left for the consumer after this one"""
    delivered: int
    """how many times the consumer delivered it (1 unless it was redelivered after `ack_wait`)"""
    subject: str
    headers: dict[str, str] | None
    data: bytes
    reply: str
    """the `$JS.ACK...` subject an acknowledgement goes to"""


def parse_reply(reply: str) -> tuple[int, int, int, int, int]:
    """(delivered count, stream seq, consumer seq, timestamp ns, pending) from a JetStream delivery's reply
    subject: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (v1) or
    `$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]` (v2)."""
    t = reply.split(".")
    if len(t) == 9 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[4]), int(t[5]), int(t[6]), int(t[7]), int(t[8])
    if len(t) >= 11 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[6]), int(t[7]), int(t[8]), int(t[9]), int(t[10])
    raise ValueError(f"not a JetStream delivery reply subject: {reply!r}")


PENDING_BYTES_LIMIT = 64 * 1024 * 1024
"""what the inbox's subscription holds before the client drops deliveries as a slow consumer (nats-py's default)"""
DELIVERY_OVERHEAD = 4096
"""what a pull's byte bound counts of a delivery beside its stored headers and data (its subject, its reply, the
framing): a bound of `max_payload` alone would never deliver a message of the largest size the server takes"""
PULLS = 2
"""pull requests kept outstanding: the server sends the next while the caller works on the last"""


def pull_max_bytes(nc: Client) -> int:
    """The byte bound of one pull request, from the limit the server reports in its INFO (`max_payload`): the largest
    message it takes, and no more. nats-server cuts a client off as a slow consumer once more than its
    `max_pending` (64 MB by default) waits to be written to it, and it refuses to start with a `max_payload`
    above `max_pending`; what it does not report is `max_pending` itself. So the bytes asked for at once stay at
    `PULLS` of the largest message: under any `max_pending` of at least twice `max_payload` (a server configured
    with 4 MB and inputs of 1 MB, say), however slowly the caller reads, where pulls of a fixed 8 MiB were cut 29
    times in 25 s. Messages of a few hundred bytes fill a batch long before this bound."""
    return int(getattr(nc, "max_payload", 0) or 1024 * 1024) + DELIVERY_OVERHEAD


class PullReader:
    """A pull consumer of `stream` configured by `consumer`, read in stream order with up to two batches of pull
    requests outstanding on one inbox.

    `open(start_seq)` (re)creates the consumer at `start_seq`: a durable one of that name is deleted first,
    since a durable's start cannot move. `open()` creates it where `consumer`'s deliver policy says, or attaches
    to the durable of that name if it exists, which goes on after what it delivered and was acknowledged. An
    ephemeral consumer gets a fresh name and, unless `consumer` sets one, an inactivity threshold, so that one the
    reader could not delete goes away by itself. With `end_seq` the reader stops (`done`) after that stream
    sequence or once nothing is pending. `next_batch` raises `ReaderLost` when order is lost; `open` it again."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        stream: str,
        consumer: ConsumerConfig,
        *,
        batch: int = 1000,
        pull_expires_s: float = 2.0,
        end_seq: int | None = None,
        max_bytes: int | None = None,
        pending_bytes_limit: int = PENDING_BYTES_LIMIT,
        pulls: int = PULLS,
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.consumer = consumer
        self.batch = batch
        self.pull_expires_s = pull_expires_s
        self.end_seq = end_seq
        self.stall_s = 2 * pull_expires_s + 1
        """a healthy server answers every pull within its expiry, with messages or a status: silence longer than
        this means the consumer or its pull requests are gone"""
        self.name = ""
        self.start_seq = 0
        """the stream sequence the consumer was made at, by the last `open`"""
        self.lag = 0
        """messages still pending for the consumer after the last delivery (or at `open`)"""
        self.caught_up = False
        """the reader has reached the end of what its consumer matches at least once since it was made"""
        self.done = False
        """with `end_seq`: everything up to it was delivered (or nothing more is pending)"""
        # Bounded by bytes as well as by count (`pull_max_bytes`): 1,000 inputs of 1 MB each asked for at once are
        # more than the server holds for a client before it cuts it off as a slow consumer. Never below the largest
        # message the server takes, or one such message could never be delivered.
        self._max_bytes = max_bytes
        self.max_bytes = max(max_bytes or 0, pull_max_bytes(nc))
        self.pulls = pulls
        self.pending_bytes_limit = pending_bytes_limit
        self._request = self._pull_request(batch)
        self._next_subject = ""
        self._inbox = ""
        self._sub: Subscription | None = None
        self._ephemeral = ""  # the ephemeral consumer to delete at close
        self._buffer: deque[Msg] = deque()
        self._arrived: anyio.Event | None = None  # set by the next delivery while `next_batch` waits for one
        self._outstanding = 0  # messages asked for and not yet delivered
        self._unheard = False  # a pull reached no consumer (503): asked again after a pause, not waited out
        self._unheard_since: float | None = None  # the first of the 503s since the last delivery
        self._cseq = 0  # the last consumer sequence delivered
        self._highest = 0  # the highest stream sequence delivered
        self._reconnects = 0
        self._activity = time.monotonic()
        self._opened_lag = 0  # pending at `open`
        self._delivered_at = time.monotonic()  # the last delivery (or `begin`)
        self._log_end: int | None = None  # the log's last sequence when `_check_behind` last asked

    async def open(self, start_seq: int | None = None, *, pull: bool = True) -> int:
        """Create the consumer at `start_seq` (None: as `consumer` says, or the existing durable) and send the
        first pulls (`pull` False: made ahead, read from `begin`); the number of messages pending for it."""
        await self.close(wait=False)  # the last one's server may be gone: its removal is not waited for
        config = dataclasses.replace(self.consumer)
        if start_seq is not None:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = max(start_seq, 1)
        if config.durable_name:
            self.name = config.durable_name
            if start_seq is not None:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self.js.delete_consumer(self.stream, self.name)
        else:  # a new name each time (after the consumer's own name, if it has one): made where servers answer
            self.name = config.name = (f"{self.consumer.name}-" if self.consumer.name else "") + _NUID.next().decode()
            if config.inactive_threshold is None:
                config.inactive_threshold = max(self.stall_s, 5.0)
        self._reconnects = self.nc.stats["reconnects"]
        # Asked again at each open: a reconnect may have reached another server, with other limits.
        self.max_bytes = max(self._max_bytes or 0, pull_max_bytes(self.nc))
        self._request = self._pull_request(self.batch)
        inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(inbox, cb=self._on_msg, pending_bytes_limit=self.pending_bytes_limit)
        self._inbox = inbox
        info = await self.js.add_consumer(self.stream, config=config)
        self._ephemeral = "" if config.durable_name else self.name
        self._next_subject = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}"
        self._buffer.clear()
        self._outstanding = 0
        self._unheard_since = None
        # A new consumer has delivered nothing; an existing durable goes on after what it delivered.
        self._cseq = info.delivered.consumer_seq if info.delivered else 0
        start = (config.opt_start_seq or 1) - 1
        self.start_seq = start + 1
        self._highest = max(start, info.delivered.stream_seq if info.delivered else 0)
        self._opened_lag = int(info.num_pending or 0)
        self.done = False
        if pull:
            await self.begin()
        return self._opened_lag

    async def begin(self) -> None:
        """Start reading: the first pulls (`open` sends them, unless it made the consumer ahead)."""
        self._activity = self._delivered_at = time.monotonic()
        self._log_end = None
        self.lag = self._opened_lag
        if self.lag == 0:
            self.caught_up = True
            self.done = self.end_seq is not None
        if not self.done:
            await self._pull()

    async def close(self, *, wait: bool = True) -> None:
        """Stop reading; an ephemeral consumer is deleted (best effort; `wait` False: asked, not waited for, and its
        inactivity threshold removes it if that is lost), a durable one stays."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        name, self._ephemeral = self._ephemeral, ""
        if name and self.nc.is_connected and not wait:
            with contextlib.suppress(Exception):
                await self.nc.publish(f"{API_PREFIX}.CONSUMER.DELETE.{self.stream}.{name}", b"")
        elif name and self.nc.is_connected:
            # Shielded and bounded: it runs while its caller is being cancelled too, and the consumer's
            # inactivity threshold removes it anyway if this does not get through.
            with anyio.move_on_after(2, shield=True), contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, name)

    def wake(self) -> None:
        """End a wait in `next_batch` now (after a reconnect, so that it need not wait out its timeout)."""
        if self._arrived is not None:
            self._arrived.set()

    async def _on_msg(self, msg: Msg) -> None:
        self._buffer.append(msg)
        if self._arrived is not None:
            self._arrived.set()

    def _pull_request(self, count: int) -> bytes:
        return orjson.dumps({"batch": count, "expires": int(self.pull_expires_s * 1e9), "max_bytes": self.max_bytes})

    async def _pull(self) -> None:
        # `pulls` batches asked for keep the server sending while the caller works on one; with an end, never more
        # than the range still needs (it is contiguous unless filtered: a short count only means one more pull).
        limit = self.pulls * self.batch
        needed = math.inf if self.end_seq is None else self.end_seq - self._highest - self._outstanding
        while self._outstanding < limit and needed > 0:
            if needed >= self.batch:
                count, request = self.batch, self._request
            else:
                count = int(needed)
                request = self._pull_request(count)
            await self.nc.publish(self._next_subject, request, reply=self._inbox)
            self._outstanding += count
            needed -= count

    async def next_batch(self, wait_s: float) -> list[Delivery]:
        """Up to `batch` deliveries in stream order, waiting up to `wait_s` for the first; none if nothing came
        (or the reader is `done`). ReaderLost if order is lost."""
        if self.done:
            return []
        buffer = self._buffer
        if not buffer:
            self._arrived = arrived = anyio.Event()
            with anyio.move_on_after(wait_s):
                await arrived.wait()
            self._arrived = None
            if self.nc.stats["reconnects"] != self._reconnects:
                raise ReaderLost("reconnected: the pull requests (and a memory consumer) died with the connection")
            if not buffer and time.monotonic() - self._activity > self.stall_s:
                raise ReaderLost(f"no delivery or status for {self.stall_s:.0f}s")
        if buffer:
            self._activity = time.monotonic()
        out: list[Delivery] = []
        end = self.end_seq
        while buffer and len(out) < self.batch:
            msg = buffer.popleft()
            reply = msg.reply
            if not reply:
                self._status(msg)
                continue
            delivered, sseq, cseq, ts, pending = parse_reply(reply)
            if cseq <= self._cseq:
                if delivered == 1:  # a redelivery keeps its number and counts up: this one is a first delivery
                    # A replica-1 consumer lost with its server and made again from its assignment when that came
                    # back: numbered from 1 again, from where it was first made. Read on, it would be passed over
                    # as repeats, silently, for as long as it had delivered before.
                    raise ReaderLost(f"the consumer started over (delivery {cseq} after {self._cseq})")
                continue  # a repeat of something already seen
            if cseq != self._cseq + 1:
                raise ReaderLost(f"gap in the consumer sequence: {self._cseq} then {cseq}")
            self._cseq = cseq
            self._unheard_since = None
            self._outstanding = max(self._outstanding - 1, 0)
            self.lag = pending
            if end is not None and sseq > end:
                self.done = True
                break
            self._highest = sseq
            out.append(Delivery(sseq, ts, pending, delivered, msg.subject, msg.headers, msg.data, reply))
            if pending == 0:
                self.caught_up = True
                if end is not None:
                    self.done = True
                    break
            elif end is not None and sseq >= end:
                self.done = True
                break
        if out:
            self._delivered_at = time.monotonic()
        elif not self.done and time.monotonic() - self._delivered_at > self.stall_s:
            await self._check_behind()
        if not self.done:
            if self._unheard:
                self._unheard = False
                await anyio.sleep(UNHEARD_PAUSE_S)  # the consumer's interest on its way through the cluster
            await self._pull()
        return out

    async def _check_behind(self) -> None:
        """Nothing delivered for a stall while the server answers: ReaderLost if the consumer's server lags the log.
        A single-replica consumer reads its own server's copy of the stream, and one made on a server that came back
        moments ago serves what that copy holds, catching up for a minute or more: it answers every pull, empty.

        A reader of a range short of its end lags (the range is stored); an unfiltered one lags when a record the log
        held a stall ago has not come (the stream leader says where the log ends)."""
        self._delivered_at = time.monotonic()  # looked at once a stall
        if self.end_seq is not None:
            raise ReaderLost(f"nothing delivered for {self.stall_s:.0f}s short of {self.end_seq}, after "
                             f"{self._highest}: the consumer's server lags the log")
        if self.consumer.filter_subject or self.consumer.filter_subjects:
            return  # what the log holds past it need not be this consumer's
        ended, self._log_end = self._log_end, int((await self.js.stream_info(self.stream)).state.last_seq)
        if ended is not None and self._highest < ended:
            raise ReaderLost(f"the log held {ended} a stall ago and nothing after {self._highest} came: the "
                             f"consumer's server lags the log")

    def _status(self, msg: Msg) -> None:
        # A status message ends a pull request: 404/408 (no messages, expired) or 409 (limits, leadership change,
        # consumer deleted). Ask again, or start over if the consumer is gone.
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status == "409" and "Consumer Deleted" in headers.get("Description", ""):
            raise ReaderLost("consumer deleted")
        if status in ("408", "409") and "Nats-Pending-Messages" in headers:
            # An expired request, or one that reached its byte limit, says how much of it was left undelivered:
            # exactly what no longer comes.
            self._outstanding = max(self._outstanding - int(headers["Nats-Pending-Messages"]), 0)
        elif status in ("404", "408", "409"):
            self._outstanding = 0
        elif status == "503":
            # No responders: the pull reached no consumer. Right after a consumer is made on a cluster, its interest
            # may not have reached this client's server yet; the pull is lost, and would be waited out (`stall_s`).
            self._outstanding = 0
            self._unheard = True
            # Still none after a stall's time: the consumer is gone with its server (or removed), not on its way.
            now = time.monotonic()
            if self._unheard_since is None:
                self._unheard_since = now
            elif now - self._unheard_since > self.stall_s:
                raise ReaderLost(f"no consumer answered the pulls for {self.stall_s:.0f}s")
        if status in ("404", "408") and not self._buffer and self.lag == 0:
            self.caught_up = True

    async def ack(self, delivery: Delivery) -> None:
        """Acknowledge `delivery` (under AckPolicy.ALL, and every one before it too). Best effort: a lost ack only
        means a redelivery after `ack_wait`, which a caller that knows what it applied skips."""
        with contextlib.suppress(nats.errors.Error, OSError):
            await self.nc.publish(delivery.reply, b"+ACK")

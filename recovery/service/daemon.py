"""The daemon: the long-running I/O shell around the pure engine, on NATS JetStream (`recovery-daemon`,
`recovery.cli.daemon`, starts it with `run`).

The loop: pull the next batch of input records (`recovery.ev.>`) from a durable consumer, in stream order;
apply each to the engine; publish the effects (commands to `recovery.cmd.<job>.<kind>` in the command stream,
decisions and dead letters into the log), each with its deterministic id as `Nats-Msg-Id`; wait for JetStream
to acknowledge them all; only then acknowledge the inputs. Decisions and dead letters in the log are the
daemon's own output: the consumer's filter never delivers them, and the engine would ignore them anyway.

Crash safety. The engine state is snapshotted into a KV bucket (every `snapshot_every_records` inputs or
`snapshot_every_s` seconds, and at shutdown) together with the last input sequence it covers, only at a
batch boundary whose effects are all acknowledged. A restart restores the newest snapshot and applies the
inputs after it again: the decisions they make are the same, with the same ids. Before it starts, it reads
the ids already stored after the snapshot (decisions and dead letters in the log, commands in the command
stream since the snapshot's log time) and does not publish those again; anything else it republishes is
dropped by JetStream's duplicate window. So every input takes effect once and no command id is stored twice.

Timers. The engine's outstanding timers are part of its state; the timer service arms them (again, after a
restart) and publishes `timer.fired` for each when the wall clock reaches its due time, with the id
`timer:<timer id>:<due>` so that a re-fire after a crash is a duplicate. This is the only place wall time
enters: the engine sees the firing as an input record with the log's own timestamp.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import os
import secrets
import signal
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
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
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from events import subjects
from events.codec import encode_envelope
from events.commands import Command
from events.envelope import RawRecord, Record, make_envelope
from events.outputs import Decision
from recovery.core.addressing import command_nodes
from recovery.core.effects import apply_encoded
from recovery.core.engine import Effect, Engine
from recovery.log import MSG_ID, to_record
from recovery.log.jetstream import (
    ensure_stream,
    stream_config,
)
from recovery.log.snapshot import dump_snapshot, open_snapshot
from recovery.service import speedups
from recovery.service.config import DaemonConfig
from recovery.service.control import ControlService
from recovery.service.embedded import EmbeddedNats
from recovery.service.http import HttpServer, Metrics
from recovery.service.lease import Lease, LeaseLost, default_instance
from recovery.service.publisher import TRANSIENT, Outgoing, Publisher, reraise_cancel

logger = logging.getLogger("recovery.daemon")

INPUTS = subjects.EVENTS
CTL_PREFIX = f"{subjects.PREFIX}.ctl"
SNAPSHOT_FORMAT = 2  # of the KV layout (manifest and chunks); the engine's blob has its own
CLOCK_SKEW_MARGIN_NS = 120 * 1_000_000_000
"""commands are looked up from this long before the snapshot's log time (servers' clocks may differ)"""

def _fields(**kwargs: Any) -> dict[str, Any]:
    return {"fields": kwargs}


# -- the input consumer ---------------------------------------------------------------------------------
class Stopped(Exception):
    """A stop was requested before the daemon got going: not a failure."""


class ReaderLost(Exception):
    """The consumer stopped delivering in stream order (gap, redelivery ahead, stall, reconnect)."""


_RESET: tuple[type[BaseException], ...] = (ReaderLost, *TRANSIENT)


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
        self._arrived = asyncio.Event()
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
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._arrived.wait()
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


# -- snapshots ----------------------------------------------------------------------------------------------
class SnapshotStore:
    """Engine snapshots in a KV bucket: the value is split into chunks (a snapshot of thousands of jobs is
    far above NATS's max_payload) under `<partition>.<slot>.<n>`, then the manifest `<partition>` names the
    slot, the chunk count and their checksum. Snapshots alternate between slots `a` and `b` and the manifest is
    written last, so a crash mid-write leaves the previous snapshot intact and in force, and the bucket (one
    revision per key) stays bounded: two snapshots' chunks and a manifest."""

    def __init__(self, js: JetStreamContext, bucket: str, partition: str, chunk_bytes: int, replicas: int) -> None:
        self.js = js
        self.bucket = bucket
        self.partition = partition
        self.chunk_bytes = chunk_bytes
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def ensure(self) -> None:
        try:
            self._kv = await self.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            self._kv = await self.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, history=1, storage=StorageType.FILE, replicas=self.replicas,
                description="recovery-daemon engine snapshots"))

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "ensure() first"
        return self._kv

    async def manifest(self) -> dict[str, Any] | None:
        try:
            entry = await self.kv.get(self.partition)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            manifest: dict[str, Any] = orjson.loads(entry.value)
        except orjson.JSONDecodeError:
            return None
        return manifest if manifest.get("format") == SNAPSHOT_FORMAT else None

    async def load(self) -> tuple[bytes, dict[str, Any]] | None:
        manifest = await self.manifest()
        if manifest is None:
            return None
        try:
            return await self._load(manifest)
        except (KeyError, TypeError, ValueError, zlib.error) as exc:  # a damaged manifest: no snapshot, never a crash
            logger.warning("unreadable snapshot: ignoring it", extra=_fields(error=repr(exc)))
            return None

    async def _load(self, manifest: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
        parts = []
        for n in range(int(manifest["chunks"])):
            try:
                entry = await self.kv.get(f"{self.partition}.{manifest['slot']}.{n}")
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                logger.warning("snapshot chunk missing: ignoring the snapshot", extra=_fields(id=manifest["id"], n=n))
                return None
            parts.append(entry.value or b"")
        body = b"".join(parts)
        if hashlib.sha256(body).hexdigest() != manifest["sha256"]:
            logger.warning("snapshot checksum mismatch: ignoring the snapshot", extra=_fields(id=manifest["id"]))
            return None
        if manifest.get("compression") == "zlib":
            body = zlib.decompress(body)
        return body, manifest

    async def save(self, blob: bytes, seq: int, ts: int) -> dict[str, Any]:
        previous = await self.manifest()
        slot = "b" if previous is not None and previous.get("slot") == "a" else "a"
        body = await asyncio.to_thread(zlib.compress, blob, 1)
        chunks = [body[i:i + self.chunk_bytes] for i in range(0, len(body), self.chunk_bytes)] or [b""]
        for n, chunk in enumerate(chunks):
            await self.kv.put(f"{self.partition}.{slot}.{n}", chunk)
        manifest = {"format": SNAPSHOT_FORMAT, "id": f"{seq}-{secrets.token_hex(4)}", "slot": slot, "seq": seq,
                    "ts": ts, "chunks": len(chunks), "bytes": len(blob), "stored_bytes": len(body),
                    "compression": "zlib", "sha256": await asyncio.to_thread(_sha256, body),
                    "written_ns": time.time_ns(),
                    "pid": os.getpid()}
        await self.kv.put(self.partition, orjson.dumps(manifest))
        return manifest


# -- timers -------------------------------------------------------------------------------------------------
class ServerClock:
    """The NATS server's clock, as seen from here: the local clock plus an offset estimated from the log's own
    timestamps. A timer's due time is server time (the log time of the decision that asked for it); firing it on
    a local clock that runs 5 s fast would confirm a link debounce 5 s early. Each live delivery gives
    `server_ts - local_now` = skew - transit; the largest in a recent window has the least transit in it. Only
    deliveries read once caught up count: a replayed backlog's timestamps are old, not skewed."""

    LIMIT_NS = 60 * 1_000_000_000
    """offsets are clamped to this: a larger skew is a misconfigured host, and a backlog delivered after an
    outage must not hold every timer back by its age"""

    def __init__(self, window: int = 512, local: Callable[[], int] = time.time_ns) -> None:
        self._samples: deque[int] = deque(maxlen=window)
        self._local = local
        self._best: int | None = None
        self.offset_ns = 0

    def observe(self, server_ts: int) -> None:
        samples = self._samples
        dropped = samples[0] if len(samples) == samples.maxlen else None
        sample = server_ts - self._local()
        samples.append(sample)
        if self._best is None or sample >= self._best:
            self._best = sample
        elif dropped == self._best:
            self._best = max(samples)  # the largest sample left the window: look again
        self.offset_ns = max(-self.LIMIT_NS, min(self.LIMIT_NS, self._best))

    def __call__(self) -> int:
        return self._local() + self.offset_ns


class TimerService:
    """Fires the engine's timers on the wall clock. Armed from the decisions' timer requests, from the engine's
    outstanding timers at start, and again after each firing of a periodic timer; the engine's own table is the
    truth at firing time (a cancelled or already moved timer is not fired)."""

    def __init__(self, engine: Callable[[], Engine], fire: Callable[[list[tuple[str, str, int]]], Awaitable[None]],
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._engine = engine
        self._fire = fire
        self._clock = clock
        self._heap: list[tuple[int, str]] = []
        self._armed: dict[str, int] = {}
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._armed)

    def arm(self, timer_id: str, due: int) -> None:
        if self._armed.get(timer_id) == due:
            return
        self._armed[timer_id] = due
        heapq.heappush(self._heap, (due, timer_id))
        if self._heap[0][1] == timer_id:
            self._wake.set()

    def cancel(self, timer_id: str) -> None:
        self._armed.pop(timer_id, None)

    def arm_all(self, engine: Engine) -> int:
        for timer_id, (_job, due, _every) in engine.timers.items():
            self.arm(timer_id, due)
        return len(engine.timers)

    def describe(self) -> dict[str, object]:
        return {"armed": len(self._armed), "heap": len(self._heap),
                "next_due": self._heap[0][0] if self._heap else None}

    def due(self, now: int) -> list[tuple[str, str, int]]:
        out = []
        timers = self._engine().timers
        while self._heap and self._heap[0][0] <= now:
            due, timer_id = heapq.heappop(self._heap)
            if self._armed.get(timer_id) != due:
                continue  # re-armed or cancelled since
            del self._armed[timer_id]
            entry = timers.get(timer_id)
            if entry is None or entry[1] != due:
                continue  # cancelled, or the engine has moved it (it is armed at its new due)
            out.append((timer_id, entry[0], due))
        return out

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = self._clock()
            fired = self.due(now)
            if fired:
                await self._fire(fired)
                continue
            wait = 1.0 if not self._heap else min(max((self._heap[0][0] - now) / 1e9, 0.0), 1.0)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()


# -- the daemon ---------------------------------------------------------------------------------------------
class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.engine = Engine()
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.embedded: Any = None
        self.url = cfg.nats_url
        self.publisher: Publisher | None = None
        self.reader: InputReader | None = None
        self.snapshots: SnapshotStore | None = None
        self.server_clock = ServerClock()
        self.timers = TimerService(lambda: self.engine, self._fire_timers, self.server_clock)
        self.lease: Lease | None = None
        self.role = "starting"  # standby (waiting for the lease), active, or deposed (lost it)
        self.http: HttpServer | None = None
        self.http_port: int | None = None
        self.control: Any = None
        self.started_at = time.monotonic()
        self.connected = False
        self.restored_seq = 0
        self.replayed = -1  # set when the consumer first opens
        self.clean_seq = 0  # last input whose effects are all acknowledged: what a snapshot may cover
        self.last_ts = 0  # log time of that input
        self.snapshot_seq = 0
        self.snapshot_written: float | None = None
        self.snapshot_manifest: dict[str, Any] | None = None
        self.records_since_snapshot = 0
        self.skip_ids: set[str] = set()
        self.recent: OrderedDict[int, list[Effect]] = OrderedDict()
        self.listeners: list[Callable[[Record | RawRecord, list[Effect]], None]] = []
        self._stop = asyncio.Event()
        self._applied = asyncio.Condition()
        self._tasks: list[asyncio.Task[Any]] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._reader_ok = False
        self._caught_up_logged = False
        self._start_wall = time.monotonic()
        self.failed = False

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, set up streams and bucket, restore, and start processing; returns once processing runs."""
        cfg = self.cfg
        if cfg.http_port >= 0:
            self.http = HttpServer(cfg.http_host, cfg.http_port, self.metrics, self.readiness,
                                   self._refresh_gauges, self.status)
            self.http_port = await self.http.start()
            logger.info("http listening", extra=_fields(host=cfg.http_host, port=self.http_port))
        if not self.url:
            self.embedded = EmbeddedNats(cfg.data_dir, port=cfg.embedded_port)
            await asyncio.to_thread(self.embedded.start)
            self.url = self.embedded.url
        await self._connect()
        assert self.nc is not None and self.js is not None
        await self._ensure_streams()
        if cfg.lease_ttl_s > 0:
            self.lease = Lease(self.js, cfg.lease_bucket, cfg.partition,
                               cfg.instance or default_instance(cfg.data_dir), cfg.lease_ttl_s, cfg.replicas)
            await self._retry(self.lease.ensure, "lease bucket")
            self.role = "standby"
            if not await self._retry(lambda: self.lease.acquire(self._stop), "lease"):  # type: ignore[union-attr]
                return  # stopped while standing by
            logger.info("lease acquired: active", extra=_fields(partition=cfg.partition,
                                                                 instance=self.lease.instance))
            lease_task = asyncio.create_task(self._keep_lease(), name="recovery-lease")
            lease_task.add_done_callback(self._loop_ended)
            self._tasks.append(lease_task)
        self.role = "active"
        await self._restore()
        self.reader = InputReader(self.nc, self.js, cfg.stream, cfg.consumer, cfg.batch_size, cfg.ack_wait_s,
                                  cfg.replicas)
        if cfg.timers_enabled:
            armed = self.timers.arm_all(self.engine)
            logger.info("timers re-armed", extra=_fields(timers=armed))
        if cfg.ctl_enabled:
            self.control = ControlService(self)
            await self.control.start(self.nc)
        self._loop_task = asyncio.create_task(self._run(), name="recovery-loop")
        self._loop_task.add_done_callback(self._loop_ended)
        if cfg.timers_enabled:
            timers = asyncio.create_task(self.timers.run(self._stop), name="recovery-timers")
            timers.add_done_callback(self._loop_ended)
            self._tasks.append(timers)

    async def _keep_lease(self) -> None:
        """Renew the lease every third of its TTL; a lost lease stops the daemon (its supervisor starts it
        again, as a standby)."""
        assert self.lease is not None
        period = self.lease.ttl_s / 3
        while not self._stop.is_set():
            try:
                async with asyncio.timeout(period):
                    await self._stop.wait()
                return
            except TimeoutError:
                pass
            try:
                await self.lease.renew()
            except LeaseLost as exc:
                self.role = "deposed"
                logger.error("lease lost: stopping", extra=_fields(reason=str(exc)))
                self.failed = True
                self._stop.set()
                return
            except TRANSIENT as exc:
                reraise_cancel(exc)
                logger.warning("lease not renewed: retrying", extra=_fields(error=repr(exc)))

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self._stop.is_set():
            logger.error(f"{task.get_name()} failed: stopping", exc_info=task.exception())
            self.failed = True
            self._stop.set()

    async def _connect(self) -> None:
        servers = [s.strip() for s in self.url.split(",") if s.strip()]
        delay = 0.1
        while True:
            try:
                self.nc = await nats.connect(
                    servers, name=f"recovery-daemon-{os.getpid()}", max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25, connect_timeout=2, allow_reconnect=True, ping_interval=5,
                    max_outstanding_pings=2, pending_size=64 * 1024 * 1024,
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                )
                break
            except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
                if self._stop.is_set():
                    raise Stopped("stopped before NATS was reachable") from exc
                logger.warning("cannot reach NATS yet, retrying", extra=_fields(url=self.url, error=repr(exc)))
                await asyncio.sleep(delay)  # connect retry backoff
                delay = min(delay * 2, 2.0)
        self.connected = True
        self.js = self.nc.jetstream(timeout=5.0, publish_async_max_pending=20_000)
        self.publisher = Publisher(self.js)
        logger.info("connected", extra=_fields(url=self.nc.connected_url.netloc if self.nc.connected_url else self.url))

    async def _on_disconnected(self) -> None:
        if self.connected and not self._stop.is_set():
            logger.warning("disconnected from NATS")
        self.connected = False
        self._reader_ok = False

    async def _on_reconnected(self) -> None:
        self.connected = True
        self._reader_ok = False  # pull requests died with the connection: re-create the consumer
        self.metrics.reconnects.inc()
        logger.info("reconnected to NATS", extra=_fields(
            url=self.nc.connected_url.netloc if self.nc and self.nc.connected_url else "?"))

    async def _on_error(self, exc: Exception) -> None:
        logger.debug("nats error", extra=_fields(error=repr(exc)))

    async def _ensure_streams(self) -> None:
        assert self.js is not None
        cfg = self.cfg
        await self._retry(lambda: ensure_stream(self.js, stream_config(  # type: ignore[arg-type]
            cfg.stream, None, cfg.duplicate_window_s, cfg.replicas)), "log stream")
        commands = StreamConfig(
            name=cfg.command_stream, subjects=[subjects.COMMANDS], retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE, max_age=cfg.command_max_age_s, duplicate_window=cfg.duplicate_window_s,
            num_replicas=cfg.replicas, discard=DiscardPolicy.OLD,
        )
        await self._retry(lambda: ensure_stream(self.js, commands), "command stream")  # type: ignore[arg-type]
        self.snapshots = SnapshotStore(self.js, cfg.snapshot_bucket, cfg.partition, cfg.snapshot_chunk_bytes,
                                       cfg.replicas)
        await self._retry(self.snapshots.ensure, "snapshot bucket")

    async def _retry(self, op: Callable[[], Awaitable[Any]], what: str, limit_s: float = float("inf")) -> Any:
        deadline = time.monotonic() + limit_s
        delay = 0.05
        while True:
            try:
                return await op()
            except TRANSIENT as exc:
                reraise_cancel(exc)
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                logger.warning(f"{what}: retrying", extra=_fields(error=repr(exc)))
                await asyncio.sleep(delay)  # retry backoff through an outage
                delay = min(delay * 2, 1.0)

    async def _restore(self) -> None:
        assert self.snapshots is not None
        t0 = time.monotonic()
        loaded = await self._retry(self.snapshots.load, "snapshot load")
        engine = None
        if loaded is not None:
            blob, manifest = loaded
            try:
                opened = open_snapshot(blob)
            except Exception as exc:  # classes changed under the same version: replay instead of crashing
                opened = f"{type(exc).__name__}: {exc}"
            engine = opened if isinstance(opened, Engine) else None
            if engine is None:
                logger.warning("snapshot not restored: replaying the whole log",
                               extra=_fields(seq=manifest.get("seq"), reason=opened))
            else:
                self.engine = engine
                self.restored_seq = self.snapshot_seq = self.clean_seq = engine.last_seq
                self.last_ts = int(manifest.get("ts", 0))
                self.snapshot_manifest = manifest
                self.snapshot_written = time.monotonic() - max(0.0, (time.time_ns() - int(
                    manifest.get("written_ns", time.time_ns()))) / 1e9)
                self.metrics.snapshot_seq.set(engine.last_seq)
                self.metrics.snapshot_bytes.set(int(manifest.get("bytes", 0)))
        self.metrics.restored_seq.set(self.restored_seq)
        self.skip_ids = await self._retry(lambda: self._published_after(self.restored_seq, self.last_ts),
                                          "published-id scan")
        logger.info("restored", extra=_fields(
            snapshot_seq=self.restored_seq, jobs=len(self.engine.jobs), timers=len(self.engine.timers),
            already_published=len(self.skip_ids), seconds=round(time.monotonic() - t0, 3)))

    async def _published_after(self, seq: int, ts: int) -> set[str]:
        """Ids of outputs stored after the snapshot: decisions and dead letters in the log after `seq`,
        commands in the command stream since the snapshot's log time. Not published again."""
        assert self.js is not None and self.nc is not None
        ids: set[str] = set()
        start_cmd = None if seq == 0 else datetime.fromtimestamp(max(ts - CLOCK_SKEW_MARGIN_NS, 0) / 1e9, tz=UTC)
        scans = [(self.cfg.stream, [subjects.DECISIONS, subjects.DEAD_LETTERS], seq + 1, None),
                 (self.cfg.command_stream, [subjects.COMMANDS], 1, start_cmd)]
        for stream, filters, start_seq, start_time in scans:
            ids.update(await scan_ids(self.nc, self.js, stream, filters, start_seq, start_time))
        return ids

    def request_stop(self) -> None:
        if not self._stop.is_set():
            logger.info("stopping")
            self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def quiesce(self, timeout: float = 2.0) -> None:
        """Stop taking input after the batch under way (its effects published); connections stay open."""
        self._stop.set()
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=timeout)

    async def stop(self) -> None:
        """Finish the batch, snapshot, drain: within `shutdown_timeout_s` whatever NATS does."""
        self._stop.set()
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        budget = max(self.cfg.shutdown_timeout_s - 1.5, 0.5)
        if self._loop_task is not None and not self._loop_task.done():
            try:
                async with asyncio.timeout(budget * 0.5):
                    await asyncio.shield(self._loop_task)
            except TimeoutError:
                logger.warning("batch not finished in time: it is applied again at the next start")
                self._loop_task.cancel()
                await asyncio.wait([self._loop_task], timeout=0.5)
            except Exception:
                logger.exception("processing loop failed")
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=0.5)
        if self.control is not None:
            with contextlib.suppress(Exception):
                await self.control.close()
        try:
            remaining = max(deadline - time.monotonic() - 1.0, 0.1)
            async with asyncio.timeout(remaining):
                if self._snapshot_task is not None:
                    await self._snapshot_task
                await self._snapshot(final=True)
                if self._snapshot_task is not None:
                    await self._snapshot_task
        except TimeoutError:
            logger.warning("final snapshot not written in time: the next start replays a longer tail")
        except Exception:
            logger.exception("final snapshot failed")
        if self.reader is not None:
            await self.reader.close()
        if self.lease is not None and self.role == "active":
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(deadline - time.monotonic() - 0.5, 0.1)):
                    await self.lease.release()  # the standby takes over now, not a TTL later
                    logger.info("lease released")
        if self.nc is not None and not self.nc.is_closed:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic() - 0.5, 0.1)):
                    await self.nc.drain()
            except Exception:
                with contextlib.suppress(Exception):
                    await self.nc.close()
        if self.http is not None:
            await self.http.close()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop, max(deadline - time.monotonic(), 1.0))
        logger.info("stopped", extra=_fields(last_seq=self.engine.last_seq, snapshot_seq=self.snapshot_seq))

    # -- processing ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self.reader is not None
        delay = 0.05
        while not self._stop.is_set():
            if self.lease is not None and not self.lease.fresh():
                await asyncio.sleep(0.05)  # not renewed lately (NATS away?): read nothing another daemon may read
                continue
            try:
                if not self._reader_ok:
                    if not self.connected:
                        await asyncio.sleep(0.05)  # waiting for the reconnect the client does by itself
                        continue
                    pending = await self.reader.open(self.engine.last_seq + 1)
                    self._reader_ok = True
                    if self.replayed < 0:
                        self.replayed = pending  # inputs after the restored snapshot: the tail to replay
                    logger.info("consumer at sequence", extra=_fields(start=self.engine.last_seq + 1, pending=pending))
                    self._check_caught_up()
                batch = await self.reader.next_batch(0.2, self.engine.last_seq)
                delay = 0.05
            except _RESET as exc:
                reraise_cancel(exc)
                self._reader_ok = False
                self.metrics.consumer_resets.inc()
                logger.warning("consumer reset", extra=_fields(reason=repr(exc), at=self.engine.last_seq + 1))
                await asyncio.sleep(delay)  # retry backoff through an outage
                delay = min(delay * 2, 1.0)
                continue
            if batch:
                await self._process(batch)
            self._check_caught_up()
            await self._maybe_snapshot()

    def _check_caught_up(self) -> None:
        if self.reader is not None and self.reader.caught_up and not self._caught_up_logged:
            self._caught_up_logged = True
            self.metrics.replayed.set(self.replayed)
            logger.info("caught up", extra=_fields(
                restored_snapshot_seq=self.restored_seq, replayed_records=self.replayed,
                last_seq=self.engine.last_seq, seconds=round(time.monotonic() - self._start_wall, 3)))
        self.metrics.ready.set(1 if self.readiness()[0] else 0)

    async def _process(self, batch: list[Delivery]) -> None:
        engine = self.engine
        out: list[Outgoing] = []
        types: Counter[str] = Counter()
        decisions: Counter[str] = Counter()
        rejections: Counter[str] = Counter()
        commands: Counter[str] = Counter()
        timed: list[int] = []
        applied = 0
        last: Delivery | None = None
        live = self.reader is not None and self.reader.caught_up
        for d in batch:
            last = d
            if live:
                self.server_clock.observe(d.ts)
            if d.seq <= engine.last_seq:
                continue
            record = to_record(d.seq, d.ts, d.subject, d.headers or {}, d.data)
            encoded = apply_encoded(engine, record)  # a record whose effects cannot be written is revoked
            effects = [effect for effect, _, _, _ in encoded]
            applied += 1
            is_record = isinstance(record, Record)
            types[record.envelope.type if is_record else "undecodable"] += 1  # type: ignore[union-attr]
            if effects:
                timed.append(d.ts)
                for effect, subject, envelope, data in encoded:
                    if isinstance(effect, Decision):
                        decisions[effect.kind] += 1
                        for command in effect.commands:
                            commands[command.kind] += 1
                            out.extend(o for o in addressed(engine, command) if o.msg_id not in self.skip_ids)
                        if self.cfg.timers_enabled:
                            for timer_id in effect.cancelled_timers:
                                self.timers.cancel(timer_id)
                            for timer in effect.timers:
                                self.timers.arm(timer.id, timer.due)
                    else:
                        rejections[effect.code] += 1
                        logger.info("rejected", extra=_fields(seq=effect.seq, subject=effect.subject, code=effect.code,
                                                              reason=effect.reason, event_id=effect.event_id))
                    if envelope.id not in self.skip_ids:
                        out.append(Outgoing(subject, data, envelope.id,
                                            "decision" if isinstance(effect, Decision) else "rejection"))
            if is_record and self.cfg.timers_enabled and record.envelope.type == "timer.fired":  # type: ignore[union-attr]
                timer_id = record.envelope.data.timer_id  # type: ignore[union-attr]
                entry = engine.timers.get(timer_id)
                if entry is not None:
                    self.timers.arm(timer_id, entry[1])  # a periodic timer moved to its next due time
            if is_record and record.envelope.source == "recovery-ctl":  # type: ignore[union-attr]
                self.recent[d.seq] = effects
                while len(self.recent) > 1024:
                    self.recent.popitem(last=False)
            for listener in self.listeners:
                listener(record, effects)
        if out:
            assert self.publisher is not None
            await self.publisher.publish(out)
            if self.skip_ids:
                self.skip_ids.difference_update(o.msg_id for o in out)
        if last is not None and self.reader is not None:
            await self.reader.ack(last)
        self.clean_seq = engine.last_seq
        if last is not None:
            self.last_ts = max(self.last_ts, last.ts)
        self.records_since_snapshot += applied
        now = time.time_ns()
        for ts in timed:
            self.metrics.latency.observe(max(now - ts, 0) / 1e9)
        m = self.metrics
        for key, n in types.items():
            m.events.labels(key).inc(n)
        for key, n in decisions.items():
            m.decisions.labels(key).inc(n)
        for key, n in rejections.items():
            m.rejections.labels(key).inc(n)
        for key, n in commands.items():
            m.commands.labels(key).inc(n)
        m.batch_size.observe(applied)
        m.last_seq.set(engine.last_seq)
        if self.reader is not None:
            m.consumer_lag.set(self.reader.lag)
        async with self._applied:
            self._applied.notify_all()

    async def wait_applied(self, seq: int, timeout: float) -> bool:
        async with asyncio.timeout(timeout), self._applied:
            await self._applied.wait_for(lambda: self.clean_seq >= seq)
        return True

    async def _fire_timers(self, fired: list[tuple[str, str, int]]) -> None:
        assert self.publisher is not None
        out = []
        for timer_id, job, due in fired:
            ident = f"timer:{timer_id}:{due}"
            try:
                envelope = make_envelope("timer.fired", {"timer_id": timer_id, "due": due}, id=ident, job=job,
                                         source="recovery-daemon/timers")
            except ValueError:  # pydantic's ValidationError: an id the envelope cannot carry; never fires
                logger.exception("cannot fire timer", extra=_fields(timer_id=timer_id, job=job))
                continue
            out.append(Outgoing(subjects.job_event(job, "timer.fired"), encode_envelope(envelope), ident, "timer"))
        try:
            await self.publisher.publish(out, deadline=time.monotonic() + 30)
        except TimeoutError:
            for timer_id, _job, due in fired:
                self.timers.arm(timer_id, due)  # try again: the id makes a repeat harmless
            return
        self.metrics.timers_fired.inc(len(out))

    # -- snapshots ----------------------------------------------------------------------------------------
    async def _maybe_snapshot(self) -> None:
        if self.records_since_snapshot == 0 or self.clean_seq <= self.snapshot_seq:
            return
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return
        age = time.monotonic() - (self.snapshot_written or self._start_wall)
        if self.records_since_snapshot >= self.cfg.snapshot_every_records or age >= self.cfg.snapshot_every_s:
            await self._snapshot(final=False)

    async def _snapshot(self, final: bool) -> None:
        """Capture the state now (between two batches, every effect acknowledged) and upload it in the
        background (awaited when final). Pickling thousands of jobs takes tens of milliseconds or more, so a
        running daemon pickles in a forked child (copy-on-write: the state as of the fork) while the loop
        goes on deciding; the final snapshot, and platforms without fork, pickle in the loop."""
        engine = self.engine
        if self.snapshots is None or self.clean_seq != engine.last_seq or engine.last_seq <= self.snapshot_seq:
            return
        if self.role != "active":
            return  # a standby has nothing to save; a deposed daemon leaves the snapshots to the active one
        t0 = time.monotonic()
        seq, ts = engine.last_seq, self.last_ts
        self.records_since_snapshot = 0
        child: tuple[int, int] | None = None
        blob = b""
        if not final and self.cfg.snapshot_fork and hasattr(os, "fork"):
            try:
                child = _fork_dump(engine)
            except OSError:
                logger.warning("fork failed: snapshot pickled in the loop", exc_info=True)
        if child is None:
            blob = dump_snapshot(engine)
        captured = time.monotonic() - t0

        async def upload() -> None:
            assert self.snapshots is not None
            data = blob
            try:
                if child is not None:
                    data = await asyncio.to_thread(_collect_dump, *child)
                manifest = await self._retry(lambda: self.snapshots.save(data, seq, ts), "snapshot")  # type: ignore[union-attr]
            except Exception:
                logger.exception("snapshot failed")
                return
            self.snapshot_seq = max(self.snapshot_seq, seq)
            self.snapshot_written = time.monotonic()
            self.snapshot_manifest = manifest
            self.metrics.snapshots.inc()
            self.metrics.snapshot_seq.set(seq)
            self.metrics.snapshot_bytes.set(len(data))
            logger.info("snapshot written", extra=_fields(
                seq=seq, bytes=len(data), stored_bytes=manifest["stored_bytes"], chunks=manifest["chunks"],
                forked=child is not None, loop_blocked_s=round(captured, 4), total_s=round(time.monotonic() - t0, 3),
                final=final))

        self._snapshot_task = asyncio.create_task(upload(), name="recovery-snapshot")
        if final:
            await self._snapshot_task

    # -- views --------------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, object]]:
        caught_up = bool(self.reader is not None and self.reader.caught_up and self._caught_up_logged)
        ok = self.connected and self._reader_ok and caught_up and not self._stop.is_set() and self.role == "active"
        return ok, {"role": self.role, "connected": self.connected, "consumer": self._reader_ok, "caught_up": caught_up,
                    "stopping": self._stop.is_set(), "last_seq": self.engine.last_seq,
                    "lag": self.reader.lag if self.reader else None}

    def _refresh_gauges(self) -> None:
        m = self.metrics
        states: Counter[str] = Counter()
        incidents = 0
        for job in self.engine.jobs.values():
            states[job.state] += 1
            incidents += job.incident is not None
        for state, n in states.items():
            m.jobs.labels(state).set(n)
        m.open_incidents.set(incidents)
        m.timers_armed.set(len(self.engine.timers))
        m.active.set(1 if self.role == "active" else 0)
        m.clock_offset.set(self.server_clock.offset_ns / 1e9)
        if self.snapshot_written is not None:
            m.snapshot_age.set(time.monotonic() - self.snapshot_written)
        m.ready.set(1 if self.readiness()[0] else 0)
        if self.reader is not None:
            m.consumer_lag.set(self.reader.lag)

    async def status(self) -> dict[str, object]:
        ok, why = self.readiness()
        return {"ready": ok, **why, "published_seq": self.clean_seq, "url": self.url, "jobs": len(self.engine.jobs),
                "open_incidents": sum(1 for j in self.engine.jobs.values() if j.incident is not None),
                "timers": len(self.engine.timers), "snapshot_seq": self.snapshot_seq,
                "restored_snapshot_seq": self.restored_seq, "replayed_records": self.replayed,
                "snapshot_age_s": None if self.snapshot_written is None else round(
                    time.monotonic() - self.snapshot_written, 3),
                "uptime_s": round(time.monotonic() - self.started_at, 3), "http_port": self.http_port,
                "timer_service": self.timers.describe(),
                "server_clock_offset_s": round(self.server_clock.offset_ns / 1e9, 6),
                "publish_retries": self.publisher.retries if self.publisher else 0,
                "duplicates_dropped": self.publisher.duplicates if self.publisher else 0}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fork_dump(engine: Engine) -> tuple[int, int]:
    """Fork a child that writes `dump_snapshot(engine)` to a pipe and exits; (pid, read end of the pipe)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: pickle, write, leave without running any cleanup of the parent's
        code = 1
        try:
            os.close(read_fd)
            data = dump_snapshot(engine)
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, read_fd


def _collect_dump(pid: int, read_fd: int) -> bytes:
    """The child's snapshot bytes (blocking: run in a thread), once it has exited cleanly."""
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(1 << 20):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"snapshot child exited with status {status}")
    return b"".join(chunks)


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
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await queue.put(msg)

    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        seen = 0
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"
        while seen < total:
            await nc.publish(subject, orjson.dumps({"batch": batch, "expires": int(idle_s * 1e9)}), reply=inbox)
            got = 0
            while got < batch and seen < total:
                async with asyncio.timeout(idle_s + 1):
                    msg = await queue.get()
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
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)
    return ids


async def run(cfg: DaemonConfig, on_started: Callable[[Daemon], Awaitable[None]] | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT (or `duration_s`); 0 on a clean stop."""
    tuned = speedups.apply()
    daemon = Daemon(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, daemon.request_stop)
    code = 0
    try:
        await daemon.start()
        speedups.freeze()  # the restored state is long-lived: keep it out of later collections
        logger.info("tuned", extra=_fields(applied=tuned))
        if on_started is not None:
            await on_started(daemon)
        if cfg.duration_s is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.duration_s):
                    await daemon.wait()
        else:
            await daemon.wait()
    except Stopped as exc:
        logger.info(str(exc))
    except Exception:
        logger.exception("daemon failed")
        code = 1
    finally:
        await daemon.stop()
    return 1 if daemon.failed else code


def addressed(engine: Engine, command: Command) -> list[Outgoing]:
    """One copy of `command` per node it concerns, on that node's command subject, each with its own message id."""
    job = engine.jobs.get(command.job)
    job_nodes = job.nodes if job is not None else []

    def node_of(rank: int) -> str:
        if job is None or not 0 <= rank // job.rpn < len(job.nodes):
            return ""
        return job.node_of(rank)

    data = orjson.dumps(command.model_dump(mode="json"))
    nodes = [node for node in command_nodes(command, node_of, job_nodes) if node]
    if not nodes:
        logger.warning("command concerns no node", extra=_fields(command=command.id, kind=command.kind))
    return [Outgoing(subjects.command(node, command.job, command.kind), data,
                     subjects.command_msg_id(command.id, node), "command") for node in nodes]

"""The daemon: the long-running I/O shell around the pure engine, on NATS JetStream (`recovery-daemon`,
`recovery.cli.daemon`, starts it with `run`).

It is wiring. Its parts are tasks of one anyio task group, each in a cancel scope of its own:

- `http`: `/healthz`, `/readyz`, `/metrics`, `/status` (`recovery.service.http`), from the start, so that a
  standby answers too;
- `lease`: renews the partition's lease (`recovery.service.lease`) on a connection of its own
  (`recovery.service.tenure`), when there is one;
- `processor`: pulls the next batch of input records (`recovery.ev.>`) from a durable consumer in stream order
  (`recovery.service.consumer`), has the processor (`recovery.service.processor`: batch in, messages out) apply
  it, publishes the messages (each with its deterministic id as `Nats-Msg-Id`), waits for JetStream to
  acknowledge them all, and only then acknowledges the inputs;
- `timers`: the timer service (`recovery.service.timers`), which fires the engine's timers from the processor's
  timer table as `timer.fired` events on the server's clock, once the engine caught up with the log and after the
  record of an outage of the daemon's own connection (`recovery.service.outage`); beside it `liveness`, the monitor
  of the nodes' live beats and of the ranks' reports it summarizes (`recovery.service.liveness`, `.summaries`);
- `snapshots`: uploads the snapshots captured between two batches into the KV bucket
  (`recovery.service.snapshots`);
- `control`: the `recovery-ctl` request/reply service (`recovery.service.control`);
- `companion`: whatever runs beside the daemon (the demo's simulated cluster).

A stop request (SIGTERM or SIGINT in `run`, `Daemon.request_stop`) or a part that fails stops them in order: the
companion, the timers, the processor (after the batch under way, within half the shutdown budget), the lease's
renewal, the control service, the snapshot upload under way; then the final snapshot is written and what the
start set up is taken down in reverse: the consumer, the lease (released, so a standby takes over at once), the
NATS connection (drained; its client's own tasks ended), the embedded server, the HTTP server. No task of the
daemon outlives `Daemon.run`.

Crash safety. The engine state is snapshotted (every `snapshot_every_records` inputs or `snapshot_every_s` seconds,
and at shutdown) together with the last input sequence it covers, only at a batch boundary whose effects are all
acknowledged; a restart restores it and skips the outputs already stored (`recovery.service.restore`). So every
input takes effect once and no command id is stored twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskStatus
from nats.aio.client import Client
from nats.js import JetStreamContext

from events import subjects
from recovery.core.engine import Effect, Engine
from recovery.core.partition import Partition
from recovery.core.timers import Firing
from recovery.log.jetstream import is_transient
from recovery.log.pull import Delivery
from recovery.log.refusals import Refusals
from recovery.service import connection
from recovery.service.config import DaemonConfig
from recovery.service.consumer import INPUTS, BacklogAhead, InputReader, apply_backlog
from recovery.service.control import ControlService
from recovery.service.datadir import DataDirLock, StartRefused
from recovery.service.embedded import EmbeddedNats
from recovery.service.fence import Fence, Fenced
from recovery.service.http import HttpServer, Metrics
from recovery.service.lease import Lease, LeaseLost
from recovery.service.links import ConnectionEvents
from recovery.service.liveness import LivenessMonitor
from recovery.service.outage import POLL_S, OutageRecorder, pending_path, takeover_window_s
from recovery.service.parts import Parts
from recovery.service.prefetch import Prefetch
from recovery.service.processor import AppliedWaits, Listener, Processor
from recovery.service.publisher import Outgoing, Publisher, reraise_cancel
from recovery.service.restore import StoredIds, restore_newest, scan_published
from recovery.service.seal import Seal, load_seal
from recovery.service.snapshots import SnapshotStore, Snapshotter
from recovery.service.streams import ensure_streams
from recovery.service.summaries import ProgressSummaries
from recovery.service.tenure import Tenure
from recovery.service.timers import ServerClock, TimerService, fire_through
from recovery.service.unserved import UnservedWatch
from recovery.service.views import daemon_status

logger = logging.getLogger("recovery.daemon")

CTL_PREFIX = f"{subjects.PREFIX}.ctl"
COMPANION_GRACE_S = 15.0
"""how long a companion may take to wind down before the daemon stops (the demo exports and verifies its log)"""

Companion = Callable[["Daemon"], AbstractAsyncContextManager[object]]
"""what runs beside a daemon: entered once the daemon runs, left first when it stops"""


def _fields(**kwargs: Any) -> dict[str, Any]:
    return {"fields": kwargs}


class DaemonFailed(Exception):
    """A part of the daemon failed (the error is the cause, logged where it happened); every part was stopped."""


class Daemon(ConnectionEvents):
    """One daemon: `run` it (in a task group, or through `running`), `request_stop` it. Its state is readable
    while it runs (`engine`, `status`, `readiness`) from the same event loop."""

    def __init__(self, cfg: DaemonConfig, partition: Partition | None = None) -> None:
        self.cfg = cfg
        self.partition = partition  # one of several (`recovery.service.ownership`), or None: every job
        self.key = cfg.partition_key(None if partition is None else partition.index)
        self.metrics = Metrics()
        self.processor = Processor(None if partition is None else Engine(partition),
                                   policy_budget_s=cfg.policy_budget_s)
        self.refusals = Refusals(logger, "the daemon")
        self.fence: Fence | None = None
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.embedded: EmbeddedNats | None = None
        self.url = cfg.nats_url
        self.publisher: Publisher | None = None
        self.reader: InputReader | None = None
        self.snapshots: SnapshotStore | None = None
        self.server_clock = ServerClock()
        # Timers wait while NATS is away, and then for the outage's record (`recovery.service.outage`).
        self.outage = OutageRecorder(
            lambda: self.engine, self._publish, lambda ident: self.processor.seal(ident), cfg.outage_bound_s,
            lambda: self.connected and self.nc is not None and self.nc.is_connected,  # nats-py's own word first
            lambda: (self.lease is None or self.lease.fresh()) and self._caught_up_logged,
            path=pending_path(cfg.data_dir, self.key), window_s=takeover_window_s(cfg.lease_ttl_s), active=False)
        self.timer_service = TimerService(self.processor, self._fire_timers, self.server_clock, self._timers_may_fire)
        self.lease: Lease | None = None
        self.role = "starting"  # standby (waiting for the lease), active, or deposed (lost it)
        self.http: HttpServer | None = None
        self.http_port: int | None = None
        self.control: ControlService | None = None
        self.started_at = time.monotonic()
        self.connected = False
        self.restored_seq = 0
        self.replayed = -1  # set when the consumer first opens
        self.clean_seq = 0  # last input whose effects are all acknowledged: what a snapshot may cover
        self.last_ts = 0  # log time of that input
        self.snapshotter: Snapshotter | None = None
        self.stored: StoredIds | None = None  # the published-id scan, until the backlog's effects are settled
        self._ahead: BacklogAhead | None = None  # a partition's backlog, read while the snapshot is opened
        self.prefetched: Prefetch | None = None  # its takeover read ahead (`recovery.service.prefetch`)
        self.failed = False
        self.failure: BaseException | None = None
        self._failed_part = ""
        self._stop_requested = False
        self._stop: anyio.Event | None = None
        self._starting: anyio.CancelScope | None = None
        self._deadline: float | None = None  # of the shutdown, once it has begun
        self._parts = Parts(self._fail)
        self._applied = AppliedWaits()
        self._reader_ok = False
        self._caught_up_logged = False
        self._start_wall = time.monotonic()

    @property
    def engine(self) -> Engine:
        return self.processor.engine

    @property
    def recent(self) -> OrderedDict[int, list[Effect]]:
        return self.processor.recent

    @property
    def listeners(self) -> list[Listener]:
        return self.processor.listeners

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    @property
    def snapshot_seq(self) -> int:
        """The input sequence the newest snapshot covers (written or restored)."""
        return self.snapshotter.seq if self.snapshotter is not None else 0

    @property
    def snapshot_written(self) -> float | None:
        return self.snapshotter.written if self.snapshotter is not None else None

    # -- lifecycle --------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self, companion: Companion | None = None) -> AsyncIterator[Daemon]:
        """The daemon running beside the caller's block: started (processing, or standing by) on the way in,
        stopped in order on the way out, with every one of its tasks ended; DaemonFailed then if it failed."""
        failed: list[DaemonFailed] = []

        async def serve(*, task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED) -> None:
            try:
                await self.run(companion, task_status=task_status)
            except DaemonFailed as exc:
                failed.append(exc)  # the caller's block goes on: the daemon has stopped itself, in order

        async with anyio.create_task_group() as group:
            await group.start(serve)
            try:
                yield self
            finally:
                self.request_stop()
        if failed:
            raise failed[0]

    async def run(self, companion: Companion | None = None, *,
                  task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start (connect, set up streams and buckets, stand by for the lease, restore), run every part until a
        stop is requested or a part fails, then stop them in order. `task_status` is told once the parts run (or
        once a stop came first). DaemonFailed after the stop if a part, or the start, failed."""
        self._stop = anyio.Event()
        if self._stop_requested:
            self._stop.set()
        started = False
        try:
            async with anyio.create_task_group() as group:
                self._parts.group = group
                try:
                    async with AsyncExitStack() as teardown:
                        with anyio.CancelScope() as self._starting:
                            if not self._stop_requested:
                                await self._start(teardown, companion)
                        if self._starting.cancelled_caught:
                            logger.info("stopped before it started")
                        task_status.started(self)
                        started = True
                        await self._stop.wait()
                        await self._stop_parts()
                except Exception as exc:
                    self._fail("stop" if started else "start", exc)
                for part in reversed(list(self._parts)):
                    await part.end()  # every part has ended by now; this is for one the start left behind
        finally:
            self._parts.group = None
            if not started:
                task_status.started(self)
            logger.info("stopped", extra=_fields(last_seq=self.engine.last_seq, snapshot_seq=self.snapshot_seq))
        if self.failure is not None:
            raise DaemonFailed(f"{self._failed_part} failed: {self.failure!r}") from self.failure

    def request_stop(self) -> None:
        if not self._stop_requested:
            logger.info("stopping")
            self._stop_requested = True
            if self._stop is not None:
                self._stop.set()
            if self._starting is not None:
                self._starting.cancel()  # connecting, standing by or restoring: no need to finish

    async def quiesce(self, timeout: float = 2.0) -> None:
        """Stop taking input (timer firings too) after the batch under way, its effects published; the
        connections stay open."""
        for name, grace in (("timers", 0.0), ("liveness", 0.0), ("processor", timeout)):
            part = self._parts.get(name)
            if part is not None:
                await part.end(grace)

    async def _start(self, teardown: AsyncExitStack, companion: Companion | None) -> None:
        cfg = self.cfg
        # The data directory first, before any port is taken or anything connects, whatever the flags: a second daemon
        # on it must be refused before it does anything (`recovery.service.datadir`).
        lock = DataDirLock(cfg.data_dir)
        lock.acquire()
        teardown.callback(lock.release)
        if cfg.http_port >= 0:
            self.http = HttpServer(cfg.http_host, cfg.http_port, self.metrics, self.readiness,
                                   self.refresh_gauges, self.status)
            self.http_port = await self.http.listen()
            logger.info("http listening", extra=_fields(host=cfg.http_host, port=self.http_port))
            teardown.push_async_callback(self._parts.start("http", self.http.serve).end)
        if not self.url:
            self.embedded = EmbeddedNats(cfg.data_dir, port=cfg.embedded_port)
            teardown.push_async_callback(self._stop_embedded)
            await self.embedded.start_async()
            self.url = self.embedded.url
        teardown.push_async_callback(self._close_nats)
        await self._connect()
        self.outage.recover()  # an outage a deposed or stopped predecessor on this directory did not log
        await self._ensure_streams()
        claiming: asyncio.Future[None] | None = None
        if cfg.lease_ttl_s > 0:  # on a connection of its own (`recovery.service.tenure`)
            tenure = Tenure(cfg, self.key, self._on_error)
            teardown.push_async_callback(lambda: tenure.close(self.role == "active", self._until(0.5)))
            lease = self.lease = await tenure.open(self.url, self._retry)
            self.role = "standby"
            await self._retry(lease.acquire, "lease")
            logger.info("lease acquired: active", extra=_fields(partition=self.key, instance=lease.instance))
            self._parts.start("lease", self._hold_lease)
            if self.partition is not None:  # beside the restore (it publishes nothing), awaited before any output
                claiming = asyncio.ensure_future(self._claim(lease.instance))
                teardown.callback(claiming.cancel)
        self.role = "active"
        self.outage.took_over()
        teardown.callback(lambda: [part.cancel() for part in (self.stored, self._ahead) if part is not None])
        assert self.snapshotter is not None
        self.snapshotter.taking_over(True)  # the process's other partitions capture no snapshot meanwhile
        teardown.callback(self.snapshotter.taking_over, False)
        await self._restore()
        if claiming is not None:
            await claiming
        assert self.nc is not None and self.js is not None
        part = self.partition  # its own consumer: of the whole log, passing over the other partitions'
        name = cfg.consumer if part is None else f"{cfg.consumer}-{self.key}"
        self.reader = InputReader(self.nc, self.js, cfg.stream, name, cfg.batch_size, cfg.ack_wait_s,
                                  filter_subject=INPUTS if part is None else None)
        self.processor.reads = None if part is None else subjects.partition_reads(part.index)
        teardown.push_async_callback(self.reader.close)
        if cfg.timers_enabled:
            logger.info("timers re-armed", extra=_fields(timers=len(self.processor.timers)))
        self._parts.start("snapshots", self.snapshotter.uploads)
        if cfg.ctl_enabled:
            self.control = ControlService(self)
            teardown.push_async_callback(self._close_control)
            await self.control.subscribe(self.nc)
            self._parts.start("control", self.control.serve)
        self._parts.start("processor", self._process_inputs)
        if cfg.timers_enabled:
            self._parts.start("timers", self.timer_service.run)
            summaries = ProgressSummaries(lambda: self.engine, cfg.progress_summary_s, watching=self.timer_service)
            monitor = LivenessMonitor(lambda: self.engine, self._publish, self.processor.seal, lambda: self.readiness(
                )[0] and self.outage.may_publish() and not self.outage.pending,  # the daemon may write, caught up
                summaries=summaries)
            self._parts.start("liveness", partial(monitor.run, self.nc))
        if cfg.unserved_after_s > 0:  # a job waiting on nodes no agent serves: its decisions say so
            watch = UnservedWatch(lambda: self.engine, self._publish, self.processor.seal, cfg.unserved_after_s)
            self._parts.start("unserved", watch.run)
        if companion is not None:
            self._parts.start("companion", partial(self._accompany, companion))

    async def _stop_parts(self) -> None:
        """Stop the parts in order (the teardown of what the start set up follows)."""
        parts = self._parts
        if "companion" in parts:
            await parts["companion"].end(COMPANION_GRACE_S)
        self._until()  # the shutdown budget starts now
        budget = max(self.cfg.shutdown_timeout_s - 1.5, 0.5)
        for name in (n for n in ("timers", "liveness", "unserved") if n in parts):  # nothing to publish after
            await parts[name].end()
        if "processor" in parts and not await parts["processor"].end(budget * 0.5):
            logger.warning("batch not finished in time: it is applied again at the next start")
        for name in (n for n in ("lease", "control") if n in parts):
            await parts[name].end()
        if "snapshots" in parts and self.snapshotter is not None:
            parts["snapshots"].stop_requested.set()
            self.snapshotter.close()  # the upload under way finishes, then the part ends
            if not await parts["snapshots"].end(self._until(1.0)):
                logger.warning("snapshot upload not finished in time")
        with anyio.move_on_after(self._until(1.0)) as scope:
            if self.snapshotter is not None:
                await self.snapshotter.final(self.engine, self.clean_seq, self.last_ts, self.role == "active")
        if scope.cancelled_caught:
            logger.warning("final snapshot not written in time: the next start replays a longer tail")

    def _until(self, spare: float = 0.0) -> float:
        """Seconds left of the shutdown budget, keeping `spare` for what follows (never less than a tenth)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        return max(self._deadline - time.monotonic() - spare, 0.1)

    # -- parts --------------------------------------------------------------------------------------------
    def _fail(self, what: str, exc: BaseException) -> None:
        """A part (or the start) failed: the daemon stops, every part in order, and exits 1."""
        # A refusal that says all there is to say is logged without its traceback.
        logger.error(f"{what} failed: stopping" + (f": {exc}" if isinstance(exc, StartRefused) else ""),
                     exc_info=None if isinstance(exc, StartRefused) else exc)
        if self.failure is None:
            self.failure, self._failed_part = exc, what
        self.failed = True
        if isinstance(exc, Fenced):
            self.role = "deposed"  # another daemon owns the partition now: its lease is not ours to release
        self.request_stop()

    async def _accompany(self, companion: Companion) -> None:
        async with companion(self):
            await self._parts["companion"].stop_requested.wait()

    async def _claim(self, owner: str) -> None:
        """Claim the partition's outputs (`recovery.service.fence`): an earlier owner still running is refused."""
        assert self.js is not None and self.publisher is not None
        fence = self.fence = Fence(self.js, self.key, owner, self.cfg.stream, self.cfg.command_stream)
        await self._retry(fence.claim, "partition claim")
        self.publisher.fence = fence.headers

    async def _hold_lease(self) -> None:
        """Renew the lease; a lost lease stops the daemon (its supervisor starts it again, as a standby)."""
        assert self.lease is not None
        try:
            await self.lease.hold()
        except LeaseLost as exc:
            self.role = "deposed"
            logger.error("lease lost: stopping", extra=_fields(reason=str(exc)))
            raise

    # -- taking down what the start set up ----------------------------------------------------------------
    async def _close_control(self) -> None:
        if self.control is not None:
            with anyio.move_on_after(self._until(0.5), shield=True):
                await self.control.close()

    async def _close_nats(self) -> None:
        if self.nc is not None:
            await connection.close(self.nc, self._until(0.5))

    async def _stop_embedded(self) -> None:
        if self.embedded is not None:
            with anyio.move_on_after((timeout := max(self._until(), 1.0)) + 1.0, shield=True):
                await self.embedded.stop_async(timeout)

    async def _ensure_streams(self) -> None:
        js, cfg = self.js, self.cfg
        assert js is not None
        self.processor.sealed_from = await ensure_streams(js, cfg, self._retry, once=self.partition is not None)
        self.snapshots = SnapshotStore(js, cfg.snapshot_bucket, self.key, cfg.snapshot_chunk_bytes, cfg.replicas)
        await self._retry(self.snapshots.ensure, "snapshot bucket")
        self.processor.seal = await self._retry(lambda: load_seal(js, cfg.snapshot_bucket), "seal")
        self.snapshotter = Snapshotter(self.snapshots, cfg.snapshot_every_records, cfg.snapshot_every_s,
                                       cfg.snapshot_fork, self.metrics, self._retry, self._start_wall)

    async def _retry(self, op: Callable[[], Awaitable[Any]], what: str, limit_s: float = float("inf")) -> Any:
        return await connection.retry(op, what, lambda: self.stopping, limit_s)

    async def _restore(self) -> None:
        assert self.snapshots is not None and self.nc is not None and self.js is not None
        nc, js, cfg = self.nc, self.js, self.cfg
        t0 = time.monotonic()
        pre, self.prefetched = self.prefetched, None  # read while the last owner was only suspected dead
        if pre is not None and (taken := await pre.take(self.snapshots, self._retry)) is not None:
            newest, self.stored, self._ahead = taken
        else:
            scan = scan_published(nc, js, cfg.stream, cfg.command_stream, self._retry)
            ahead = self._read_ahead if self.partition else lambda start: None
            newest, self.stored = await restore_newest(self.snapshots, self._retry, self.partition, scan, ahead)
        if newest is not None and self.snapshotter is not None:
            (opened, manifest), self.processor.engine = newest, newest[0]
            self.restored_seq = self.clean_seq = opened.last_seq
            self.last_ts = int(manifest.get("ts", 0))
            self.snapshotter.restored(opened.last_seq, manifest)
        # The seal's secret (a snapshot never holds it); the engine requires a seal from the log's `sealed_from` on.
        seal = self.processor.seal
        self.engine.firing_seal = seal if isinstance(seal, Seal) else None
        self.engine.sealed_from = self.engine.nodes_from = self.processor.sealed_from
        self.processor.timers.load(self.engine.timers)
        self.metrics.restored_seq.set(self.restored_seq)
        logger.info("restored", extra=_fields(snapshot_seq=self.restored_seq, jobs=len(self.engine.jobs),
                                              timers=len(self.engine.timers), seconds=round(time.monotonic() - t0, 3)))

    # -- processing ---------------------------------------------------------------------------------------
    async def _process_inputs(self) -> None:
        reader, part = self.reader, self._parts["processor"]
        assert reader is not None
        delay = 0.05
        while not part.stopping:
            if self.lease is not None and not self.lease.fresh():
                await anyio.sleep(0.05)  # not renewed lately (NATS away?): read nothing another daemon may read
                continue
            try:
                if not self._reader_ok:
                    if not self.connected:
                        await anyio.sleep(0.05)  # waiting for the reconnect the client does by itself
                        continue
                    # A partition's consumer reads the whole log: a backlog is read first, its consumer made meanwhile.
                    pending = None if self.partition is None else await self._read_backlog()
                    if pending is None:
                        pending = await reader.open(self.engine.last_seq + 1)
                    await self._settle()
                    if self.replayed < 0:
                        self.replayed = pending  # inputs after the restored snapshot: the tail to replay
                    self._reader_ok = True
                    logger.info("consumer at sequence", extra=_fields(start=reader.pull.start_seq, pending=pending))
                    self._check_caught_up()
                batch = await reader.next_batch(0.2, self.engine.last_seq)
                delay = 0.05
            except Exception as exc:  # a reader that lost order (ReaderLost) or an outage: open it again
                if not is_transient(exc):
                    raise
                reraise_cancel(exc)
                self._reader_ok = False
                self.metrics.consumer_resets.inc()
                logger.warning("consumer reset", extra=_fields(reason=repr(exc), at=self.engine.last_seq + 1))
                await anyio.sleep(delay)  # retry backoff through an outage
                delay = min(delay * 2, 1.0)
                continue
            if batch:
                await self._process(batch)
            self._check_caught_up()
            if self.snapshotter is not None:
                self.snapshotter.maybe(self.engine, self.clean_seq, self.last_ts, self.role == "active")

    async def _read_backlog(self) -> int | None:
        """Apply a partition's backlog (`backlog_reader_at` records of the log or more) through `apply_backlog`: its
        own consumer reads every partition's records, and is made meanwhile. What that one has pending; None if
        there was no backlog to read (or a stop came), and no consumer made."""
        assert self.nc is not None and self.js is not None and self.partition is not None and self.reader is not None
        t0, start = time.monotonic(), self.engine.last_seq + 1
        if self._ahead is None or self._ahead.start != start:  # none read ahead, or the consumer was reset since
            self._read_ahead(start)
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        if (end := await ahead.measured()) is None:
            return None
        pending = end - start + 1
        self.replayed = pending if self.replayed < 0 else self.replayed
        done = await apply_backlog(self.reader, ahead, partial(self._process, backlog=True),
                                   lambda: self._parts["processor"].stopping)
        if done is None:
            return None
        logger.info("backlog applied", extra=_fields(start=start, end=end, pending=pending, read=done.read,
                                                     batches=done.batches, apply_s=round(done.apply_s, 3),
                                                     seconds=round(time.monotonic() - t0, 3)))
        return done.pending

    def _read_ahead(self, start: int) -> None:
        assert self.nc is not None and self.js is not None and self.partition is not None
        if self._ahead is not None:
            self._ahead.cancel()
        self._ahead = BacklogAhead(self.nc, self.js, self.cfg.stream, subjects.partition_inputs(self.partition.index),
                                   start, self.cfg.batch_size, self.cfg.backlog_reader_at)

    def _check_caught_up(self) -> None:
        if self.reader is not None and self.reader.caught_up and not self._caught_up_logged:
            self._caught_up_logged = True
            if self.snapshotter is not None:
                self.snapshotter.taking_over(False)
            self.metrics.replayed.set(self.replayed)
            logger.info("caught up", extra=_fields(
                restored_snapshot_seq=self.restored_seq, replayed_records=self.replayed,
                last_seq=self.engine.last_seq, seconds=round(time.monotonic() - self._start_wall, 3)))
        self.metrics.ready.set(1 if self.readiness()[0] else 0)

    async def _process(self, batch: list[Delivery], backlog: bool = False) -> None:
        """Apply `batch` and publish its effects; `backlog`: read by `_read_backlog` (old inputs, on consumers of
        their own: neither live, nor to acknowledge on the partition's consumer)."""
        reader, publisher = self.reader, self.publisher
        assert reader is not None and publisher is not None
        live = reader.caught_up and not backlog
        while batch:
            # Live, a command is published as soon as it is made; the rest of the batch follows (a replay of the
            # backlog keeps whole batches: nobody waits on its commands, and fewer, larger publishes go faster).
            done = self.processor.process(batch, self.server_clock.observe if live else None, first_command=live)
            held = self.stored is not None and self.stored.hold(done.out)  # the published-id scan still runs
            if done.out and not held:
                await publisher.publish(done.out)
                self.processor.published(done.out)
            if done.last is not None:
                if not backlog:  # (a backlog's: the partition's consumer is made again after what was applied)
                    await reader.ack(done.last)
                self.last_ts = max(self.last_ts, done.last.ts)
            engine = self.engine
            self.clean_seq = self.clean_seq if held else engine.last_seq  # held effects are not stored yet
            assert self.snapshotter is not None
            self.snapshotter.records_since += done.applied
            self.metrics.observe_batch(done, time.time_ns(), engine.last_seq, reader.lag)
            self.timer_service.reschedule()
            self._applied.reached(self.clean_seq)
            batch = done.rest

    async def _settle(self) -> None:
        """Once the published-id scan is done: publish what the backlog made meanwhile, less what it found stored."""
        settled = None if self.stored is None else await self.stored.settle()
        if settled is not None and self.publisher is not None:
            self.processor.skip_ids, out = settled
            await self.publisher.publish(out)
            self.processor.published(out)
            self.clean_seq = self.engine.last_seq
            self._applied.reached(self.clean_seq)

    async def _timers_may_fire(self) -> None:
        await self.outage.clear()
        # Until the engine caught up, a restored snapshot's timers are stale (a backlog's watch summaries move them):
        # each firing would be refused as early, a dead letter for each of a taken-over partition's jobs.
        while not self._caught_up_logged:
            await anyio.sleep(POLL_S)

    async def wait_applied(self, seq: int, timeout: float) -> bool:
        """Wait until the input at `seq` is applied and its effects published; TimeoutError after `timeout`."""
        return await self._applied.wait(seq, self.clean_seq, timeout)

    async def _publish(self, out: list[Outgoing]) -> None:
        assert self.publisher is not None
        await self.publisher.publish(out, deadline=time.monotonic() + 30)

    async def _fire_timers(self, fired: list[Firing]) -> None:
        assert self.publisher is not None
        self.metrics.timers_fired.inc(await fire_through(self.publisher, self.processor.seal, self.processor.timers,
                                                         fired))

    # -- views --------------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, object]]:
        caught_up = bool(self.reader is not None and self.reader.caught_up and self._caught_up_logged)
        ok = self.connected and self._reader_ok and caught_up and not self.stopping and self.role == "active"
        return ok, {"role": self.role, "connected": self.connected, "consumer": self._reader_ok, "caught_up": caught_up,
                    "stopping": self.stopping, "last_seq": self.engine.last_seq,
                    "lag": self.reader.lag if self.reader else None}

    def refresh_gauges(self) -> None:
        self.metrics.refresh(self.engine, self.role == "active", self.server_clock.offset_ns, self.snapshot_written,
                             self.readiness()[0], self.reader.lag if self.reader is not None else None)

    async def status(self) -> dict[str, object]:
        return daemon_status(self)

"""Several active daemons: the partitions of the jobs shared between them through their leases.

With `partitions` P > 1, every `recovery-daemon` runs an `Ownership`: it registers itself as a member of the
deployment (the key `members.<instance>` in the lease bucket, renewed like a lease and gone `lease_ttl_s` after it
stops), computes its fair share of the P partitions from the sorted list of live members (`fair_share`: every daemon
computes the same split, which adds up to P), and runs one `Daemon` per partition it owns, each behind the
partition's own lease, snapshot key, durable consumer and fence (`recovery.service.fence`).

- A daemon that dies stops renewing its membership and its leases: `lease_ttl_s` later the others' shares grow, they
  find those partitions' leases free and take them, each from the partition's last snapshot. A key counts as gone
  once it is a TTL old by the server's clock (every key carries the time the stream stored it, and this member's own
  key, just written, says what time it is there), not only once the server removed it, which it does up to a
  quarter of a second later; and the balance after one looks when the next such key lapses, not a period later.
- A takeover is read ahead while its owner is only suspected dead (`recovery.service.prefetch`): once a member's key
  is 0.6 TTL old, each survivor predicts which of that member's partitions it takes at the lapse (the split and
  order the take uses, which every survivor computes alike), opens their snapshots, scans the ids published after
  them and reads their backlogs; the others' predicted partitions it leaves to them for a moment after the lapse.
  At each lease's lapse (before the member's key lapses, when it was renewed later) its workers take the leases and
  find the restore done. A member that renews again costs a read, and gets back what was taken early.
- A daemon that joins makes the others' shares shrink: each stops its surplus partitions gracefully (the final
  snapshot written, the lease released at once), and the newcomer takes them.
- Surplus goes standbys first, then the highest partitions; a partition is taken only when its lease is free (or
  held by this instance from an earlier life), and its lease is written in this instance's name before its worker
  starts (`_reserve`), so that of two daemons that chose the same free partition one learns at once that it lost.

Whatever a partition's owner decides is fenced: an owner that lost its lease without noticing (frozen, cut off)
has every later publish refused by JetStream once the new owner claimed the partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import nats.js.errors
import orjson
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from recovery.core.partition import Partition
from recovery.service import connection, jsonlog, speedups
from recovery.service.config import DaemonConfig
from recovery.service.control import PartitionDirectory
from recovery.service.daemon import Daemon, DaemonFailed
from recovery.service.datadir import DataDirInUse, DataDirLock
from recovery.service.http import HttpServer, Metrics, PartitionMetrics
from recovery.service.lease import Lease, default_instance
from recovery.service.prefetch import Prefetch, predict, suspect_after_s
from recovery.service.views import outwaited

logger = logging.getLogger("recovery.ownership")

MEMBERS = "members"
_KEY_UNSAFE = re.compile(r"[^-_=/a-zA-Z0-9]")
WAKE_AFTER_LAPSE_S = 0.02
"""a balance due at a key's lapse runs this long after it (what the estimate of the server's time may be off by)"""


def fair_share(members: list[str], me: str, count: int) -> int:
    """How many of `count` partitions `me` owns among `members`: an even split, the first `count % n` members (in
    sorted order) one more, so that the shares of all members add up to `count` and each computes the same."""
    ordered = sorted(set(members) | {me})
    n, rank = len(ordered), ordered.index(me)
    return count // n + (1 if rank < count % n else 0)


@dataclass(frozen=True, slots=True)
class Stamped:
    """A key of the lease bucket as its stream stores it: the value, its revision, and the server's time of the write
    (seconds; None where the server gave none)."""

    value: dict[str, Any]
    revision: int
    stored_s: float | None


async def read_stamped(js: JetStreamContext, bucket: str, key: str) -> Stamped | None:
    """`key` of the KV bucket `bucket` with the time it was stored, from the stream's leader; None if it is absent
    (expired, deleted or never written)."""
    try:
        msg = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except nats.js.errors.NotFoundError:
        return None
    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
        return None
    try:
        value = orjson.loads(msg.data or b"{}")
    except orjson.JSONDecodeError:
        value = {}
    return Stamped(value if isinstance(value, dict) else {}, int(msg.seq or 0),
                   msg.time.timestamp() if msg.time is not None else None)


def member_key(instance: str) -> str:
    """The lease bucket's key of a member: its instance name with what a KV key cannot hold replaced."""
    return f"{MEMBERS}.{_KEY_UNSAFE.sub('_', instance)}"


class Ownership:
    """One daemon process's share of the partitions: `run` it until `request_stop`."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.instance = cfg.instance or default_instance(cfg.data_dir)
        self.count = cfg.partitions
        self.period_s = min(cfg.lease_ttl_s / 4, 0.5)
        self.workers: dict[int, Daemon] = {}
        self.members: list[str] = []
        self.target = 0
        self.nc: Client | None = None
        self.metrics = Metrics()
        # each partition's own metrics, labelled with its index, on this process's one `/metrics`
        self.metrics.registry.register(PartitionMetrics(self._partition_metrics))
        self.http_port: int | None = None
        self._kv: KeyValue | None = None
        self._waiting: set[int] = set()  # partitions whose worker stood by at the last balance
        self._stop_requested = False
        self._stop: anyio.Event | None = None
        self._started = time.monotonic()
        self._clock = time.monotonic
        self._js: JetStreamContext | None = None
        self._server_offset: float | None = None
        """the server's clock (seconds) less this process's monotonic clock, from this member's own key just written"""
        self._lapses: list[float] = []  # when keys of others seen at the last balance lapse (monotonic)
        self._suspects: dict[str, float] = {}
        """members whose keys are `suspect_after_s` old (missed renewals), and when each lapses (monotonic)"""
        self._prefetches: dict[int, Prefetch] = {}  # the suspects' partitions this member would take, read ahead
        self._held: dict[int, float] = {}  # every partition seen held by a suspect since the suspicion began: its lapse
        self._theirs: dict[int, tuple[str, float]] = {}
        """whom each of the suspects' partitions is predicted for, and until when (monotonic) others leave it alone"""
        self._kv_back: float | None = float("-inf")
        """since when the lease bucket answers again after a balance it failed (None: failing now): every member's
        keys lapsed meanwhile, and free partitions are taken only once every live member had a TTL to renew its own"""

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()

    def worker_config(self) -> DaemonConfig:
        # The partitions' daemons share this process's HTTP server; each answers recovery-ctl about its own jobs on
        # its partition's subjects (`recovery.service.control`), once active.
        return self.cfg.model_copy(update={"http_port": -1, "instance": self.instance})

    async def run(self, *, task_status: TaskStatus[Ownership] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, register, and balance every period until a stop; then stop every partition's daemon."""
        cfg = self.cfg
        stop = self._stop = anyio.Event()
        if self._stop_requested:
            stop.set()
        async with anyio.create_task_group() as group:
            http = None
            if cfg.http_port >= 0:
                http = HttpServer(cfg.http_host, cfg.http_port, self.metrics, self.readiness, None, self.status)
                self.http_port = await http.listen()
                group.start_soon(http.serve)
            nc = self.nc = await connection.connect(cfg.nats_url, _quiet, _quiet, _quiet_error)
            try:
                js = nc.jetstream(timeout=5.0)
                lease = Lease(js, cfg.lease_bucket, "", self.instance, cfg.lease_ttl_s, cfg.replicas)
                await connection.retry(lease.ensure, "lease bucket", lambda: self.stopping)
                self._kv = lease.kv
                if cfg.ctl_enabled:  # where recovery-ctl learns how many partitions to ask
                    directory = PartitionDirectory(self.count, self.instance, self.owned)
                    await directory.subscribe(nc)
                task_status.started(self)
                while not self.stopping:
                    try:
                        await self._balance(group, js)
                    except Exception as exc:  # NATS away: the leases say what is ours meanwhile
                        self._kv_back = None
                        logger.warning("balance failed", extra={"fields": {"error": repr(exc)}})
                    with anyio.move_on_after(self._next_look()):
                        await stop.wait()
                for daemon in list(self.workers.values()):
                    daemon.request_stop()
                with anyio.move_on_after(cfg.shutdown_timeout_s + 2.0):
                    while self.workers:
                        await anyio.sleep(0.05)  # each worker leaves the table when its daemon has stopped
                with contextlib.suppress(Exception):
                    await self.kv.delete(member_key(self.instance))  # the others' shares grow now, not a TTL later
            finally:
                for prefetch in self._prefetches.values():
                    prefetch.cancel()
                await connection.close(nc, 1.0)
                group.cancel_scope.cancel()

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None
        return self._kv

    def _next_look(self) -> float:
        """Seconds until the next balance: a period, or less when a key seen at the last one lapses sooner (a dead
        member's, or the lease of a partition nobody renews): its partitions are taken then, not a period later."""
        if not self._lapses:
            return self.period_s
        return min(self.period_s, max(min(self._lapses) - self._clock(), 0.0) + WAKE_AFTER_LAPSE_S)

    def _lapsed(self, key: Stamped) -> bool:
        """Is `key` a lease TTL old by the server's clock (or older)? Else its lapse is noted for the next look."""
        if (lapse := self._lapse(key)) is None:
            return False  # the server's removal says so instead
        if lapse <= self._clock():
            return True
        self._lapses.append(lapse)
        return False

    def _lapse(self, key: Stamped) -> float | None:
        """When `key` is a lease TTL old by the server's clock, on this process's clock (None: the server told no
        time, or this member has not seen its own key yet)."""
        if key.stored_s is None or self._server_offset is None:
            return None
        return key.stored_s + self.cfg.lease_ttl_s - self._server_offset

    async def _stamped(self, key: str) -> Stamped | None:
        assert self._js is not None
        return await read_stamped(self._js, self.cfg.lease_bucket, key)

    async def _balance(self, group: TaskGroup, js: JetStreamContext) -> None:
        kv, self._js, self._lapses = self.kv, js, []
        await kv.put(member_key(self.instance), orjson.dumps({"instance": self.instance}))
        written = self._clock()  # after the write: the server's time estimated from it is never ahead of the server
        self.members = await self._members(js, written)
        if self._kv_back is None:
            self._kv_back = self._clock()
        self.target = target = fair_share(self.members, self.instance, self.count)
        self.metrics.active.set(1 if self.owned() else 0)  # which partitions: `/status`
        self.metrics.ready.set(1 if self.readiness()[0] else 0)
        # A worker standing by lost the race for a free lease to another daemon: seen so at two balances in a row,
        # it is stopped, and it never counts toward the share (it would keep a partition nobody serves otherwise).
        waiting = {k for k, d in self.workers.items() if outwaited(d) and not d.stopping}
        for index in sorted(waiting & self._waiting):
            self.workers[index].request_stop()
        self._waiting = waiting
        # A worker still on its way to active (connecting, claiming) counts: else a slow start looks like room
        # for one more partition, taken now and handed over at the next balance.
        serving = {k: d for k, d in self.workers.items() if not d.stopping and k not in waiting}
        # A suspect's partition taken once its lease lapsed, before its holder's key did (`_take_early`): the share
        # counts it once the holder has lapsed too, or gives it back if the holder renews.
        counted = {k: d for k, d in serving.items() if not (self._suspects and k in self._held)}
        surplus = len(counted) - target
        if surplus > 0:
            for index in sorted((k for k, d in counted.items() if d.role != "active"), reverse=True) + sorted(
                    (k for k, d in counted.items() if d.role == "active"), reverse=True):
                if surplus == 0:
                    break
                logger.info("partition handed over", extra={"fields": {"partition": index, "share": target}})
                counted[index].request_stop()  # graceful: final snapshot, lease released
                surplus -= 1
        elif surplus < 0 and self._clock() - self._kv_back < self.cfg.lease_ttl_s:
            # The bucket was away (a server lost): the others could not renew either, and their keys look free.
            # Taking them now would move every partition; after a TTL each live member has its own back.
            return
        elif surplus < 0:
            free = [k for k in range(self.count) if k not in self.workers and await self._free(k) is not False]
            # Daemons that look at once take different free partitions first: the member of rank r of n takes
            # every n-th one from the r-th, then the rest. Each is reserved before its worker starts, so that of two
            # daemons that chose the same one (its lease lapsed for one and not yet for the other) the loser learns
            # it at once and takes the next one now, not after standing by for two balances.
            n = max(len(self.members), 1)
            rank = self.members.index(self.instance) if self.instance in self.members else 0
            wanted = -surplus
            # What was read ahead for this member first; what was predicted for another live survivor is left to
            # it until a little after its lapse, so that a take staggered by the lapses goes as predicted.
            ahead = [k for k in free if k in self._prefetches]
            order = [k for k in free[rank % n::n] + [k for i, k in enumerate(free) if i % n != rank % n]
                     if k not in ahead and not self._left_to_another(k)]
            for index in ahead + order:
                if wanted == 0:
                    break
                if await self._reserve(index):
                    self._start_worker(group, index)
                    wanted -= 1

        await self._prepare()
        await self._take_early(group)

    async def _take_early(self, group: TaskGroup) -> None:
        """Take the suspects' partitions predicted for this member as soon as their leases lapse, before their
        holders' keys do. A lease a TTL old is free whoever holds it (its holder stopped reading at half a TTL
        unrenewed, and learns at its next renewal that it lost): only the share waited for the holder's key, and the
        prediction is the share it will be. Each lease's lapse is a look of its own (`_next_look`)."""
        if not self._suspects:
            return
        for k in sorted(k for k, (who, _) in self._theirs.items() if who == self.instance and k not in self.workers):
            free = await self._free(k)  # notes a lapse still to come for the next look
            if free is not False and await self._reserve(k):
                logger.info("partition taken early", extra={"fields": {"partition": k,
                                                                       "suspects": sorted(self._suspects)}})
                self._start_worker(group, k)

    def _left_to_another(self, index: int) -> bool:
        who, until = self._theirs.get(index, ("", 0.0))
        return who != self.instance and who in self.members and self._clock() < until

    async def _prepare(self) -> None:
        """Read ahead the partitions this member would take if the suspected members lapsed (`recovery.service.
        prefetch`), and note whom the others' are predicted for. A prediction lasts until its partition is taken,
        its holder renews (a live member holds it again), or a grace after its lapse; its read ahead as long."""
        leases: dict[int, Stamped | None] = {}
        if self._suspects and self._js is not None:
            for k in (k for k in range(self.count) if k not in self.workers):
                entry = leases[k] = await self._stamped(self.cfg.partition_key(k))
                if entry is not None and (holder := entry.value.get("instance")) in self._suspects:
                    # lapses the later of its lease and its holder's membership, both on this process's clock
                    self._held[k] = max(self._lapse(entry) or self._clock(), self._suspects[holder])
            # The strides run over every partition seen held by a suspect since the suspicion began: a lease that
            # lapsed (the server removes it) or was taken meanwhile must not shift the others' strides.
            held = sorted(self._held)
            serving = sum(1 for k, d in self.workers.items() if not d.stopping and k not in self._held)
            wanted = predict(self.members, sorted(self._suspects), self.instance, held, serving,
                             lambda members, me: fair_share(members, me, self.count))
            grace = max(2 * self.period_s, 0.5)
            self._theirs = {k: (who, self._held[k] + grace) for k, who in wanted.items()}
        for k in sorted(self._theirs):
            if k not in leases and k not in self.workers and self._js is not None:
                leases[k] = await self._stamped(self.cfg.partition_key(k))
            holder = (leases.get(k) or Stamped({}, 0, None)).value.get("instance")
            if (k in self.workers or self._theirs[k][1] <= self._clock()
                    or (holder in self.members and holder not in self._suspects)):
                del self._theirs[k]
        if not self._suspects and not self._theirs:
            self._held = {}  # the suspicion is over: lapsed and taken, or renewed
        mine = sorted(k for k, (who, _) in self._theirs.items() if who == self.instance)
        for k in sorted(self._prefetches):
            if k not in mine or self._prefetches[k].stale(self.cfg.lease_ttl_s):
                self._prefetches.pop(k).cancel()
                self.metrics.prefetches.labels("dropped").inc()
        for k in mine:
            if k not in self._prefetches and self.nc is not None and self._js is not None:
                logger.info("takeover prefetch begun", extra={"fields": {
                    "partition": k, "suspects": sorted(self._suspects)}})
                self._prefetches[k] = Prefetch(self.nc, self._js, self.worker_config(), k, lambda: self.stopping)
                self.metrics.prefetches.labels("begun").inc()

    async def _members(self, js: JetStreamContext, written: float) -> list[str]:
        """The live members, this one among them: the bucket's member keys less those a TTL old by the server's clock,
        which this member's own key, written at `written`, tells."""
        # The members' keys are the bucket's stream subjects under `members.`, as the stream's state lists them: one
        # request. `kv.keys()` made a consumer each time (the server keeps it 5 minutes after): two a second per
        # daemon, hundreds alive at once, each one the cluster's meta group must create and remove.
        prefix = f"$KV.{self.cfg.lease_bucket}."
        info = await js.stream_info(f"KV_{self.cfg.lease_bucket}", subjects_filter=f"{prefix}{MEMBERS}.>")
        found: list[tuple[str, Stamped]] = []
        for subject in sorted(info.state.subjects or {}):
            entry = await self._stamped(subject[len(prefix):])
            if entry is not None and isinstance(entry.value.get("instance"), str):
                found.append((entry.value["instance"], entry))
                if entry.value["instance"] == self.instance and entry.stored_s is not None:
                    self._server_offset = entry.stored_s - written
        live = sorted(name for name, entry in found if name == self.instance or not self._lapsed(entry))
        suspect_after = suspect_after_s(self.cfg.lease_ttl_s)
        self._suspects = {}
        for name, entry in found:
            if (name != self.instance and name in live and (lapse := self._lapse(entry)) is not None
                    and lapse - self.cfg.lease_ttl_s + suspect_after <= self._clock()):
                self._suspects[name] = lapse
        return live

    async def _free(self, index: int) -> Stamped | bool:
        """May this daemon take partition `index` now? True if nobody holds its lease, or this instance did in an
        earlier life (the lease takes it back at once); its lease if that lapsed (a TTL old by the server's clock:
        its holder renews it no more, and the lease is taken from it by revision); else False."""
        entry = await self._stamped(self.cfg.partition_key(index))
        if entry is None or entry.value.get("instance") == self.instance:
            return True
        return entry if self._lapsed(entry) else False

    async def _reserve(self, index: int) -> bool:
        """Write partition `index`'s lease in this instance's name if nobody holds it: True if it is ours now (or
        was from an earlier life), when the worker's own lease takes it over at once (`Lease.try_acquire`); False if
        another daemon took it first. A reservation no worker renews lapses after the TTL, as any lease."""
        value = orjson.dumps({"instance": self.instance, "pid": os.getpid(), "since": time.time_ns(),
                              "token": "reserved"})
        try:
            await self.kv.create(self.cfg.partition_key(index), value)
        except nats.js.errors.KeyWrongLastSequenceError:
            free = await self._free(index)
            if not isinstance(free, Stamped):
                return free
            try:  # its holder's renewal, were it alive after all, fails on the revision: it learns that it lost
                await self.kv.update(self.cfg.partition_key(index), value, last=free.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
        return True

    def _start_worker(self, group: TaskGroup, index: int) -> None:
        daemon = Daemon(self.worker_config(), Partition(index, self.count))
        daemon.prefetched = self._prefetches.pop(index, None)
        if daemon.prefetched is not None:
            self.metrics.prefetches.labels("taken").inc()
        self.workers[index] = daemon
        logger.info("partition taken", extra={"fields": {"partition": index, "share": self.target,
                                                         "prefetched": daemon.prefetched is not None}})
        group.start_soon(self._serve, index, daemon, name=f"recovery-partition-{index}")

    async def _serve(self, index: int, daemon: Daemon) -> None:
        jsonlog.PARTITION.set(self.cfg.partition_key(index))  # this task's and its daemon's: every line names it
        try:
            await daemon.run()
        except DaemonFailed as exc:  # a lost lease or a fence: the partition is another daemon's now
            logger.warning("partition stopped", extra={"fields": {"partition": index, "reason": str(exc)}})
        except Exception:  # one partition's failure must not stop the others: the next balance takes it again
            logger.exception("partition failed", extra={"fields": {"partition": index}})
        finally:
            if daemon.prefetched is not None:  # stopped before its restore took it
                daemon.prefetched.cancel()
            if self.workers.get(index) is daemon:
                del self.workers[index]

    # -- views ------------------------------------------------------------------------------------------------
    def _partition_metrics(self) -> list[tuple[int, Metrics, Callable[[], None]]]:
        return [(k, d.metrics, d.refresh_gauges) for k, d in sorted(self.workers.items())]

    def owned(self) -> list[int]:
        return sorted(k for k, d in self.workers.items() if d.role == "active" and not d.stopping)

    def readiness(self) -> tuple[bool, dict[str, object]]:
        ready = {self.cfg.partition_key(k): d.readiness()[0] for k, d in sorted(self.workers.items())}
        ok = not self.stopping and len(self.owned()) == self.target and all(ready.values())
        return ok, {"role": "member", "instance": self.instance, "share": self.target, "partitions": ready}

    async def status(self) -> dict[str, object]:
        ok, why = self.readiness()
        parts: dict[str, Any] = {}
        for index, daemon in sorted(self.workers.items()):
            parts[str(index)] = await daemon.status()
        return {"ready": ok, **why, "members": self.members, "owned": self.owned(), "partition_status": parts,
                "uptime_s": round(time.monotonic() - self._started, 3)}


async def run(cfg: DaemonConfig) -> int:
    """Run this daemon's share of the partitions until SIGTERM/SIGINT (or `duration_s`); 0 on a clean stop, 2 if
    another daemon holds the data directory."""
    # The data directory first, before the HTTP port or the membership: its partitions' daemons share this hold.
    lock = DataDirLock(cfg.data_dir)
    try:
        lock.acquire()
    except DataDirInUse as exc:
        logger.error(f"start failed: stopping: {exc}")
        return 2
    try:
        return await _run(cfg)
    finally:
        lock.release()


async def _run(cfg: DaemonConfig) -> int:
    speedups.apply()
    # Threads that end after each call, as the single daemon's: a snapshot forks only while no other thread runs.
    asyncio.get_running_loop().set_default_executor(connection.ShortLivedThreads())
    ownership = Ownership(cfg)

    async def relay_signals() -> None:
        # No signal handlers on another platform or off the main thread: then only `duration_s` stops it.
        with (contextlib.suppress(NotImplementedError, RuntimeError, ValueError),
              anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals):
            async for _ in signals:
                ownership.request_stop()

    async def stop_after(seconds: float) -> None:
        await anyio.sleep(seconds)
        ownership.request_stop()

    async with anyio.create_task_group() as group:
        group.start_soon(relay_signals)
        if cfg.duration_s is not None:
            group.start_soon(stop_after, cfg.duration_s)
        try:
            await ownership.run()
        finally:
            group.cancel_scope.cancel()
    return 0


async def _quiet() -> None:
    return None


async def _quiet_error(exc: Exception) -> None:
    logger.debug("nats error", extra={"fields": {"error": repr(exc)}})

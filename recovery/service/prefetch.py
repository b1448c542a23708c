"""A takeover prepared while the partition's owner is only suspected dead: its reads done before its lease lapses.

A daemon killed outright stops renewing its membership key at once, but its partitions are free only a lease TTL
after their last renewal. Until now the survivors spent that TTL waiting, and only then read each partition's
snapshot, opened it, scanned the ids published after it and read its backlog: about a second on a busy host (up to
three), all of it after the lapse. None of it needs the lease: a snapshot and the log are what they are whoever
owns the partition. So once a member's key is older than `suspect_after_s` (it missed several renewals), each survivor
works out which of that member's partitions it would take if the member lapsed (`predict`: the same split and order
the take itself uses) and reads them ahead (`Prefetch`). At the lapse its worker takes the lease, claims the fence,
and finds the snapshot opened, the published ids scanned and the backlog read; what the log got since is read by
the partition's own consumer, as any live input.

A prefetch decides nothing and publishes nothing: the engine it opens is the worker's only once the worker holds the
lease and the newest snapshot is still the one it opened (else it is dropped and the worker restores as before).
The scan it began covers what was stored until then; an output stored later by an owner that was alive after all is
published again with its id, and the stream's duplicate window drops it, as for any restart. A member that renews
again, a prediction that changes, or a prefetch older than `MAX_AGE_TTLS` lease TTLs is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from events import subjects
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.service import connection, jsonlog
from recovery.service.config import DaemonConfig
from recovery.service.consumer import BacklogAhead
from recovery.service.restore import StoredIds, restore_newest, scan_published
from recovery.service.snapshots import Retry, SnapshotStore

logger = logging.getLogger("recovery.ownership")

SUSPECT_AFTER_TTL = 0.6
"""a member whose key is this share of the lease TTL old is suspected: it renews every half second (at most a
quarter TTL), so this is six renewals missed or more, and its partitions lapse within the rest of the TTL. On a
busy host a member's loop stalls for two seconds now and then (a snapshot opened, a burst applied): at 0.4 TTL a
fleet of three daemons read ahead every few seconds for nothing, and the reads stalled the others in turn"""
READ_AHEAD_BATCHES = 32
"""batches of the backlog a prefetch holds before its worker applies them (a takeover's read ahead holds 4): a
backlog since a snapshot 20 s old is 6-9 of them on a 200,000-GPU fleet, all read before the lapse; a longer one
(no snapshot yet) waits there, bounded, and is read on by the worker"""
MAX_AGE_TTLS = 3.0
"""a prefetch this many TTLs old is read again: its scan and backlog would leave the worker more to read live"""


def suspect_after_s(lease_ttl_s: float) -> float:
    return lease_ttl_s * SUSPECT_AFTER_TTL


def predict(members: list[str], suspects: list[str], me: str, held: list[int], serving: int,
            share: Callable[[list[str], str], int]) -> dict[int, str]:
    """Who takes each partition in `held` (the suspects', in index order) if the suspects lapse, as the take does
    it: the member of rank r of the n survivors takes every n-th partition from the r-th, then the rest, as many as
    its share among the survivors (`share`) less the `serving` partitions it has. Only this member's own count is
    known here, so only its own take is exact; each other survivor is given its stride of `held` (a partition left
    out is anyone's). Every survivor computes the same strides from the same keys."""
    survivors = sorted(m for m in members if m not in suspects)
    if me not in survivors or not held:
        return {}
    n, rank = len(survivors), survivors.index(me)
    order = held[rank::n] + [k for i, k in enumerate(held) if i % n != rank]
    out = dict.fromkeys(order[:max(share(survivors, me) - serving, 0)], me)
    for other, member in enumerate(survivors):
        for index in held[other::n] if member != me else []:
            out.setdefault(index, member)
    return out


class Prefetch:
    """Partition `index`'s snapshot opened, its published-id scan begun and its backlog read ahead, on the
    ownership's connection, in a task of its own. `take` it in the partition's worker, or `cancel` it."""

    def __init__(self, nc: Client, js: JetStreamContext, cfg: DaemonConfig, index: int,
                 stopping: Callable[[], bool]) -> None:
        self.index = index
        self.started = time.monotonic()
        self.partition = Partition(index, cfg.partitions)
        self._cfg, self._nc, self._js = cfg, nc, js
        self._stopping = stopping
        self.snapshots = SnapshotStore(js, cfg.snapshot_bucket, cfg.partition_key(index), cfg.snapshot_chunk_bytes,
                                       cfg.replicas)
        self.newest: tuple[Engine, dict[str, Any]] | None = None
        self.stored: StoredIds | None = None
        self.ahead: BacklogAhead | None = None
        self._task = asyncio.ensure_future(self._read())

    async def _retry(self, op: Any, what: str) -> Any:
        return await connection.retry(op, what, self._stopping)

    def _read_ahead(self, start: int) -> None:
        if self.ahead is not None:
            self.ahead.cancel()
        cfg = self._cfg
        self.ahead = BacklogAhead(self._nc, self._js, cfg.stream, subjects.partition_inputs(self.index), start,
                                  cfg.batch_size, cfg.backlog_reader_at, depth=READ_AHEAD_BATCHES)

    async def _read(self) -> None:
        cfg, nc, js = self._cfg, self._nc, self._js
        jsonlog.PARTITION.set(cfg.partition_key(self.index))  # this task's lines name the partition, as its worker's
        await self._retry(self.snapshots.ensure, "snapshot bucket")
        self.newest, self.stored = await restore_newest(
            self.snapshots, self._retry, self.partition,
            scan_published(nc, js, cfg.stream, cfg.command_stream, self._retry), ahead=self._read_ahead)
        logger.info("takeover prefetched", extra={"fields": {
            "partition": self.index, "snapshot_seq": self.newest[0].last_seq if self.newest else 0,
            "seconds": round(time.monotonic() - self.started, 3)}})

    def stale(self, lease_ttl_s: float) -> bool:
        return time.monotonic() - self.started > MAX_AGE_TTLS * lease_ttl_s

    async def take(self, snapshots: SnapshotStore, retry: Retry
                   ) -> tuple[tuple[Engine, dict[str, Any]] | None, StoredIds, BacklogAhead | None] | None:
        """What was read ahead, if the snapshot it opened is still the newest (the worker holds the lease now, so
        no other snapshot of the partition is written meanwhile): the engine and manifest, the scan, the backlog
        read ahead. None (and cancelled) if it failed or is out of date: the worker restores as before."""
        try:
            try:
                await self._task
            except Exception as exc:  # it only saves time: the worker reads again what it could not
                logger.warning("takeover prefetch failed: restoring again", extra={"fields": {"error": repr(exc)}})
                self.cancel()
                return None
            manifest = await retry(snapshots.manifest, "snapshot manifest")
        except BaseException:  # a stop meanwhile: nothing of it outlives the worker
            self.cancel()
            raise
        opened = None if self.newest is None else self.newest[1].get("id")
        if (None if manifest is None else manifest.get("id")) != opened or self.stored is None:
            logger.info("takeover prefetch out of date: restoring again", extra={"fields": {
                "prefetched": opened, "newest": None if manifest is None else manifest.get("id")}})
            self.cancel()
            return None
        return self.newest, self.stored, self.ahead

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled():
            with contextlib.suppress(Exception):
                self._task.exception()  # retrieved: a prefetch nobody takes fails quietly
        for part in (self.stored, self.ahead):
            if part is not None:
                part.cancel()

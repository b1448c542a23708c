"""Crash safety at start: the newest snapshot opened, and the ids of the outputs already stored after it.

A restart restores the newest snapshot and applies the inputs after it again: the decisions they make are the same,
with the same ids. The daemon reads the ids already stored after the snapshot (decisions and dead letters in the log,
commands in the command stream since the snapshot's log time) and does not publish those again; anything else it
republishes is dropped by JetStream's duplicate window. That scan starts with the snapshot's fetch and runs on while
the backlog after it is applied (`StoredIds`): what the backlog makes meanwhile is held, and published once the scan
says which of it is stored, before the daemon reads live input. A takeover waits for the longer of the two, not
for both."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext

from events import subjects
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log.snapshot import open_snapshot
from recovery.service.consumer import scan_ids
from recovery.service.publisher import Outgoing
from recovery.service.snapshots import Retry, SnapshotStore

logger = logging.getLogger("recovery.daemon")
T = TypeVar("T")

CLOCK_SKEW_MARGIN_NS = 10 * 1_000_000_000
"""commands are looked up from this long before the snapshot's log time: the command stream's leader stamps them by
its own clock, which may differ from the log's. A command the scan misses is published again and dropped by the
stream's duplicate window (`duplicate_window_s`, an hour by default), so the margin only saves publishes; each of
its seconds is a second of the fleet's commands a takeover reads (at 120 s, two thirds of a 200,000-GPU fleet's
takeover scan)"""


async def open_newest(snapshots: SnapshotStore, retry: Retry, partition: Partition | None,
                      manifest: dict[str, Any]) -> tuple[Engine, dict[str, Any]] | None:
    """The engine of the snapshot `manifest` names (the newest, read just before) and its manifest; None when it
    cannot be loaded or opened (classes changed under the same version): then the whole log is replayed instead of
    crashing."""
    loaded = await retry(lambda: snapshots.load(manifest), "snapshot load")
    if loaded is None:
        return None
    blob, manifest = loaded
    try:  # in a thread: unpickling takes 0.2-2 s of a busy host, and the loop renews leases and serves meanwhile
        opened = await in_own_thread(open_snapshot, blob)
    except Exception as exc:
        opened = f"{type(exc).__name__}: {exc}"
    if isinstance(opened, Engine) and opened.partition != partition:
        opened = f"the engine of partition {opened.partition}, not of {partition}"
    if not isinstance(opened, Engine):
        logger.warning("snapshot not restored: replaying the whole log",
                       extra={"fields": {"seq": manifest.get("seq"), "reason": opened}})
        return None
    return opened, manifest


async def in_own_thread(fn: Callable[[bytes], T], arg: bytes) -> T:
    """`fn(arg)` in a thread started for it and joined when it returns. Not a pool's: an idle worker left behind
    would keep the daemon from forking its snapshots for seconds (`recovery.service.snapshots.capture` forks only
    while no other thread runs), and pickle them in the loop instead. A caller cancelled meanwhile leaves the
    thread to finish alone."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn(arg)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=work, name="recovery-snapshot-open", daemon=True)
    thread.start()
    try:
        return await asyncio.shield(done)  # a cancel here leaves the thread to finish alone
    finally:
        if done.done():
            thread.join()  # it has returned already, or is about to


Scan = Callable[[int, int], Awaitable[set[str]]]
"""the ids of the outputs stored after an input sequence and a log time (`published_after`, retried)"""


class StoredIds:
    """The scan of the ids stored after the restored snapshot, running on (a task of its own) while the backlog is
    applied: `hold` keeps what the backlog makes meanwhile, `settle` waits for the scan and says which of it is not
    stored yet. `cancel` it if the daemon stops first."""

    def __init__(self, scan: Callable[[], Awaitable[set[str]]]) -> None:
        self._started = time.monotonic()
        self._scanned = self._started
        self._task: asyncio.Future[set[str]] | None = self._begin(scan)
        self.held: list[Outgoing] = []

    def _begin(self, scan: Callable[[], Awaitable[set[str]]]) -> asyncio.Future[set[str]]:
        async def timed() -> set[str]:  # the scan made here: one cancelled before it began is never made
            try:
                return await scan()
            finally:
                self._scanned = time.monotonic()

        return asyncio.ensure_future(timed())

    @property
    def pending(self) -> bool:
        """Not settled yet: effects are held, not published."""
        return self._task is not None

    def again(self, scan: Callable[[], Awaitable[set[str]]]) -> None:
        """Scan from another place instead (the snapshot restored is not the one the first scan started from)."""
        self.cancel()
        self._task = self._begin(scan)

    def hold(self, out: list[Outgoing]) -> bool:
        """Keep `out` until `settle` if the scan still runs (True); False: publish it now."""
        if self._task is None:
            return False
        self.held.extend(out)
        return True

    async def settle(self) -> tuple[set[str], list[Outgoing]] | None:
        """Once the scan is done: the ids it found, and what was held less what they name, in the order it was made
        (None if settled before)."""
        if self._task is None:
            return None
        ids = await self._task
        held, self._task, self.held = self.held, None, []
        out = [o for o in held if o.msg_id not in ids and not (o.plain and o.plain in ids)]
        logger.info("published ids read", extra={"fields": {
            "ids": len(ids), "held": len(held), "unpublished": len(out),
            "scan_s": round(self._scanned - self._started, 3), "seconds": round(time.monotonic() - self._started, 3)}})
        return ids, out

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        elif self._task is not None and not self._task.cancelled():
            self._task.exception()  # retrieved: a scan that failed after its daemon stopped is nobody's error


async def restore_newest(snapshots: SnapshotStore, retry: Retry, partition: Partition | None, scan: Scan,
                         ahead: Callable[[int], None] = lambda start: None
                         ) -> tuple[tuple[Engine, dict[str, Any]] | None, StoredIds]:
    """`open_newest`, and the scan of the ids already published after it, begun as the snapshot is fetched and
    opened (both are a takeover's wait) from the sequence and log time its manifest names; again from what was
    restored in the end if that differs (a snapshot that could not be opened: the whole log). `ahead` is told the
    first input after the snapshot as soon as it is known (and again if that changes): the backlog's read begins."""
    t0 = time.monotonic()
    manifest = await retry(snapshots.manifest, "snapshot manifest")
    manifest_s = round(time.monotonic() - t0, 3)
    if manifest is None:
        ahead(1)
        return None, StoredIds(lambda: scan(0, 0))
    try:
        seq, ts = int(manifest["seq"]), int(manifest.get("ts", 0))
    except (KeyError, TypeError, ValueError):
        seq, ts = -1, 0  # a damaged manifest: load refuses it, and the scan runs once restored
    stored = StoredIds(lambda: scan(max(seq, 0), ts))
    ahead(max(seq, 0) + 1)
    try:
        newest = await open_newest(snapshots, retry, partition, manifest)
    except BaseException:
        stored.cancel()
        raise
    restored = (newest[0].last_seq, int(newest[1].get("ts", 0))) if newest is not None else (0, 0)
    if restored != (seq, ts):
        stored.again(lambda: scan(*restored))
        ahead(restored[0] + 1)
    logger.info("snapshot read", extra={"fields": {"seq": seq, "manifest_s": manifest_s,
                                                   "open_s": round(time.monotonic() - t0 - manifest_s, 3)}})
    return newest, stored


def scan_published(nc: Client, js: JetStreamContext, stream: str, command_stream: str, retry: Retry) -> Scan:
    """The scan a restore begins: `published_after` on these streams, retried through an outage."""
    return lambda seq, ts: retry(lambda: published_after(nc, js, stream, command_stream, seq, ts),
                                 "published-id scan")


async def published_after(nc: Client, js: JetStreamContext, stream: str, command_stream: str, seq: int,
                          ts: int) -> set[str]:
    """Ids of outputs stored after the snapshot: decisions and dead letters in the log after `seq`, commands in
    the command stream since the snapshot's log time `ts`. Not published again."""
    ids: set[str] = set()
    start_cmd = None if seq == 0 else datetime.fromtimestamp(max(ts - CLOCK_SKEW_MARGIN_NS, 0) / 1e9, tz=UTC)
    # The log's outputs through one consumer of both output filters, headers only: a takeover makes one consumer
    # fewer through the cluster's meta leader (busiest then) than with one per filter, and the server skips the
    # inputs, which a consumer of every subject delivered only to be dropped here (the whole tail after the snapshot,
    # read again: half a second of a restart's 50,000 records).
    log = scan_ids(nc, js, stream, [[subjects.DECISIONS, subjects.DEAD_LETTERS]], seq + 1, None)
    commands = scan_ids(nc, js, command_stream, [subjects.COMMANDS], 1, start_cmd)
    for found in await asyncio.gather(log, commands):  # at once: a takeover waits
        ids.update(found)
    return ids

"""Crash safety at start: the newest snapshot opened, and the ids of the outputs already stored after it.

A restart restores the newest snapshot and applies the inputs after it again: the decisions they make are the same,
with the same ids. Before it starts, the daemon reads the ids already stored after the snapshot (decisions and dead
letters in the log, commands in the command stream since the snapshot's log time) and does not publish those again;
anything else it republishes is dropped by JetStream's duplicate window."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from events import subjects
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log.snapshot import open_snapshot
from recovery.service.consumer import scan_ids
from recovery.service.snapshots import Retry, SnapshotStore

logger = logging.getLogger("recovery.daemon")

CLOCK_SKEW_MARGIN_NS = 120 * 1_000_000_000
"""commands are looked up from this long before the snapshot's log time (servers' clocks may differ)"""


async def open_newest(snapshots: SnapshotStore, retry: Retry, partition: Partition | None,
                      manifest: dict[str, Any]) -> tuple[Engine, dict[str, Any]] | None:
    """The engine of the snapshot `manifest` names (the newest, read just before) and its manifest; None when it
    cannot be loaded or opened (classes changed under the same version): then the whole log is replayed instead of
    crashing."""
    loaded = await retry(lambda: snapshots.load(manifest), "snapshot load")
    if loaded is None:
        return None
    blob, manifest = loaded
    try:
        opened = open_snapshot(blob)
    except Exception as exc:
        opened = f"{type(exc).__name__}: {exc}"
    if isinstance(opened, Engine) and opened.partition != partition:
        opened = f"the engine of partition {opened.partition}, not of {partition}"
    if not isinstance(opened, Engine):
        logger.warning("snapshot not restored: replaying the whole log",
                       extra={"fields": {"seq": manifest.get("seq"), "reason": opened}})
        return None
    return opened, manifest


Scan = Callable[[int, int], Awaitable[set[str]]]
"""the ids of the outputs stored after an input sequence and a log time (`published_after`, retried)"""


async def restore_newest(snapshots: SnapshotStore, retry: Retry, partition: Partition | None,
                         scan: Scan) -> tuple[tuple[Engine, dict[str, Any]] | None, set[str]]:
    """`open_newest`, and the ids already published after it: the scan runs while the snapshot is fetched and
    opened (both are a takeover's wait), from the sequence and log time its manifest names; again from what was
    restored in the end if that differs (a snapshot that could not be opened: the whole log)."""
    took: dict[str, float] = {}

    async def timed(what: str, step: Awaitable[Any]) -> Any:
        t0 = time.monotonic()
        try:
            return await step
        finally:
            took[what] = round(time.monotonic() - t0, 3)

    manifest = await timed("manifest_s", retry(snapshots.manifest, "snapshot manifest"))
    if manifest is None:
        return None, await scan(0, 0)
    try:
        seq, ts = int(manifest["seq"]), int(manifest.get("ts", 0))
    except (KeyError, TypeError, ValueError):
        seq, ts = -1, 0  # a damaged manifest: load refuses it, and the scan runs once restored
    newest, ids = await asyncio.gather(timed("open_s", open_newest(snapshots, retry, partition, manifest)),
                                       timed("scan_s", scan(max(seq, 0), ts)))
    restored = (newest[0].last_seq, int(newest[1].get("ts", 0))) if newest is not None else (0, 0)
    if restored != (seq, ts):
        ids = await timed("rescan_s", scan(*restored))
    logger.info("snapshot and published ids read", extra={"fields": {"seq": seq, **took}})
    return newest, ids


async def published_after(nc: Client, js: JetStreamContext, stream: str, command_stream: str, seq: int,
                          ts: int) -> set[str]:
    """Ids of outputs stored after the snapshot: decisions and dead letters in the log after `seq`, commands in
    the command stream since the snapshot's log time `ts`. Not published again."""
    ids: set[str] = set()
    start_cmd = None if seq == 0 else datetime.fromtimestamp(max(ts - CLOCK_SKEW_MARGIN_NS, 0) / 1e9, tz=UTC)
    scans = [(stream, [subjects.DECISIONS, subjects.DEAD_LETTERS], seq + 1, None),
             (command_stream, [subjects.COMMANDS], 1, start_cmd)]
    for found in await asyncio.gather(*(scan_ids(nc, js, *scan) for scan in scans)):  # at once: a takeover waits
        ids.update(found)
    return ids

"""Crash safety at start: the newest snapshot opened, and the ids of the outputs already stored after it.

A restart restores the newest snapshot and applies the inputs after it again: the decisions they make are the same,
with the same ids. Before it starts, the daemon reads the ids already stored after the snapshot (decisions and dead
letters in the log, commands in the command stream since the snapshot's log time) and does not publish those again;
anything else it republishes is dropped by JetStream's duplicate window."""

from __future__ import annotations

import asyncio
import logging
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


async def open_newest(snapshots: SnapshotStore, retry: Retry,
                      partition: Partition | None = None) -> tuple[Engine, dict[str, Any]] | None:
    """The engine of the newest snapshot and its manifest; None when there is none, or when it cannot be opened
    (classes changed under the same version): then the whole log is replayed instead of crashing."""
    loaded = await retry(snapshots.load, "snapshot load")
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

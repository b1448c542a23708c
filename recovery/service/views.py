"""What a daemon says of itself on `/status` and `recovery-ctl status`: its role, how far it has read and published,
its snapshot, timers and clock; a view, read from the daemon's parts, that changes nothing."""

from __future__ import annotations

import time
from typing import Any


def daemon_status(d: Any) -> dict[str, object]:
    """`d`: a `recovery.service.daemon.Daemon` (not imported: the daemon imports this module)."""
    ok, why = d.readiness()
    return {"ready": ok, **why, "published_seq": d.clean_seq, "url": d.url, "jobs": len(d.engine.jobs),
            "open_incidents": sum(1 for j in d.engine.jobs.values() if j.incident is not None),
            "timers": len(d.engine.timers), "snapshot_seq": d.snapshot_seq,
            "restored_snapshot_seq": d.restored_seq, "replayed_records": d.replayed,
            "snapshot_age_s": None if d.snapshot_written is None else round(
                time.monotonic() - d.snapshot_written, 3),
            "uptime_s": round(time.monotonic() - d.started_at, 3), "http_port": d.http_port,
            "timer_service": d.timer_service.describe(),
            "server_clock_offset_s": round(d.server_clock.offset_ns / 1e9, 6),
            "publish_retries": d.publisher.retries if d.publisher else 0,
            "duplicates_dropped": d.publisher.duplicates if d.publisher else 0, "partition": d.key}


def outwaited(d: Any) -> bool:
    """Is daemon `d` standing by for a lease another daemon holds (not merely on its way to active, slow under load)?"""
    lease = d.lease
    if d.role != "standby" or lease is None or not lease.holder:
        return False
    return bool(lease.holder.get("instance") != lease.instance)

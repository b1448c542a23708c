"""A daemon's tenure of its partition: its lease (`recovery.service.lease`) on a NATS connection of its own.

The lease decides whether the daemon may read its partition's input at all, so its renewals must get through
whatever the input does: on the daemon's main connection they queued behind megabytes of deliveries, and when the
server cut that connection off as a slow consumer, they died with it, the lease expired and the only daemon of the
partition stopped. Its own connection carries nothing but the lease's few small requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from nats.aio.client import Client

from recovery.service import connection
from recovery.service.config import DaemonConfig
from recovery.service.lease import Lease, default_instance

logger = logging.getLogger("recovery.daemon")

Retry = Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]]


async def _quiet() -> None:
    return None


class Tenure:
    """Open it (`open`: the connection and the bucket), then acquire and hold its `lease`; `close` gives the lease up
    (when `release`) and closes the connection."""

    def __init__(self, cfg: DaemonConfig, key: str, on_error: Callable[[Exception], Awaitable[None]]) -> None:
        self.cfg = cfg
        self.key = key
        self.on_error = on_error
        self.nc: Client | None = None
        self.lease: Lease | None = None

    async def open(self, url: str, retry: Retry) -> Lease:
        cfg = self.cfg
        # Renewals answer within a third of the TTL or are tried again (`Lease.hold`), never after the lease is gone.
        self.nc = await connection.connect(url, _quiet, _quiet, self.on_error)
        js = self.nc.jetstream(timeout=max(min(cfg.lease_ttl_s / 3, 5.0), 0.5))
        lease = self.lease = Lease(js, cfg.lease_bucket, self.key, cfg.instance or default_instance(cfg.data_dir),
                                   cfg.lease_ttl_s, cfg.replicas)
        await retry(lease.ensure, "lease bucket")
        return lease

    async def close(self, release: bool, budget_s: float) -> None:
        if self.lease is not None and release:
            with anyio.move_on_after(budget_s, shield=True), contextlib.suppress(Exception):
                await self.lease.release()  # the standby takes over now, not a TTL later
                logger.info("lease released")
        if self.nc is not None:
            await connection.close(self.nc, 0.2)

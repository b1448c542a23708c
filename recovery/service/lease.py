"""Which daemon processes a partition: a lease in a JetStream KV bucket whose entries expire.

Two daemons must never consume one partition's inputs at once: each would apply a different subset of the log
and decide from a state the other never saw. The active daemon holds the key `<partition>` in the lease bucket,
whose entries live `ttl` seconds after their last write, and renews it every `ttl / 3` with a compare-and-set
on the revision it wrote last. A standby tries to create the key every `min(ttl / 4, 0.5 s)` and wins once
the active one has stopped renewing (crashed, partitioned) or released it (a graceful stop deletes the key).

Fencing without synchronised clocks: the holder reads input only while its last successful renewal is younger
than `ttl / 2` on its own monotonic clock, while a standby can take the key only `ttl` after that write; and a
renewal that finds another revision (someone else took the key) ends the holder. Any revision change is
fatal, even when the key looks free again: another daemon may have applied inputs meanwhile, which this one's
engine never saw, so it must start again from the snapshot rather than carry on. Duplicate effects of the
handover are dropped by their deterministic message ids.

The same `instance` (by default host name and data directory) takes its own lease back at once: a daemon that
was SIGKILLed and restarted does not wait out the TTL.

With several partitions (`partitions` > 1) one daemon holds several leases, one per partition it owns (keys
`<partition>-<k>`), and registers as a member of the deployment in the same bucket; `recovery.service.ownership`
decides which partitions are its share, and `recovery.service.fence` makes a lost lease's late publishes fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import nats.errors
import nats.js.errors
import orjson
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from recovery.log.jetstream import is_transient
from recovery.service.publisher import reraise_cancel

logger = logging.getLogger("recovery.lease")


class LeaseLost(RuntimeError):
    """Another daemon holds the partition now: this one must stop and start over as a standby."""


def default_instance(data_dir: Path) -> str:
    return f"{socket.gethostname()}:{data_dir.resolve()}"


class Lease:
    def __init__(self, js: JetStreamContext, bucket: str, partition: str, instance: str, ttl_s: float,
                 replicas: int = 1, clock: Any = time.monotonic) -> None:
        self.js = js
        self.bucket = bucket
        self.key = partition
        self.instance = instance
        self.ttl_s = ttl_s
        self.replicas = replicas
        self._clock = clock
        self._kv: KeyValue | None = None
        self.revision: int | None = None
        self.renewed: float | None = None
        self.holder: dict[str, Any] | None = None  # the holder seen last while waiting

    async def ensure(self) -> None:
        try:
            self._kv = await self.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            self._kv = await self.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, history=1, ttl=self.ttl_s, storage=StorageType.FILE, replicas=self.replicas,
                description="recovery-daemon partition leases"))
        info = await self._kv.status()
        ttl = info.ttl or 0.0
        if abs(ttl - self.ttl_s) > 1e-3:
            raise ValueError(f"lease bucket {self.bucket} keeps entries {ttl:g}s, but lease_ttl_s is {self.ttl_s:g}: "
                             f"every daemon of a partition must use the same TTL (delete the bucket to change it)")

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "ensure() first"
        return self._kv

    def _value(self) -> bytes:
        return orjson.dumps({"instance": self.instance, "pid": os.getpid(), "since": time.time_ns()})

    async def try_acquire(self) -> bool:
        """Take the lease if it is free or ours from an earlier life; False while another daemon holds it."""
        try:
            self.revision = await self.kv.create(self.key, self._value())
        except nats.js.errors.KeyWrongLastSequenceError:
            try:
                entry = await self.kv.get(self.key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return False  # it expired between the two calls: the next try creates it
            holder = orjson.loads(entry.value or b"{}")
            self.holder = holder if isinstance(holder, dict) else {}
            if self.holder.get("instance") != self.instance:
                return False
            try:
                self.revision = await self.kv.update(self.key, self._value(), last=entry.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
        self.renewed = self._clock()
        self.holder = None
        return True

    async def acquire(self) -> None:
        """Wait until the lease is ours (a stop cancels the wait)."""
        announced = False
        while not await self.try_acquire():
            if not announced:
                logger.info("standby: another daemon holds the partition",
                            extra={"fields": {"partition": self.key, "holder": self.holder}})
                announced = True
            await anyio.sleep(min(self.ttl_s / 4, 0.5))  # the retry period: a released lease is taken within it

    async def renew(self) -> None:
        """Write the lease again on the revision we wrote last; LeaseLost if another daemon wrote since."""
        try:
            self.revision = await self.kv.update(self.key, self._value(), last=self.revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError) as exc:
            mine = await self._own_revision()
            if mine is None:
                raise LeaseLost(f"the lease of partition {self.key} changed hands: {exc}") from exc
            # A renewal of ours whose acknowledgement was lost (sent while NATS was away, stored on its return)
            # wrote the revision after the one we know: every write since ours was ours, so the lease still is.
            try:
                self.revision = await self.kv.update(self.key, self._value(), last=mine)
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError) as again:
                raise LeaseLost(f"the lease of partition {self.key} changed hands: {again}") from again
        self.renewed = self._clock()

    async def _own_revision(self) -> int | None:
        """The lease's revision if this very process wrote it (its instance and pid), else None."""
        try:
            entry = await self.kv.get(self.key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None  # expired or released: someone may have held it meanwhile
        holder = orjson.loads(entry.value or b"{}")
        if isinstance(holder, dict) and holder.get("instance") == self.instance and holder.get("pid") == os.getpid():
            return entry.revision
        return None

    async def hold(self) -> None:
        """Renew the lease every third of its TTL until cancelled; LeaseLost once another daemon has taken it.
        A renewal that fails because NATS is away is tried again at the next period: meanwhile `fresh` says no,
        so the holder reads no input another daemon may read."""
        while True:
            await anyio.sleep(self.ttl_s / 3)
            try:
                await self.renew()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                reraise_cancel(exc)
                logger.warning("lease not renewed: retrying", extra={"fields": {"error": repr(exc)}})

    def fresh(self) -> bool:
        """May the holder read input now: renewed within half the TTL?"""
        return self.renewed is not None and self._clock() - self.renewed < self.ttl_s / 2

    async def release(self) -> None:
        """Give the lease up (a graceful stop), so that a standby takes over without waiting out the TTL."""
        if self.revision is None:
            return
        # Someone else holds it already, or NATS is gone: then it expires by itself.
        with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError,
                                 nats.errors.Error):
            await self.kv.delete(self.key, last=self.revision)
        self.revision = None

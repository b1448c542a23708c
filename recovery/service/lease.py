"""Which daemon processes a partition: a lease in a JetStream KV bucket whose entries expire.

Two daemons must never consume one partition's inputs at once: each would apply a different subset of the log
and decide from a state the other never saw. The active daemon holds the key `<partition>` in the lease bucket,
whose entries live `ttl` seconds after their last write, and renews it every `ttl / 3` with a compare-and-set
on the revision it wrote last. A standby tries to create the key every `min(ttl / 4, 0.5 s)` and wins once
the active one has stopped renewing (crashed, partitioned) or released it (a graceful stop deletes the key).

Fencing without synchronised clocks: the holder reads input only while its last successful renewal is younger
than `ttl / 2` on its own monotonic clock, while a standby can take the key only `ttl` after that write. A renewal
whose compare-and-set fails reads the key before it concludes anything (`renew`):

- the key holds this lease's own token: a renewal that timed out was stored after all, and its revision is adopted;
- the key is gone, not deleted (it expired: renewals could not get through for a TTL) and this holder's last
  successful renewal was sent less than `2 * ttl` ago: nobody else can have held it meanwhile (another daemon could
  take it only `ttl` after that renewal, and its own entries, renewed every `ttl / 3` or deleted at its release,
  would still be there), so it is created again;
- the key is gone for longer (a NATS outage of many TTLs, with one daemon or with every daemon cut off alike) but
  nothing was written to the bucket since this holder's last write: its stream's last sequence is still that
  write's, which any other daemon's take would have moved, so it is created again too, and the daemon serves on;
- anything else (another daemon's entry, a delete marker of another's release, a key gone for longer with the
  bucket written since) is a lost
  lease: another daemon may have applied inputs meanwhile, which this one's engine never saw, so it must start
  again from the snapshot rather than carry on (`LeaseLost`, naming the holder).

Duplicate effects of a handover are dropped by their deterministic message ids. The lease has a NATS connection of
its own (`recovery.service.daemon`): a reader that the server cuts off as a slow consumer, or whose replies queue
behind large deliveries, must not take the renewals down with it.

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
import uuid
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
        self.token = uuid.uuid4().hex  # this holder's, in every value it writes: its own writes are recognised
        self.sent: float | None = None  # when the last successful renewal (or the take) was sent

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
        return orjson.dumps({"instance": self.instance, "pid": os.getpid(), "since": time.time_ns(),
                             "token": self.token})

    async def try_acquire(self) -> bool:
        """Take the lease if it is free or ours from an earlier life; False while another daemon holds it."""
        sent = self._clock()
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
        self.renewed, self.sent = self._clock(), sent
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
        """Write the lease again on the revision we wrote last. When that compare-and-set fails, the key says why
        (the module's docstring): our own write, or a lapse nobody else can have used, and the lease is kept;
        LeaseLost if another daemon may have held it since."""
        sent = self._clock()
        try:
            self.revision = await self.kv.update(self.key, self._value(), last=self.revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError) as exc:
            sent = await self._recheck(exc)
        self.renewed, self.sent = self._clock(), sent

    async def _recheck(self, refused: Exception) -> float:
        """After a refused renewal: write the lease again from what the key holds, and return when that write was
        sent (what `fresh` and the next recheck count from); or raise LeaseLost."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyDeletedError as exc:  # released: only a holder releases, and we did not
            raise LeaseLost(f"the lease of partition {self.key} changed hands: released by another daemon "
                            f"({refused})") from exc
        except nats.js.errors.KeyNotFoundError:
            # Measured now, when the key was seen gone (not from the refused write's send): the later, the safer.
            lapsed = self._clock() - self.sent if self.sent is not None else float("inf")
            if lapsed >= 2 * self.ttl_s and not await self._untouched():
                raise LeaseLost(f"the lease of partition {self.key} lapsed {lapsed:.1f}s after its last renewal, "
                                f"and the lease bucket was written since: another daemon may have held it meanwhile "
                                f"({refused})") from refused
            sent = self._clock()
            try:
                self.revision = await self.kv.create(self.key, self._value())
            except nats.js.errors.KeyWrongLastSequenceError:
                return await self._recheck(refused)  # someone took it this instant: who?
            logger.warning("lease expired unrenewed (%.1fs since the last renewal), nobody took it: taken again",
                           lapsed, extra={"fields": {"partition": self.key}})
            return sent
        holder = orjson.loads(entry.value or b"{}")
        if isinstance(holder, dict) and holder.get("token") == self.token:
            # A renewal that timed out here was stored after all. When, nobody knows: written again now, on it.
            sent = self._clock()
            try:
                self.revision = await self.kv.update(self.key, self._value(), last=entry.revision)
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
                return await self._recheck(refused)
            return sent
        self.holder = holder if isinstance(holder, dict) else {}
        raise LeaseLost(f"the lease of partition {self.key} changed hands: held by {self.holder.get('instance')} "
                        f"(pid {self.holder.get('pid')}) ({refused})") from refused

    async def _untouched(self) -> bool:
        """Was nothing written to the lease bucket since this holder's last write? Its entries expire without a
        write, and its stream's last sequence stays where the last write left it: a daemon that took the lease
        meanwhile (and lost it, or let it expire) would have written, and so would a standby's take. With several
        partitions the bucket holds other keys too, whose writes make this say no: the lease is given up, as
        before."""
        try:
            info = await self.js.stream_info(f"KV_{self.bucket}")
        except nats.errors.Error:
            return False
        return self.revision is not None and info.state.last_seq == self.revision

    async def hold(self) -> None:
        """Renew the lease every third of its TTL until cancelled; LeaseLost once another daemon has taken it.
        A renewal that fails because NATS is away (or busy: a 429) is tried again with backoff, within the period:
        meanwhile `fresh` says no, so the holder reads no input another daemon may read."""
        period = self.ttl_s / 3
        delay = period
        while True:
            await anyio.sleep(delay)
            try:
                await self.renew()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                reraise_cancel(exc)
                logger.warning("lease not renewed: retrying", extra={"fields": {"error": repr(exc)}})
                delay = min(period / 8 if delay >= period else delay * 2, period / 2)  # retry backoff
                continue
            delay = period

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

"""The daemon's NATS connection and what it does when the connection drops and comes back (`Daemon` is one): a
drop ends the consumer's pull requests and starts an outage (`recovery.service.outage`); the return makes the
consumer again and has the outage logged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.js import JetStreamContext

from recovery.log.refusals import Refusals
from recovery.service import connection
from recovery.service.publisher import Publisher

if TYPE_CHECKING:
    from recovery.service.http import Metrics
    from recovery.service.outage import OutageRecorder
    from recovery.service.timers import TimerService

logger = logging.getLogger("recovery.daemon")


class ConnectionEvents:
    """The connection of a daemon, and its handlers of the client's events."""

    url: str
    nc: Client | None
    js: JetStreamContext | None
    publisher: Publisher | None
    connected: bool
    role: str
    _reader_ok: bool
    refusals: Refusals
    metrics: Metrics
    outage: OutageRecorder
    timer_service: TimerService

    @property
    def stopping(self) -> bool:
        raise NotImplementedError

    async def _connect(self) -> None:
        self.nc = await connection.connect(self.url, self._on_disconnected, self._on_reconnected, self._on_error)
        self.connected = True
        self.js = self.nc.jetstream(timeout=5.0, publish_async_max_pending=20_000)
        self.publisher = Publisher(self.js)
        url = self.nc.connected_url.netloc if self.nc.connected_url else self.url
        logger.info("connected", extra={"fields": {"url": url}})

    async def _on_disconnected(self) -> None:
        if self.connected and not self.stopping:
            logger.warning("disconnected from NATS")
        self.connected = False
        self._reader_ok = False
        if self.stopping:
            return  # the daemon's own close, or a deposed daemon's: no outage
        # A standby's outage too: after an outage of all of NATS it is often the one that takes the lease.
        self.outage.disconnected()
        if self.role == "active":
            self.timer_service.interrupt()

    async def _on_reconnected(self) -> None:
        self.connected = True
        self._reader_ok = False  # pull requests died with the connection: re-create the consumer
        self.metrics.reconnects.inc()
        self.outage.reconnected()
        logger.info("reconnected to NATS", extra={"fields": {
            "url": self.nc.connected_url.netloc if self.nc and self.nc.connected_url else "?"}})

    async def _on_error(self, exc: Exception) -> None:
        if not self.refusals.seen(exc):  # a refused publish is the credentials' fault, not the network's: an error
            logger.debug("nats error", extra={"fields": {"error": repr(exc)}})

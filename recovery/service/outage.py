"""The daemon's own outages: the time it was cut off from NATS, logged when it is back, before any timer.

While the daemon's connection is down nothing reaches the log: not the agents' events (they wait in the agents'
outboxes), not the timer firings. When it is back, the timers that fell due meanwhile would land first and judge
every node and rank silent for the whole outage: a healthy job restarted for the control plane's fault. So the
party whose connection broke says so: before the timer service fires anything again, the daemon publishes a
`control.outage` of each job it watches, with how long it was away (its own monotonic clock) and the bound the
platform sets (`outage_bound_s`), and the engine counts no silence within an outage inside the bound
(`recovery.core.liveness`). The measure and the bound are in the log, so a replay judges every silence as the daemon
did.

The outage is measured from the moment the client reports the connection lost (a server that stops or restarts is
seen at once; a network that silently drops everything only after the client's pings go unanswered) to the moment
the records are made; an outage that comes again while they are being published is logged again, whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.core.engine import Engine
from recovery.service.publisher import Outgoing

logger = logging.getLogger("recovery.daemon")

SOURCE = "recovery-daemon/outage"
POLL_S = 0.05
"""how often a held timer service looks whether the connection is back"""
WATCHED = ("running", "recovering")
"""the states of a job whose silence the engine judges"""


class OutageRecorder:
    """Keeps the daemon's outage from the connection's loss (`disconnected`) until it is in the log (`clear`, which
    the timer service awaits before each firing). `connected` reads the connection, `may_publish` whether this
    daemon may write inputs now (its lease is fresh), `publish` sends messages until acknowledged (TimeoutError at
    its deadline), `seal` makes each message id (`recovery.service.seal`)."""

    def __init__(self, engine: Callable[[], Engine], publish: Callable[[list[Outgoing]], Awaitable[None]],
                 seal: Callable[[str], str], bound_s: float, connected: Callable[[], bool],
                 may_publish: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], int] = time.time_ns) -> None:
        self.engine = engine
        self.publish = publish
        self.seal = seal
        self.bound_s = bound_s
        self.connected = connected
        self.may_publish = may_publish
        self.clock = clock
        self.wall = wall
        self._since: float | None = None  # when the connection was lost, until the outage is in the log
        self._since_wall = 0  # the same moment on the wall clock: part of the records' ids
        self._cuts = 0  # connections lost in this outage: a record made before the last one is not the whole outage

    @property
    def pending(self) -> bool:
        return self._since is not None

    def disconnected(self) -> None:
        if self._since is None:
            self._since, self._since_wall = self.clock(), self.wall()
        self._cuts += 1

    def messages(self) -> list[Outgoing]:
        """A `control.outage` for each job whose silence the engine judges, away since the connection was lost."""
        assert self._since is not None
        away = round(self.clock() - self._since, 3)
        out = []
        for job_id, job in self.engine().jobs.items():
            if job.state not in WATCHED:
                continue
            ident = f"outage:{job_id}:{self._since_wall}:{self._cuts}"
            envelope = make_envelope("control.outage", {"away_s": away, "bound_s": self.bound_s}, id=ident,
                                     job=job_id, source=SOURCE)
            out.append(Outgoing(subjects.job_event(job_id, "control.outage"), encode_envelope(envelope),
                                self.seal(ident), "input"))
        return out

    async def clear(self) -> None:
        """Return once the daemon is connected and its last outage is in the log."""
        while self._since is not None or not self.connected():
            if not self.connected() or not self.may_publish():
                await anyio.sleep(POLL_S)  # waiting for the reconnect the client does by itself, or the lease
                continue
            cuts = self._cuts
            out = self.messages()
            try:
                await self.publish(out)
            except TimeoutError:
                continue  # not acknowledged in time: again, measured anew (the ids stay, a repeat is dropped)
            if cuts == self._cuts:
                logger.info("control plane outage logged", extra={"fields": {
                    "away_s": round(self.clock() - self._since, 3) if self._since else None, "jobs": len(out),
                    "bound_s": self.bound_s}})
                self._since = None
                self._cuts = 0

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

An outage may outlive the daemon that saw it: one longer than the lease's lapse rule deposes it (it stops, and its
supervisor starts it again), and a stop or a kill during an outage ends it too. So the outage not yet logged is kept
in the data directory (`outage-<partition>.json`: its start and its return on the wall clock, the cuts), written
atomically at each cut and return and removed once the records are acknowledged; the next daemon on the directory
(the lock makes it the only one) reads it at its start and measures the outage on, on the wall clock across the
change of process. A standby whose own connection was cut keeps its outage too: after an outage of all of NATS it is
often the one that takes the lease, and it saw what the deposed daemon saw.

Either logs it only if it takes the partition within `takeover_window_s` of the outage's end (`took_over`). The
outage's own daemon would have logged it then; later, another daemon has held the partition meanwhile (or none did
for long), the outage is old news, and a record would excuse silence that another daemon judged. Within the window,
a record that turns out redundant (the outage was logged by the daemon that held the lease) excuses at most the
window's time beyond the outage, as a late record always did. A kept outage already past the bound when read is
dropped: the engine would count its silence anyway. An unreadable file is dropped, and said so.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import orjson

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
TAKEOVER_TTLS = 3.0
"""a takeover caused by an outage comes within this many lease TTLs of its end: the deposed holder's renewal fails
within a third of a TTL of the return, and the key it let lapse is free at once, or a TTL after its last write"""
TAKEOVER_MIN_S = 30.0
"""and within this much, whatever the TTL: a deposed daemon's stop, its supervisor's restart (systemd's, a pod's first
back-off of 10 s) and its start take seconds"""


def takeover_window_s(lease_ttl_s: float) -> float:
    """How long after an outage's end a daemon that takes the partition still logs the outage it saw."""
    return max(TAKEOVER_TTLS * lease_ttl_s, TAKEOVER_MIN_S)


def pending_path(data_dir: Path, partition: str) -> Path:
    """Where a daemon of `partition` keeps its outage not yet logged."""
    return data_dir / f"outage-{partition.replace('/', '_')}.json"


class OutageRecorder:
    """Keeps the daemon's outage from the connection's loss (`disconnected`) until it is in the log (`clear`, which
    the timer service awaits before each firing). `connected` reads the connection, `may_publish` whether this
    daemon may write inputs now (its lease is fresh, its engine caught up with the log), `publish` sends messages
    until acknowledged (TimeoutError at its deadline), `seal` makes each message id (`recovery.service.seal`).
    `path`, when given, keeps the outage across processes; `window_s` is `takeover_window_s`; `active` whether the
    daemon holds its partition already (else `took_over` says when it does)."""

    def __init__(self, engine: Callable[[], Engine], publish: Callable[[list[Outgoing]], Awaitable[None]],
                 seal: Callable[[str], str], bound_s: float, connected: Callable[[], bool],
                 may_publish: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], int] = time.time_ns, path: Path | None = None,
                 window_s: float = TAKEOVER_MIN_S, active: bool = True) -> None:
        self.engine = engine
        self.publish = publish
        self.seal = seal
        self.bound_s = bound_s
        self.connected = connected
        self.may_publish = may_publish
        self.clock = clock
        self.wall = wall
        self.path = path
        self.window_s = window_s
        self.active = active  # the daemon holds the partition: every outage is logged, however long ago it ended
        self._since: float | None = None  # when the connection was lost, until the outage is in the log
        self._since_wall = 0  # the same moment on the wall clock: part of the records' ids
        self._cuts = 0  # connections lost in this outage: a record made before the last one is not the whole outage
        self._back: float | None = None  # when the connection came back, while the outage is not in the log

    @property
    def pending(self) -> bool:
        return self._since is not None

    def disconnected(self) -> None:
        if self._since is not None and not self.active and self._ended_long_ago():
            self._forget("a new outage began long after it ended")  # a standby's old outage is not this one
        if self._since is None:
            self._since, self._since_wall = self.clock(), self.wall()
        self._cuts += 1
        self._back = None
        self._keep()

    def reconnected(self) -> None:
        if self._since is not None:
            self._back = self.clock()
            self._keep()

    def recover(self) -> None:
        """Read the outage a predecessor on this data directory kept (deposed, killed or stopped before it was
        logged), once connected: measured on from its start on the wall clock; if the predecessor never saw NATS
        again, the outage ended when this daemon connected, now."""
        if self.path is None or self._since is not None:
            return
        try:
            kept = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as exc:
            self._drop_file(f"unreadable: {exc}")
            return
        now_wall, now = self.wall(), self.clock()
        since_wall, back_wall, cuts = (kept.get(k) for k in ("since_wall_ns", "back_wall_ns", "cuts")) if isinstance(
            kept, dict) else (None, None, None)
        if not (isinstance(since_wall, int) and isinstance(cuts, int) and cuts > 0 and since_wall <= now_wall
                and (back_wall is None or (isinstance(back_wall, int) and since_wall <= back_wall <= now_wall))):
            self._drop_file(f"not an outage this daemon can measure (the wall clock went back?): {kept!r}")
            return
        away_s = (now_wall - since_wall) / 1e9
        if away_s > self.bound_s:  # the engine counts its silence anyway: nothing to log, and nothing to wait for
            self._drop_file(f"it began {away_s:.0f}s ago, past the {self.bound_s:g}s bound")
            return
        self._since, self._since_wall, self._cuts = now - away_s, since_wall, cuts
        self._back = now if back_wall is None else now - (now_wall - back_wall) / 1e9
        logger.info("control plane outage kept by an earlier daemon", extra={"fields": {
            "away_s": round(away_s, 3), "cuts": cuts, "ended_s_ago": round(now - self._back, 3)}})

    def took_over(self) -> None:
        """This daemon holds the partition now: the outage it saw or recovered is logged if it ended within the
        window (or has not ended), and dropped otherwise. Nothing changes for a daemon that held it already."""
        if self.active:
            return
        self.active = True
        if self._since is not None and self._ended_long_ago():
            self._forget(f"it ended more than {self.window_s:g}s before this daemon took the partition")

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
                self._since = self._back = None
                self._cuts = 0
                self._drop_file(None)

    def _ended_long_ago(self) -> bool:
        return self._back is not None and self.clock() - self._back > self.window_s

    def _forget(self, why: str) -> None:
        logger.info("control plane outage not logged: " + why, extra={"fields": {
            "away_s": round(self.clock() - self._since, 3) if self._since is not None else None}})
        self._since = self._back = None
        self._cuts = 0
        self._drop_file(None)

    def _keep(self) -> None:
        """Write the outage to its file, whole or not at all: a crash mid-write leaves the previous one."""
        if self.path is None or self._since is None:
            return
        back = None if self._back is None else self.wall() - int((self.clock() - self._back) * 1e9)
        data = orjson.dumps({"since_wall_ns": self._since_wall, "back_wall_ns": back, "cuts": self._cuts,
                             "pid": os.getpid()})
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            with temporary.open("wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except OSError as exc:  # a full or read-only disk: the outage is still logged by this process
            logger.warning("control plane outage not kept in the data directory", extra={"fields": {
                "path": str(self.path), "error": repr(exc)}})

    def _drop_file(self, why: str | None) -> None:
        if self.path is None:
            return
        if why is not None:
            logger.warning("control plane outage kept by an earlier daemon dropped: " + why, extra={"fields": {
                "path": str(self.path)}})
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:  # the timers must not wait on a file: a stale one is judged at the next start
            logger.warning("control plane outage file not removed", extra={"fields": {
                "path": str(self.path), "error": repr(exc)}})

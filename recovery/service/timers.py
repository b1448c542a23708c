"""The daemon's timer service: the engine's timers fired as `timer.fired` events on the wall clock.

The processor's `TimerTable` (kept by the effect router, as every driver's is) says what is armed and when; this
service is the only place wall time enters. It fires each timer when the server's clock reaches its due time, with
the id `timer:<timer id>:<due>` (so that a re-fire after a crash is a duplicate), and the engine sees the firing as
an input record with the log's own timestamp.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import anyio

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.core.router import EffectRouter
from recovery.core.timers import Firing, TimerTable
from recovery.service.publisher import Outgoing, Publisher

logger = logging.getLogger("recovery.daemon")  # a firing that cannot be made is the daemon's line, as before

MAX_SLEEP_S = 1.0
"""the longest the service sleeps without looking at its table again"""
HOLD_S = 10.0
"""how long a job's watchdog tick waits at most for the watch summary published before it (`TimerService.hold`): a
summary is applied within this unless the daemon is far behind the log (or the summary was lost, `release`)"""
HOLD_LOOK_S = 0.1
"""how often a held tick looks whether its job's summary was applied"""


class ServerClock:
    """The NATS server's clock, as seen from here: the local clock plus an offset estimated from the log's own
    timestamps. A timer's due time is server time (the log time of the decision that asked for it); firing it on
    a local clock that runs 5 s fast would confirm a link debounce 5 s early. Each live delivery gives
    `server_ts - local_now` = skew - transit; the largest in a recent window has the least transit in it. Only
    deliveries read once caught up count: a replayed backlog's timestamps are old, not skewed."""

    LIMIT_NS = 60 * 1_000_000_000
    """offsets are clamped to this: a larger skew is a misconfigured host, and a backlog delivered after an
    outage must not hold every timer back by its age"""

    def __init__(self, window: int = 512, local: Callable[[], int] = time.time_ns) -> None:
        self._window = window
        self._local = local
        self._count = 0
        # (index, sample) of the samples that may still become the window's largest, largest first: each sample
        # enters and leaves once, so a live daemon pays O(1) per delivery, not a scan of the window whenever the
        # largest leaves it (which, with a growing backlog, is every delivery).
        self._candidates: deque[tuple[int, int]] = deque()
        self.offset_ns = 0

    def observe(self, server_ts: int) -> None:
        index = self._count
        self._count = index + 1
        sample = server_ts - self._local()
        candidates = self._candidates
        while candidates and candidates[-1][1] <= sample:
            candidates.pop()
        candidates.append((index, sample))
        if candidates[0][0] <= index - self._window:
            candidates.popleft()
        self.offset_ns = max(-self.LIMIT_NS, min(self.LIMIT_NS, candidates[0][1]))

    def __call__(self) -> int:
        return self._local() + self.offset_ns


class TimerService:
    """Fires the timers of `router`'s table when `clock` reaches their due time, through `fire` (which publishes
    them and, if it cannot, puts them back with `TimerTable.retry`). The engine's own table is the truth at firing
    time: a timer it no longer holds at that due is not fired, and the table follows the engine.

    `gate`, awaited before each firing, holds the service while the daemon is cut off from NATS and until its outage
    is in the log (`recovery.service.outage`): a timer that fell due meanwhile must land after that record.
    `interrupt` gives up a firing under way when the connection is lost, so that the client does not keep it to
    send first on its return; the timers are fired again once the gate opens."""

    def __init__(self, router: EffectRouter, fire: Callable[[list[Firing]], Awaitable[None]],
                 clock: Callable[[], int] = time.time_ns, gate: Callable[[], Awaitable[None]] | None = None) -> None:
        self._router = router
        self._fire = fire
        self._clock = clock
        self.gate = gate
        self._wake: anyio.Event | None = None  # set to look at the table again before the sleep is over
        self._asleep_until: int | None = None  # due time the service sleeps towards, while it sleeps
        self._firing: anyio.CancelScope | None = None  # the firing under way
        self._holds: dict[str, tuple[int, str, int, int]] = {}
        """job -> (until when, watchdog, due, its watch summaries applied then): its watchdog's tick at that due waits
        for the next summary to be applied (`hold`)"""
        self._prune_at = 4096

    def hold(self, jobs: Iterable[str]) -> None:
        """Watch summaries of `jobs` are on their way into the log, and each moves its job's watchdog once applied
        (`recovery.core.detection`): a tick sent meanwhile would land after the summary, early for the watchdog it
        moved, and be refused as a forgery would. So each of their watchdogs' ticks, as due now, waits until a watch
        summary of the job is applied (the tick has moved then, and the table follows; or it has not, and it fires),
        or HOLD_S at most."""
        now, engine, holds, applied = self._clock(), self._router.engine, self._holds, self._router.watches
        until = now + int(HOLD_S * 1e9)
        for job_id in jobs:
            job = engine.jobs.get(job_id)
            watchdog = job.watchdog if job is not None else None
            entry = engine.timers.get(watchdog) if watchdog is not None else None
            if watchdog is not None and entry is not None:
                holds[job_id] = (until, watchdog, entry[1], applied.get(job_id, 0))
        if len(holds) > self._prune_at:  # jobs that ended, or whose tick was not due: their holds are long over
            self._holds = {job: held for job, held in holds.items() if held[0] > now}
            self._prune_at = 2 * len(self._holds) + 4096

    def release(self, jobs: Iterable[str]) -> None:
        """The watch summaries of `jobs` were not stored: their watchdogs' ticks wait no more."""
        now, table = self._clock(), self._router.timers
        for job in jobs:
            held = self._holds.pop(job, None)
            if held is not None and held[2] <= now:  # due already, so held back: it goes now
                table.defer(Firing(held[1], job, held[2]), now)
                if self._wake is not None:
                    self._wake.set()

    def due(self, now: int) -> list[Firing]:
        """Take the timers due at `now` that the engine still holds at their due time."""
        table, engine_timers, holds = self._router.timers, self._router.engine.timers, self._holds
        out = []
        for firing in table.due(now):
            entry = engine_timers.get(firing.timer_id)
            if entry is not None and entry[1] == firing.due:
                held = holds.get(firing.job)
                if (held is not None and held[0] > now and held[1:3] == (firing.timer_id, firing.due)
                        and self._router.watches.get(firing.job, 0) == held[3]):
                    # Its summary is not applied yet: looked at again shortly (applied, it moves the tick, or not).
                    table.defer(firing, min(held[0], now + int(HOLD_LOOK_S * 1e9)))
                    continue
                out.append(firing)
            elif entry is None:
                table.cancel(firing.timer_id)
            else:
                table.arm(firing.timer_id, *entry)  # moved by a firing the table has not seen: follow the engine
        return out

    def reschedule(self) -> None:
        """Look at the table again now if a timer due before the one the service sleeps towards was armed."""
        asleep_until = self._asleep_until
        if asleep_until is not None and self._wake is not None:
            next_at = self._router.timers.next_at()
            if next_at is not None and next_at < asleep_until:
                self._wake.set()

    def describe(self) -> dict[str, object]:
        return self._router.timers.describe()

    def interrupt(self) -> None:
        """Give up the firing under way (the connection is lost): its timers are fired again later."""
        if self._firing is not None:
            self._firing.cancel()

    async def run(self) -> None:
        """Fire timers as they fall due, until cancelled."""
        table = self._router.timers
        while True:
            if self.gate is not None:
                await self.gate()
            now = self._clock()
            fired = self.due(now)
            if fired:
                with anyio.CancelScope() as scope:
                    self._firing = scope
                    await self._fire(fired)
                self._firing = None
                if scope.cancelled_caught:
                    for firing in fired:
                        table.retry(firing)  # its id makes a repeat harmless, should it have landed after all
                continue
            next_at = table.next_at()
            if next_at is None:
                wait, self._asleep_until = MAX_SLEEP_S, now + int(MAX_SLEEP_S * 1e9)
            else:
                wait = min(max((next_at - now) / 1e9, 0.0), MAX_SLEEP_S)
                self._asleep_until = min(next_at, now + int(MAX_SLEEP_S * 1e9))
            self._wake = wake = anyio.Event()
            with anyio.move_on_after(wait):
                await wake.wait()
            self._asleep_until = None


async def fire_through(publisher: Publisher, seal: Callable[[str], str], table: TimerTable, fired: list[Firing]
                       ) -> int:
    """Publish the firings of `fired` (`timer_messages`), or put them back in `table` if they are not acknowledged
    within 30 s: their ids make a repeat harmless. How many were published."""
    out = timer_messages(fired, seal)
    try:
        await publisher.publish(out, deadline=time.monotonic() + 30)
    except TimeoutError:
        for firing in fired:
            table.retry(firing)
        return 0
    return len(out)


def timer_messages(fired: list[Firing], seal: Callable[[str], str]) -> list[Outgoing]:
    """The `timer.fired` events of `fired`, each under its deterministic id (`timer:<timer id>:<due>`), so that a
    re-fire after a crash is a duplicate; `seal` makes the message id (`recovery.service.seal`)."""
    out = []
    for firing in fired:
        ident = f"timer:{firing.timer_id}:{firing.due}"
        if firing.refired_at is not None:
            ident += f":{firing.refired_at}"  # not the refused firing's id, or the duplicate window drops it
        try:
            envelope = make_envelope("timer.fired", {"timer_id": firing.timer_id, "due": firing.due}, id=ident,
                                     job=firing.job, source="recovery-daemon/timers")
        except ValueError:  # pydantic's ValidationError: an id the envelope cannot carry; never fires
            logger.exception("cannot fire timer", extra={"fields": {"timer_id": firing.timer_id, "job": firing.job}})
            continue
        out.append(Outgoing(subjects.job_event(firing.job, "timer.fired"), encode_envelope(envelope),
                            seal(ident), "timer"))
    return out

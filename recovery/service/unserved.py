"""The daemon's word about jobs that cannot start: a job accepted onto nodes that no agent serves (none ever heard
from, or declared gone) waits in `submitted` with none of its ranks alive, and nothing in the log said why.

After `unserved_after_s` of such waiting, the daemon publishes a `job.unserved` input naming the nodes, as its timer
service publishes timer firings: the engine answers it with a `job.unserved` decision (`recovery.core.operators`).
Time is measured here, in the I/O shell, and enters the log as an event: the engine stays a function of the log, and
a log from before this event existed replays as it did. Each job is reported once per set of nodes (a message id of
the job and the nodes, so that a restarted daemon's second report is a duplicate).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.core.engine import Engine
from recovery.service.fleet import unserved
from recovery.service.publisher import Outgoing

logger = logging.getLogger("recovery.daemon")

SOURCE = "recovery-daemon/unserved"


class UnservedWatch:
    """Finds the jobs waiting to start on nodes no agent serves (`due`), and reports them (`run`)."""

    def __init__(self, engine: Callable[[], Engine], publish: Callable[[list[Outgoing]], Awaitable[None]],
                 seal: Callable[[str], str], after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.publish = publish
        self.seal = seal
        self.after_s = after_s
        self.clock = clock
        self._since: dict[str, float] = {}  # job -> when it was first seen waiting on unserved nodes
        self._reported: dict[str, tuple[str, ...]] = {}  # job -> the nodes last reported

    def due(self) -> list[tuple[str, list[str], float]]:
        """(job, its unserved nodes, seconds waited) for each job that waited `after_s` on nodes not yet reported."""
        engine, now = self.engine(), self.clock()
        out = []
        waiting = set()
        for job_id, job in engine.jobs.items():
            if job.state != "submitted":
                continue
            nodes = unserved(engine, job.nodes)
            if not nodes:
                continue
            waiting.add(job_id)
            since = self._since.setdefault(job_id, now)
            if now - since >= self.after_s and self._reported.get(job_id) != tuple(nodes):
                self._reported[job_id] = tuple(nodes)
                out.append((job_id, nodes, round(now - since, 3)))
        for job_id in [j for j in self._since if j not in waiting]:  # started, ended or served meanwhile
            del self._since[job_id]
            self._reported.pop(job_id, None)
        return out

    def messages(self, due: list[tuple[str, list[str], float]]) -> list[Outgoing]:
        out = []
        for job, nodes, waited in due:
            digest = hashlib.sha256(" ".join(nodes).encode()).hexdigest()[:16]
            ident = f"unserved:{job}:{digest}"
            envelope = make_envelope("job.unserved", {"nodes": nodes[:4096], "waited_s": waited}, id=ident, job=job,
                                     source=SOURCE)
            out.append(Outgoing(subjects.job_event(job, "job.unserved"), encode_envelope(envelope), self.seal(ident),
                                "input"))
            logger.warning("job waits on nodes no agent serves", extra={"fields": {
                "job": job, "nodes": nodes[:16], "count": len(nodes), "waited_s": waited}})
        return out

    async def run(self, period_s: float | None = None) -> None:
        """Check every `period_s` (a fifth of `after_s` by default), forever."""
        period = period_s if period_s is not None else max(0.2, self.after_s / 5)
        while True:
            await anyio.sleep(period)  # the check's period: a report comes at most this late
            due = self.due()
            if due:
                try:
                    await self.publish(self.messages(due))
                except Exception:  # NATS away: report again once it is back
                    logger.warning("could not report the jobs waiting on unserved nodes; retrying", exc_info=True)
                    for job, _, _ in due:
                        self._reported.pop(job, None)

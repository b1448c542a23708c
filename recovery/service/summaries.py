"""The daemon's progress summaries: a healthy job's periodic reports kept off the log, one record a period in it.

An agent with `progress = "summary"` sends its ranks' periodic report (`progress.report`, its fold of a period) on
core NATS (`recovery.progress.<node>`, a subject no stream captures) instead of into the log. What is news still goes
into the log at once, as before: a rank's first word or first step in a generation (the progress a recovery waits
for), a loss that may be a bad step, and the fold that precedes any change (a process start or exit, a checkpoint,
an ack). This part of the active daemon, run by its liveness monitor, keeps each rank's newest word and writes one
`progress.summary` per job every `progress_summary_s`: each rank heard in the period, with its newest step, its
compute times summed over the period, its worst loss, and how long before the record it was heard (`heard_s`), so
that the engine takes the rank as seen then and its silence is measured as before.

A node's report speaks only for the ranks the engine places on that node: a report for another node's ranks, or
one that does not parse, is dropped here with a log line (it is not in the log, so it decides nothing); one of a job
the daemon does not hold (another partition's: every daemon hears every node) is ignored. The engine leaves out
whatever a summary says that is past (`recovery.core.progress`), so a summary written late, or by a daemon that took
the partition over, changes nothing that a newer record set.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import orjson
from nats.aio.client import Client
from pydantic import ValidationError

from events import kinds, subjects
from events.envelope import make_envelope
from events.values import MAX_RANKS, MAX_SAFE_INT, MAX_SECONDS
from policies.base import NS
from recovery.core.engine import Engine
from recovery.core.machine import FINAL
from recovery.service.publisher import Outgoing
from recovery.service.shared import SharedSubscription

logger = logging.getLogger("recovery.daemon")

SOURCE = "recovery-daemon/summaries"
_PREFIX = subjects.reports("")
PAYLOAD_SHARE = 0.5
"""a summary record is cut at this share of the server's payload limit (a 131,072-rank job's summary is several
records)"""
ENTRY_BYTES = 200
"""what an entry is taken to cost, at most, when a summary is cut, but for the data its script named for a loss (a
plain one is under 100 bytes)"""


@dataclass(slots=True)
class _Heard:
    """A rank's newest word in the period: its generation, newest step, compute time in all, worst loss."""

    attempt: int
    step: int | None
    at: float
    compute_ns: int = 0
    compute_steps: int = 0
    loss: float | str | None = None
    loss_step: int | None = None
    skip: tuple[str, ...] = ()


class ProgressSummaries:
    """Hears the agents' periodic reports (`hear`) and makes each job's summary of them (`messages`)."""

    def __init__(self, engine: Callable[[], Engine], period_s: float, clock: Callable[[], float] = time.monotonic,
                 max_payload: int = 1 << 20, watching: Holds | None = None) -> None:
        self.engine = engine
        self.period_s = period_s
        self.clock = clock
        self.max_payload = max_payload
        self.watching = watching
        """told the jobs whose watch summaries `messages` made, before they are published: their watchdogs' ticks
        wait for them (`recovery.service.timers.TimerService.hold`), or no more if they could not be stored"""
        self.watched: list[str] = []  # the jobs of the watch summaries `messages` made last
        self.heard: dict[str, dict[int, _Heard]] = {}  # job -> rank -> its newest word in the period
        self.due: dict[str, float] = {}  # job -> when its summary goes
        self.dropped = 0
        self.ignored = 0  # reports of jobs this daemon does not hold
        self._boot = uuid.uuid4().hex[:12]  # ids of this monitor's records: no other daemon's repeat them
        self._count = 0

    def hear(self, subject: str, payload: bytes) -> None:
        """One node's periodic report, from `recovery.progress.<node>`."""
        node = subject[len(_PREFIX):]
        try:
            raw = orjson.loads(payload)
            if not isinstance(raw, dict) or raw.get("type") != "progress.report" or not isinstance(raw.get("job"), str):
                raise ValueError("not a job's progress.report envelope")
            job_id = raw["job"]
            job = self.engine().jobs.get(job_id)
            if job is None or job.state in FINAL:  # another partition's job (every daemon hears every node), or
                self.ignored += 1  # one that ended: its last words decide nothing
                return
            if raw.get("node") != node:
                raise ValueError(f"sent on {node}'s subject for node {raw.get('node')!r}")
            entries = _entries(raw.get("data"))
        except (ValueError, ValidationError) as exc:
            self._drop(node, None, f"not a progress report of its own: {str(exc)[:200]}")
            return
        now, world, rpn, placed = self.clock(), job.world, job.rpn, job.nodes
        ranks = self.heard.get(job_id)
        if ranks is None:
            ranks = self.heard[job_id] = {}
            if job_id not in self.due:  # a period from its first report heard
                self.due[job_id] = now + self.period_of(job_id)
        for entry in entries:
            rank = entry.rank
            if rank >= world or rank // rpn >= len(placed) or placed[rank // rpn] != node:
                self._drop(node, job_id, f"rank {rank} is not on {node}")
                continue
            kept = ranks.get(rank)
            if kept is None or entry.attempt > kept.attempt:
                kept = ranks[rank] = _Heard(entry.attempt, entry.step, now)
            elif entry.attempt < kept.attempt:
                continue  # a word of an older generation, heard late
            else:
                kept.at = now
                if entry.step is not None and (kept.step is None or entry.step > kept.step):
                    kept.step = entry.step
            if entry.compute_s is not None and entry.compute_steps:
                kept.compute_ns += round(entry.compute_s * NS) * entry.compute_steps
                kept.compute_steps += entry.compute_steps
            if entry.loss is not None and (kept.loss is None or _worse(entry.loss, kept.loss)):
                kept.loss, kept.loss_step, kept.skip = entry.loss, entry.loss_step, tuple(entry.skip)

    def _drop(self, node: str, job: str | None, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:  # a misbehaving agent must not flood the daemon's log
            logger.warning("progress report dropped", extra={"fields": {"node": node, "job": job, "why": why,
                                                                         "dropped": self.dropped}})

    def period_of(self, job_id: str) -> float:
        """How often `job_id`'s summary goes: `progress_summary_s`, or half the job's rank silence bound if that is
        shorter (its detection policy's `hang_min_silence_s`). Between two summaries the engine holds a healthy rank
        as last seen up to a period and a report before: under the bound, never taken for a silence."""
        job = self.engine().jobs.get(job_id)
        bound = getattr(getattr(job.policies.detection, "params", None), "hang_min_silence_s", None) if job else None
        return min(self.period_s, bound / 2) if isinstance(bound, int | float) and bound > 0 else self.period_s

    def messages(self, force: bool = False) -> list[Outgoing]:
        """The summaries due now (all, with `force`): each job's of its period (several records for a job too large
        for one), which starts the job's next period."""
        now, heard, due = self.clock(), self.heard, self.due
        out: list[Outgoing] = []
        watched: list[str] = []
        budget = int(self.max_payload * PAYLOAD_SHARE)
        for job_id in sorted(heard):
            if now < due.get(job_id, now) and not force:
                continue
            period = self.period_of(job_id)
            due[job_id] = now + period
            ranks = heard.pop(job_id)
            entries: list[dict[str, Any]] = []
            size = 0
            for rank in sorted(ranks):
                kept = ranks[rank]
                # An entry is under ENTRY_BYTES but for the data its script named for a loss (MAX_SKIP names).
                size += ENTRY_BYTES + (sum(len(name) + 4 for name in kept.skip) if kept.skip else 0)
                if entries and (size > budget or len(entries) >= kinds.MAX_SUMMARIZED_RANKS):
                    out.append(self._record(job_id, entries, period))
                    entries, size = [], ENTRY_BYTES
                entries.append(_entry(rank, kept, now))
            if entries:  # its last record stands for the job's watchdog tick (`ProgressSummary.watch`)
                out.append(self._record(job_id, entries, period, watch=True))
                watched.append(job_id)
        if len(due) > 2 * len(heard) + 1024:  # the jobs that ended, or report no more
            self.due = {job: at for job, at in due.items() if job in heard or at > now}
        self.watched = watched
        if watched and self.watching is not None:
            self.watching.hold(watched)
        return out

    def look(self, may_write: bool) -> list[Outgoing]:
        """The summaries to publish at a look: none while the daemon may not write (cut off, its lease not fresh, its
        outage not logged, behind the log), and what it hears meanwhile is kept for the first it may. Dropped, a node
        whose report came in that time would be missing from them, its ranks found silent since before it."""
        return self.messages() if may_write else []

    def tick_s(self) -> float:
        """How often the summaries due are looked for: a tenth of the shortest period (0.05 .. 1 s)."""
        return min(max(min((self.period_of(job) for job in self.heard), default=self.period_s) / 10, 0.05), 1.0)

    def _record(self, job: str, entries: list[dict[str, Any]], period: float, watch: bool = False) -> Outgoing:
        self._count += 1
        ident = f"summary:{self._boot}:{self._count}"
        # The envelope of the first entry, validated; the others are built from checked values (`_entries`) and
        # joined to it unvalidated: a model of a summary of 200 ranks cost a millisecond, the engine checks it anyway.
        data: dict[str, Any] = {"ranks": entries[:1], "period_s": float(period), **({"watch": True} if watch else {})}
        head = make_envelope("progress.summary", data, id=ident, job=job, source=SOURCE).model_dump(mode="json",
                                                                                                by_alias=True)
        head["data"]["ranks"] = entries
        return Outgoing(subjects.job_event(job, "progress.summary"), orjson.dumps(head), ident, "input")

    async def run(self, nc: Client, publish: Callable[[list[Outgoing]], Awaitable[None]],
                  may_write: Callable[[], bool]) -> None:
        """Hear the reports and publish each period's summaries while the daemon may write, until cancelled."""
        self.max_payload = nc.max_payload or self.max_payload

        shared = SharedSubscription.of(subjects.REPORTS)  # one per process, however many partitions it serves
        token = await shared.join(nc, self.hear)
        try:
            while True:
                await anyio.sleep(self.tick_s())  # a look at which summaries are due
                out = self.look(may_write())
                if not out:
                    continue
                try:
                    await publish(out)
                except Exception:  # NATS away, not acknowledged: the next period's summary says newer
                    if self.watching is not None:
                        self.watching.release(self.watched)
                    logger.warning("could not log the progress summaries; the next period's say newer",
                                   exc_info=True)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await shared.leave(token)


class Holds(Protocol):
    """Who holds the watchdog ticks of the jobs whose watch summaries are on their way into the log."""

    def hold(self, jobs: Iterable[str]) -> None: ...

    def release(self, jobs: Iterable[str]) -> None: ...


_PLAIN = frozenset({"rank", "step", "attempt", "compute_s", "compute_steps"})


@dataclass(slots=True, frozen=True)
class _Plain:
    """An entry with no loss: the common one, checked here at a tenth of a model's cost."""

    rank: int
    step: int | None
    attempt: int
    compute_s: float | None
    compute_steps: int
    loss: None = None
    loss_step: None = None
    skip: tuple[str, ...] = ()


def _entries(data: Any) -> list[_Plain | kinds.RankProgress]:
    """A report's entries, each within the bounds of `kinds.RankProgress` (ValueError or ValidationError if one is
    not): a plain entry (a rank's step and compute time) checked by hand, any other by the model."""
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not 0 < len(ranks) <= kinds.MAX_REPORTED_RANKS:
        raise ValueError("no ranks")
    out: list[_Plain | kinds.RankProgress] = []
    for entry in ranks:
        if not isinstance(entry, dict) or not _PLAIN.issuperset(entry):
            out.append(kinds.RankProgress.model_validate(entry))
            continue
        rank, step, attempt = entry.get("rank"), entry.get("step"), entry.get("attempt", 0)
        compute, count = entry.get("compute_s"), entry.get("compute_steps", 0)
        if not (_count(rank) and rank < MAX_RANKS and _count(attempt) and (step is None or _count(step))
                and _count(count) and (compute is None or (type(compute) is float and 0 <= compute <= MAX_SECONDS))):
            out.append(kinds.RankProgress.model_validate(entry))  # its error says which bound
            continue
        out.append(_Plain(rank, step, attempt, compute, count))
    return out


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_SAFE_INT  # type: ignore[operator]


def _worse(loss: float | str, than: float | str) -> bool:
    """The agents' rule for the period's worst loss: the first non-finite one, else the highest."""
    if isinstance(than, str):
        return False
    return isinstance(loss, str) or loss > than


def _entry(rank: int, heard: _Heard, now: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "attempt": heard.attempt, "heard_s": round(max(now - heard.at, 0.0), 3)}
    if heard.step is not None:
        entry["step"] = heard.step
    if heard.compute_steps:
        entry["compute_s"] = round(heard.compute_ns / heard.compute_steps / NS, 6)
        entry["compute_steps"] = heard.compute_steps
    if heard.loss is not None:
        entry.update(loss=heard.loss, loss_step=heard.loss_step)
        if heard.skip:
            entry["skip"] = list(heard.skip)
    return entry

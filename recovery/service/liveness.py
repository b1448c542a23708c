"""The daemon's liveness monitor: the nodes' "still alive" kept off the log, their silence written into it.

An agent with `liveness = "live"` beats on core NATS (`recovery.live.<node>`, a subject no stream captures) every
`node_heartbeat_s`, and states the mode once in the log (`node.heartbeat` with `live_s`). A healthy fleet's beats
then cost the log nothing. This monitor, a part of the active daemon beside its timer service, keeps each node's last
beat on its own monotonic clock and writes into the log only what a decision depends on:

- `node.silent {silent_s, bound_s}` when a live node of a job the engine watches (running or recovering) was heard
  from for no longer than the bound the job's detection policy sets (`agent_silence_s`), which the engine takes as
  its watchdog takes an agent whose heartbeats stopped (`recovery.core.liveness`);
- `node.heard` when a live node the engine holds silent, or gone, beats again: a sign of life.

Both are sealed as timer firings are (`recovery.service.seal`, checked by `recovery.core.firings`); agents may not
publish them (`recovery.service.auth`). The engine decides from the records alone, so a replay decides the same.

The monitor's own outage is not the fleet's: it declares nothing while the daemon may not write (cut off from NATS,
its lease not fresh, its outage not yet logged, not caught up with the log), and whenever it may again (a reconnect,
a lease taken, a start) it grants every node a full bound from then before it declares any silent. Its ids are made
from the engine's state (`silent:<node>:<log time it was last heard>`), so that a repeat, or the same silence seen by
a daemon that took the partition over, is one record.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from nats.aio.client import Client

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.core.engine import Engine
from recovery.core.job import Job
from recovery.service.publisher import Outgoing
from recovery.service.reachability import Prober
from recovery.service.shared import SharedSubscription
from recovery.service.summaries import ProgressSummaries

logger = logging.getLogger("recovery.daemon")

SOURCE = "recovery-daemon/liveness"
WATCHED = ("running", "recovering")
"""the states of a job whose nodes' silence the engine judges"""
DEFAULT_BOUND_S = 5.0
"""the bound for a job whose detection policy names no `agent_silence_s` (the built-in's default)"""
MARGIN_S = 0.001
"""a silence is declared this much past the bound, so that the record's rounded `silent_s` is past it too"""
_LIVE_PREFIX = subjects.live("")


def silence_bound(job: Job) -> float:
    """How long a node of `job` may go unheard: its detection policy's `agent_silence_s`."""
    bound = getattr(getattr(job.policies.detection, "params", None), "agent_silence_s", None)
    return float(bound) if isinstance(bound, int | float) and bound > 0 else DEFAULT_BOUND_S


class LivenessMonitor:
    """Hears the live beats (`beat`), and says which nodes fell silent or were heard again (`messages`); `run`
    subscribes and publishes them every `period_s`. `may_judge` says whether the daemon may write now (connected,
    lease fresh, outage logged, caught up); `publish` sends messages until acknowledged (TimeoutError at its
    deadline); `seal` makes each message id."""

    def __init__(self, engine: Callable[[], Engine], publish: Callable[[list[Outgoing]], Awaitable[None]],
                 seal: Callable[[str], str], may_judge: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic, summaries: ProgressSummaries | None = None) -> None:
        self.engine = engine
        self.summaries = summaries  # the ranks' periodic reports, heard beside the beats (`recovery.service.summaries`)
        self.publish = publish
        self.seal = seal
        self.may_judge = may_judge
        self.clock = clock
        self.heard: dict[str, float] = {}  # node -> its last beat (monotonic)
        self._granted: float | None = None  # every node's silence counts from here at the earliest; None: may not judge
        self._declared: dict[str, float] = {}  # node -> when this monitor declared it silent
        self._pending: dict[str, str] = {}  # node -> the id of the fact sent about it, until the engine holds it
        # A node suspected lost is asked at once (`recovery.service.reachability`), not waited out for its bound.
        self.prober = Prober(engine, publish, seal, may_judge, clock)

    def beat(self, node: str) -> None:
        self.heard[node] = self.clock()

    def _on_beat(self, subject: str, _data: bytes) -> None:
        self.heard[subject[len(_LIVE_PREFIX):]] = self.clock()

    def messages(self) -> list[Outgoing]:
        """The facts due now: a `node.silent` for each live node of a watched job unheard past its bound, a
        `node.heard` for each live node the engine holds silent or gone that beat since."""
        now = self.clock()
        if not self.may_judge():
            self._granted = None
            return []
        if self._granted is None:
            self._granted = now  # back (or new): every node has a full bound from now
        granted, engine, heard = self._granted, self.engine(), self.heard
        nodes, out, pending = engine.cluster.nodes, [], {}
        for job in engine.jobs.values():
            if job.state not in WATCHED:
                continue
            bound = silence_bound(job)
            for name in job.nodes:
                node = nodes.get(name)
                if node is None or not node.live or node.silent is not None or node.gone:
                    continue
                silent = now - max(heard.get(name, granted), granted)
                if silent > bound + MARGIN_S:
                    ident = f"silent:{name}:{node.heard}"
                    pending[name] = ident
                    if self._pending.get(name) != ident:
                        self._declared[name] = now
                        out.append(self._fact("node.silent", name, ident,
                                              {"silent_s": round(silent, 3), "bound_s": bound}))
                        logger.warning("node silent", extra={"fields": {"node": name, "job": job.id,
                                                                        "silent_s": round(silent, 3)}})
        for name, node in nodes.items():
            if not node.live or (node.silent is None and not node.gone):
                continue
            at = heard.get(name)
            if at is None or at <= max(granted, self._declared.get(name, -math.inf)):
                continue
            ident = f"heard:{name}:{node.silent if node.silent is not None else 'gone'}:{node.heard}"
            pending[name] = ident
            if self._pending.get(name) != ident:
                since = self._declared.pop(name, None)
                out.append(self._fact("node.heard", name, ident,
                                      {"silent_s": round(at - since, 3) if since is not None else None}))
                logger.info("node heard again", extra={"fields": {"node": name}})
        self._pending = pending
        return out

    def _fact(self, type_: str, node: str, ident: str, data: dict[str, Any]) -> Outgoing:
        envelope = make_envelope(type_, data, id=ident, node=node, source=SOURCE)
        return Outgoing(subjects.node_event(node, type_), encode_envelope(envelope), self.seal(ident), "input")

    def period_s(self) -> float:
        """How often the nodes are looked at: a tenth of the shortest bound (0.05 .. 1 s), so that a silence is
        declared within a tenth of its bound of falling due."""
        engine = self.engine()
        bounds = [silence_bound(job) for job in engine.jobs.values() if job.state in WATCHED]
        return min(max(min(bounds, default=DEFAULT_BOUND_S) / 10, 0.05), 1.0)

    async def run(self, nc: Client) -> None:
        """Hear the beats and publish the facts (and the progress summaries, if asked), probe the nodes of suspected
        losses, until cancelled."""
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.prober.run, nc, self.period_s)
            if self.summaries is not None:
                tasks.start_soon(self.summaries.run, nc, self.publish, self.may_judge)
            await self._watch(nc)

    async def _watch(self, nc: Client) -> None:
        shared = SharedSubscription.of(subjects.LIVE)  # one per process, however many partitions it serves
        token = await shared.join(nc, self._on_beat)
        try:
            while True:
                await anyio.sleep(self.period_s())  # the look's period
                out = self.messages()
                if not out:
                    continue
                try:
                    await self.publish(out)
                except Exception:  # NATS away, not acknowledged: again at the next look (a repeat's id is dropped)
                    logger.warning("could not log the nodes' liveness; retrying", exc_info=True)
                    self._pending.clear()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await shared.leave(token)

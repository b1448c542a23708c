"""The daemon's probes of agents: a node suspected lost is asked at once, not waited out for its silence bound.

A node's loss (a host powered off, its agent and ranks killed) tells nothing itself: the engine learns of it when the
agent's silence passes the job's bound (`agent_silence_s`, 5 s by default), seconds in which every survivor waits.
Something usually suggests it much sooner: a survivor's process group loses a peer's connection (the SDK says so
through its agent, on `recovery.suspect.<node>`), or an incident of a job begins (a stock script's survivors exit on
the closed connection). The daemon then asks each of the job's other agents whether it lives, a core-NATS request on
`recovery.probe.<node>` that every agent answers whatever its liveness mode; NATS itself answers "no responders" at
once when no agent listens there, which is what a dead agent's closed connection leaves. Asked twice more over
`CONFIRM_S` (longer than an agent's reconnection to NATS) with the same answer, the daemon logs `node.unreachable`,
sealed, and the engine's detection policy takes the node as gone (`recovery.core.liveness`). A probe that is merely
not answered in time says nothing: a slow agent is no lost one, and the silence bound decides.

Only a node whose agent answered a probe once (since this daemon started) is ever declared unreachable: an agent of
an older release, or any client that speaks for a node without answering probes, is never taken for a lost one. The
first answers are asked for as the daemon sees a job's nodes, a bounded number per look, so that a fleet's start
costs NATS one request per node.

Like the liveness monitor, the prober declares nothing while the daemon may not write, nor for `GRACE_S` after it may
again (the agents reconnect too); its ids are made from the engine's state (`unreachable:<node>:<job>:<generation>`),
so that a repeat, or the same finding of a daemon that took the partition over, is one record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.core.engine import Engine
from recovery.service.publisher import Outgoing
from recovery.service.shared import SharedSubscription

logger = logging.getLogger("recovery.daemon")

SOURCE = "recovery-daemon/probes"
WATCHED = ("running", "recovering")
ANSWER_S = 1.0
"""how long a probe waits for the agent's answer; past it the probe says nothing (NATS's own "no responders" comes
at once)"""
CONFIRMS = (0.3, 0.7)
"""the waits before the second and the third probe, which must find no agent listening as the first did: an agent
whose connection to NATS dropped is back within them (it waits 0.5 s before it reconnects)"""
CONFIRM_S = sum(CONFIRMS)
GRACE_S = 5.0
"""nothing is declared this long after the daemon may write again (a start, a reconnection): the agents reconnect
after a NATS server's restart too, later than the daemon maybe"""
JUDGE_S = 3.0
"""how long a node is asked while its probes go unanswered in time: past it, the silence bound decides"""
AGAIN_S = 1.0
"""a job's nodes are probed again for another suspicion no sooner than this after the last probe of them ended"""
LEARN_PER_LOOK = 256
"""nodes asked for a first answer per look: a fleet's start spread over its looks"""
CONCURRENT = 128
"""probes in flight at once"""
_SUSPECT_PREFIX = subjects.suspect("")


class Prober:
    """Hears suspicions (`suspect`), and probes the suspected jobs' nodes (`probe_job`); `run` subscribes and looks
    every `period_s` for new incidents and for nodes it has not heard answer yet. `may_judge` says whether the daemon
    may write now; `publish` sends messages until acknowledged; `seal` makes each message id."""

    def __init__(self, engine: Callable[[], Engine], publish: Callable[[list[Outgoing]], Awaitable[None]],
                 seal: Callable[[str], str], may_judge: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.publish = publish
        self.seal = seal
        self.may_judge = may_judge
        self.clock = clock
        self.answering: set[str] = set()  # nodes whose agent answered a probe (membership only)
        self._learning: set[str] = set()  # nodes asked for a first answer, answered or not
        self._asked: dict[tuple[str, int], float] = {}  # (job, generation) -> when its nodes were last probed
        self._incidents: set[tuple[str, str]] = set()  # (job, incident) already probed for
        self._queue: list[tuple[str, str, str | None]] = []  # (job, cause, node that spoke) to probe
        self._woken: anyio.Event | None = None  # made in the event loop that runs the prober
        self._since: float | None = None  # since when the daemon may write (None: it may not)

    def suspect(self, job: str, cause: str, speaker: str | None) -> None:
        self._queue.append((job, cause, speaker))
        if self._woken is not None:
            self._woken.set()

    def _on_suspect(self, subject: str, data: bytes) -> None:
        node = subject[len(_SUSPECT_PREFIX):]
        try:
            said: Any = orjson.loads(data)
            job, rank = str(said["job"]), said.get("rank")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            logger.warning("bad suspicion from %s: %r", node, data[:200])
            return
        self.suspect(job, f"rank {rank} of {job} ({node}) lost a peer's connection", node)

    def judging(self) -> bool:
        """May the daemon write, and has it for `GRACE_S`?"""
        if not self.may_judge():
            self._since = None
            return False
        if self._since is None:
            self._since = self.clock()
        return self.clock() - self._since >= GRACE_S

    def look(self) -> list[str]:
        """Queue the jobs whose incident began since the last look; the nodes to ask for a first answer."""
        engine = self.engine()
        learn: list[str] = []
        for job in engine.jobs.values():
            if job.state not in WATCHED:
                continue
            incident = job.incident
            if incident is not None and (job.id, incident.id) not in self._incidents:
                self._incidents.add((job.id, incident.id))
                self.suspect(job.id, f"incident {incident.id} of {job.id} began", None)
            for name in job.nodes:
                if len(learn) < LEARN_PER_LOOK and name not in self._learning:
                    self._learning.add(name)
                    learn.append(name)
        if len(self._incidents) > len(engine.jobs):  # an ended job's incidents are never probed for again
            self._incidents = {key for key in self._incidents if key[0] in engine.jobs}
        if len(self._asked) > len(engine.jobs):  # a generation's probe limits nothing once `AGAIN_S` passed
            now = self.clock()
            self._asked = {key: at for key, at in self._asked.items() if now - at < AGAIN_S}
        return learn

    async def ask(self, nc: Client, node: str) -> bool | None:
        """True: the agent answered; False: NATS said no one listens; None: no answer in time (or NATS away)."""
        try:
            await nc.request(subjects.probe(node), b"", timeout=ANSWER_S)
        except NoRespondersError:
            return False
        except (NatsTimeout, TimeoutError):
            return None
        except Exception:  # NATS away or closing: no word on the node
            return None
        self.answering.add(node)
        return True

    async def _ask_all(self, nc: Client, nodes: list[str]) -> None:
        """Ask each of `nodes` once (their first answers)."""
        limit = anyio.Semaphore(CONCURRENT)

        async def one(node: str) -> None:
            async with limit:
                await self.ask(nc, node)

        async with anyio.create_task_group() as tasks:
            for node in nodes:
                tasks.start_soon(one, node)

    async def nobody_listens(self, nc: Client, node: str) -> bool:
        """Did NATS say three times, over `CONFIRM_S`, that no agent listens for `node`? A probe not answered in time
        (the subscription of a connection the server is still closing, a slow agent) is asked again, for `JUDGE_S`."""
        deadline, nobody = self.clock() + JUDGE_S, 0
        while self.clock() < deadline:
            answer = await self.ask(nc, node)
            if answer is True:
                return False
            if answer is False:
                if nobody == len(CONFIRMS):
                    return True
                await anyio.sleep(CONFIRMS[nobody])  # the next probe's distance from this one
                nobody += 1
        return False

    async def probe_job(self, nc: Client, job_id: str, cause: str, speaker: str | None) -> list[Outgoing]:
        """Probe the nodes of `job_id` that answered once (but `speaker`, which just spoke): the `node.unreachable`
        facts of those no agent listens for any more."""
        engine = self.engine()
        job = engine.jobs.get(job_id)
        if job is None or job.state not in WATCHED:
            return []
        key, now = (job.id, job.generation), self.clock()
        if speaker is not None and now - self._asked.get(key, -AGAIN_S) < AGAIN_S:
            return []  # the survivors of one loss say so together: one probe answers them all
        self._asked[key] = now
        nodes = engine.cluster.nodes
        suspects = [n for n in job.nodes if n != speaker and n in self.answering and n in nodes
                    and not nodes[n].gone and nodes[n].unreachable is None]
        lost: set[str] = set()
        limit = anyio.Semaphore(CONCURRENT)

        async def judge(node: str) -> None:
            async with limit:
                if await self.nobody_listens(nc, node):
                    lost.add(node)

        async with anyio.create_task_group() as tasks:
            for node in suspects:
                tasks.start_soon(judge, node)
        self._asked[key] = self.clock()  # the suspicions told while it asked are answered too
        out = []
        for node in sorted(lost):
            ident = f"unreachable:{node}:{job.id}:{job.generation}"
            envelope = make_envelope("node.unreachable", {"cause": cause[:256], "confirm_s": CONFIRM_S}, id=ident,
                                     node=node, source=SOURCE)
            out.append(Outgoing(subjects.node_event(node, "node.unreachable"), encode_envelope(envelope),
                                self.seal(ident), "input"))
            logger.warning("node unreachable", extra={"fields": {"node": node, "job": job.id, "cause": cause}})
        return out

    async def run(self, nc: Client, period_s: Callable[[], float]) -> None:
        """Hear suspicions and probe at once; look every `period_s()` for new incidents and nodes to learn; until
        cancelled."""
        shared = SharedSubscription.of(subjects.SUSPECTS)  # one per process, however many partitions it serves
        token = await shared.join(nc, self._on_suspect)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._answer_suspicions, nc)
                while True:
                    await anyio.sleep(period_s())  # the look's period
                    if self.judging() or self._since is not None:  # learning needs no grace
                        learn = self.look()
                        if learn:  # in its own task: an agent slow to answer delays no suspicion
                            tasks.start_soon(self._ask_all, nc, learn)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await shared.leave(token)

    async def _answer_suspicions(self, nc: Client) -> None:
        while True:
            self._woken = woken = anyio.Event()
            if not self._queue:
                await woken.wait()
            queue, self._queue = self._queue, []
            if not self.judging():
                continue  # what a daemon that may not write (or just came back) was told is for the silence bound
            for job, cause, speaker in queue:
                out = await self.probe_job(nc, job, cause, speaker)
                if not out:
                    continue
                try:
                    await self.publish(out)
                except Exception:  # NATS away, not acknowledged: the silence bound decides instead
                    logger.warning("could not log the nodes found unreachable", exc_info=True)

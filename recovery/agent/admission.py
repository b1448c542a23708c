"""Which jobs an agent starts: only those the daemon accepted.

A `job.submitted` event is a request anyone allowed to publish job events can make; the engine's answer is either a
`job.accepted` decision caused by that record (on `recovery.dec.<job>`, which only the daemon publishes) or a
rejection naming the record's sequence (a dead letter: an unknown policy or parameter, a node another job holds).
The agent learns of a job from its submission, as before, so that it knows the job's entrypoint, but starts nothing
for it (no ranks, no job store) until it reads that answer. The engine is unchanged: the answer is what it always
wrote, so old logs replay as they did.

Each job's start runs in a task of its own, and whatever fails in it is the job's failure, said in the agent's log
and as a `job.cancelled` event with the reason (the engine ends the job and records why): never the agent's, whose
other jobs' ranks would die with it.

The agent reads submissions where the log stores them: with several partitions (`partitions` > 1) the log's subject
transform moves every job event to `recovery.p.<k>.ev.job...` (`events.subjects.stored_job_events`), so a filter on
the published subject alone would see none of them.

A restarted agent takes back its duties for the jobs still live: the job store of a job whose first node this is
(the old agent's went with it) and, for a job accepted but not started while no agent ran here, its ranks.

`Admission` is the part of the agent (`recovery.agent.agent.Agent` derives from it) that does this.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
from nats.js.api import StreamInfo
from pydantic import BaseModel

from events import subjects
from events.envelope import RawRecord, Record
from events.kinds import JobSubmitted
from events.names import DecisionKind
from events.outputs import Decision, Rejection
from events.values import JobSpec, ResumePlan
from recovery.agent.channel import ProcessChannel
from recovery.agent.checks.runner import ChecksFailed
from recovery.agent.compilecache import SYNC_S, CompileCaches
from recovery.agent.config import AgentConfig
from recovery.agent.jobs import DEFAULT_STORE_PORT, JobOnNode
from recovery.agent.standby import StandbyPool
from recovery.agent.stores import PORT_FREED_S, JobStores
from recovery.core.machine import FINAL
from recovery.log.jetstream import JetStreamLog

logger = logging.getLogger("recovery.agent")


def submissions(info: StreamInfo) -> list[str]:
    """The subjects the log `info` describes stores job submissions under. A partitioned log (one with a subject
    transform) stores them in its partitions only; an unpartitioned one that holds messages can never become
    partitioned (the daemon refuses: the partition count is the log's for life), so its plain subject will do, and
    one filter reads faster than two. An empty unpartitioned log may still be given a transform by the first daemon:
    then both."""
    if info.config.subject_transform is not None:
        return [subjects.stored_job_events("job.submitted", partitioned=True)]
    plain = subjects.stored_job_events("job.submitted", partitioned=False)
    if info.state.messages:
        return [plain]
    return [plain, subjects.stored_job_events("job.submitted", partitioned=True)]


async def answer(log: JetStreamLog, job: str, seq: int) -> bool:
    """Wait for the engine's answer to the submission of `job` stored at `seq`: True if it accepted it, False if it
    rejected it. Waits as long as no daemon has read it (an outage of the control plane starts nothing)."""
    verdict: list[bool] = []

    async def decided(scope: anyio.CancelScope) -> None:
        async for record in log.follow(seq + 1, subjects.decision(job)):
            data = record.envelope.data if isinstance(record, Record) else None
            if isinstance(data, Decision) and data.cause_seq >= seq:
                # The first decision of the job after its submission: caused by it, its acceptance; caused by a later
                # record, the job was accepted from a later submission and this one rejected.
                verdict.append(data.cause_seq == seq and data.kind is DecisionKind.JOB_ACCEPTED)
                scope.cancel()
                return

    async def dead_lettered(scope: anyio.CancelScope) -> None:
        async for record in log.follow(seq + 1, subjects.DEAD_LETTERS):
            data = record.envelope.data if isinstance(record, Record) else None
            if isinstance(data, Rejection) and data.seq == seq:
                verdict.append(False)
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(decided, tg.cancel_scope)
        tg.start_soon(dead_lettered, tg.cancel_scope)
    return bool(verdict) and verdict[0]


async def standing(log: JetStreamLog, job: str, seq: int) -> str | None:
    """The lifecycle state of `job` after the decisions already in the log since its submission at `seq`; None if the
    engine has not answered that submission yet (or rejected it: then no decision of the job follows it either)."""
    state: str | None = None
    async for record in log.read(seq + 1, None, subjects.decision(job)):
        data = record.envelope.data if isinstance(record, Record) else None
        if isinstance(data, Decision):
            state = data.state
    return state


class Admission:
    cfg: AgentConfig
    node: str
    jobs: dict[str, JobOnNode]
    runtime_dir: Path
    standbys: StandbyPool
    warming: dict[str, anyio.CancelScope]  # a spare's: the jobs it keeps standbys for, each its follower's scope
    caches: CompileCaches
    stores: JobStores
    _tg: TaskGroup | None

    # -- what the agent provides -------------------------------------------------------------------------
    def job_event(self, job: str, type_: str, data: dict[str, Any] | BaseModel, event_id: str | None = None) -> None:
        raise NotImplementedError

    def _report(self, job_id: str, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def _adopt(self, job: JobOnNode) -> None:
        raise NotImplementedError

    def standbys_wanted(self, job: JobOnNode) -> int:
        raise NotImplementedError

    async def _prefetch_caches(self, job: JobOnNode) -> None:
        """A spare warm for a job fetches what the job compiled elsewhere as its nodes copy it to the shared
        directory (after their first steps, then every `SYNC_S`), so that its ranks moved here compile nothing."""
        while True:
            await anyio.sleep(SYNC_S)  # the nodes' copies' period
            await self.caches.fetch(job.id)

    async def _fence(self, job: JobOnNode) -> None:
        raise NotImplementedError

    async def _launch(self, job: JobOnNode, rank: int, attempt: int, plan: ResumePlan | None,
                      command_id: str | None = None, *, whole: bool) -> None:
        raise NotImplementedError

    # -- submissions -------------------------------------------------------------------------------------
    async def _known_jobs(self, log: JetStreamLog, start: int, submitted: list[str]) -> None:
        """The jobs submitted with an entrypoint before `start` (this agent was restarted): known again without
        launching what the old agent launched, so that their commands are carried out, their ranks that outlived the
        old agent are adopted, and those reach this one through the job's socket (the SDK connects again by itself)."""
        async for record in log.read(1, start - 1, submitted):
            await self._job_record(log, record, known=True)

    async def _follow_jobs(self, log: JetStreamLog, start: int, submitted: list[str]) -> None:
        """Every job submitted with an entrypoint from `start` on: its ranks placed here start once it is accepted."""
        async for record in log.follow(start, submitted):
            await self._job_record(log, record, known=False)

    async def _job_record(self, log: JetStreamLog, record: Record | RawRecord, known: bool) -> None:
        if not isinstance(record, Record) or record.envelope.job is None:
            return
        data = record.envelope.data
        if isinstance(data, JobSubmitted) and data.spec.entrypoint is not None:
            try:
                await self._submitted(log, record.envelope.job, data.spec, record.seq, known=known)
            except Exception:  # one job's trouble (its socket, say) is its own: the agent follows the next ones
                logger.exception("job %s submitted at %d could not be taken on by %s", record.envelope.job,
                                 record.seq, self.node)

    async def _submitted(self, log: JetStreamLog, job_id: str, spec: JobSpec, seq: int, known: bool) -> None:
        if job_id in self.jobs:
            return  # a second submission of a known job: the engine rejects it as a duplicate
        assert spec.entrypoint is not None
        env = spec.entrypoint.env
        job = JobOnNode(job_id, spec, list(spec.nodes), spec.layout, env.get("MASTER_ADDR", "127.0.0.1"),
                        int(env.get("MASTER_PORT", DEFAULT_STORE_PORT)),
                        ProcessChannel(self.runtime_dir / f"{job_id}.sock", lambda m, j=job_id: self._report(j, m)))
        self.jobs[job_id] = job
        assert self._tg is not None
        await self._tg.start(job.serve_channel)
        if known:
            # A job from before this agent: its ranks that outlived the old agent are adopted, so that their exits
            # are reported and a restart replaces them instead of doubling them.
            self._adopt(job)
            self._tg.start_soon(self._fence, job)
        else:
            job.caught_up.set()  # a job that starts under this agent missed nothing
        if self.node in spec.nodes:
            self._tg.start_soon(self._admit, log, job, seq, known)
        elif self.cfg.spare and spec.spares != 0 and spec.spare_pool == self.cfg.pool and self.cfg.spare_standby_jobs:
            # a spare of the pool the job takes its spares from, which it may take (`spares`: null, as many as free)
            self._tg.start_soon(self._warm_spare, log, job, seq)

    async def _warm_spare(self, log: JetStreamLog, job: JobOnNode, seq: int) -> None:
        """A spare keeps standbys for a job that may take it once the engine accepted it (its ranks moved here then
        start warm, as a restart in place does), and fetches what it compiled, until the job ends or a newer job
        takes its place (`spare_standby_jobs`): a job submitted before this agent started included, unless it ended
        already."""
        assert job.spec.entrypoint is not None and self._tg is not None
        count = self.standbys.spare_wanted(job.spec.entrypoint, job.rpn)
        try:
            if count == 0 or await standing(log, job.id, seq) in FINAL or not await answer(log, job.id, seq):
                return
            for older in self.standbys.warm_for(job.id, self.cfg.spare_standby_jobs):
                granted = older in self.jobs and self.node in self.jobs[older].nodes
                if not granted:  # a job this spare runs now keeps its standbys as on any node of it
                    await self.standbys.drop(older)
                    with contextlib.suppress(KeyError):
                        self.warming[older].cancel()  # no more to follow of it
            for _ in range(count):  # one after the other: each waits its delay, then for its imports
                # at full speed: a spare runs no rank its imports would slow
                self._tg.start_soon(partial(self.standbys.keep, job.id, job.spec.entrypoint, count, job.rpn,
                                            idle=False))
            with anyio.CancelScope() as self.warming[job.id]:
                async with anyio.create_task_group() as fetching:
                    fetching.start_soon(self._prefetch_caches, job)
                    async for record in log.follow(seq + 1, subjects.decision(job.id)):
                        data = record.envelope.data if isinstance(record, Record) else None
                        if isinstance(data, Decision) and data.state in FINAL:
                            break
                    fetching.cancel_scope.cancel()
            self.warming.pop(job.id, None)
            if self.node not in job.nodes:  # granted meanwhile, its standbys are the job's, ended with it here
                await self.standbys.drop(job.id)
        except Exception:  # the spare's warmth is no one's failure: its ranks would start cold
            logger.warning("the spare %s keeps no standbys for %s", self.node, job.id, exc_info=True)

    async def _admit(self, log: JetStreamLog, job: JobOnNode, seq: int, known: bool) -> None:
        """Start what this node serves of `job` once the engine accepted it; a failure is the job's alone."""
        try:
            accepted: bool | None = None
            if known:
                state = await standing(log, job.id, seq)
                if state in FINAL:
                    return
                if state is not None and (state != "submitted" or job.processes):
                    # The old agent's store went with it (its stdin closed): the job's ranks need one again.
                    await self._serve_store(job, PORT_FREED_S)
                    return
                # Accepted and not started, with no rank of it here: this agent came up late (or the old one went
                # before it started them), and starts them now.
                accepted = True if state is not None else None
            if accepted is None:
                accepted = await answer(log, job.id, seq)
            if not accepted:
                logger.info("not starting %s: the daemon did not accept its submission (see the dead letters)",
                            job.id)
                self._forget(job)
                return
            await self._start(job, PORT_FREED_S if known else 0.0)
        except Exception as exc:
            logger.exception("job %s could not start on %s: the agent and its other jobs go on", job.id, self.node)
            self.job_event(job.id, "job.cancelled", {"reason": f"the agent of {self.node} could not start the job: "
                                                               f"{exc}"[:1024]},
                           event_id=f"{job.id}:{seq}:not-started@{self.node}")

    def _forget(self, job: JobOnNode) -> None:
        """A rejected job is not known: the same id may be submitted again, fixed, and must start then."""
        if self.jobs.get(job.id) is job and not job.processes:
            del self.jobs[job.id]
            job.serving.cancel()
            job.channel.path.unlink(missing_ok=True)

    async def _serve_store(self, job: JobOnNode, freed_s: float = 0.0) -> None:
        assert job.spec.entrypoint is not None
        if job.spec.nodes[0] == self.node and job.spec.entrypoint.rendezvous == "agent":
            await self.stores.serve(job.id, job.store_port, freed_s)

    async def _start(self, job: JobOnNode, freed_s: float) -> None:
        """The first start of an accepted job's ranks on this node, and of its job store on its first node (waiting
        `freed_s` for its port, as a restarted agent does for the old one's store)."""
        spec = job.spec
        assert spec.entrypoint is not None and self._tg is not None
        await self._serve_store(job)
        here = job.ranks_on(self.node)
        try:
            for rank in here:
                await self._launch(job, rank, 0, None, whole=True)
        except ChecksFailed as exc:
            # No command to fail: the `node.checked` record tells the engine, which moves the ranks.
            logger.warning("not starting the ranks of %s: %s", job.id, exc)
            return
        if spec.nodes[0] == self.node:
            self.job_event(job.id, "job.started", {}, event_id=f"{job.id}:started")
        # Started with the ranks, under SCHED_IDLE: they import on CPU time the ranks leave, and a kill soon after
        # the start finds them part of the way (a standby still importing is taken and sped up). How many is asked
        # now (`standbys_wanted`: one per rank until the ranks say they recover in place) and trimmed later.
        for _ in range(max(1, len(here))):
            self._tg.start_soon(partial(self.standbys.keep, job.id, spec.entrypoint, lambda: self.standbys_wanted(job),
                                        len(here), delay_s=0))

"""The Slurm executor, `recovery-slurm`: what the engine decides about nodes and allocations, carried into Slurm.

It follows the decisions in the log (the audit stream, `recovery.dec.>`) and acts on three of them:

- a decision that carries an `IsolateNode` command (a lemon node, a node fault the detection policy takes out of
  service): the node is drained with the command's reason, so that Slurm gives it to no new job;
- `hardware.released` for a whole node (repaired, its isolation expired, or an operator released it): the node is
  resumed, if it is still drained by us: a node an administrator drained for reasons of their own stays drained;
- `attempt.waiting` with nodes to vacate, for a job whose spec names a Slurm allocation (`scheduler_job`): the job
  lost nodes and no spare replaces them. Inside an allocation no spare will come (its nodes are fixed when it
  starts), so waiting has no end that Slurm would not bring sooner: the lost nodes are drained and the allocation
  is requeued. Its batch script runs again on nodes Slurm picks (not the drained ones) and submits a new recovery
  job, which resumes from the newest checkpoint as any restart does.

The bridge runs once per cluster, next to slurmctld, as an account allowed to change node states (SlurmUser or an
AdminLevel=Operator account): agents on the training nodes run as the training user and cannot drain, and a node
that died cannot drain itself. Each action is safe to repeat: draining a drained node changes nothing, a resume
needs our own drain reason, and a requeue needs the allocation to still be the run the recovery job was submitted
in (Slurm's restart count), so a bridge that restarts and reads decisions again never requeues a later run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import nats
from nats.aio.client import Client

from events import subjects
from events.commands import IsolateNode
from events.envelope import Record
from events.kinds import JobSubmitted
from events.names import DecisionKind
from events.outputs import Decision
from events.values import SchedulerJob
from recovery.log.jetstream import JetStreamLog
from recovery.log.waiting import Attempts, until_streams_exist
from recovery.slurm.scontrol import Scontrol, ScontrolFailed

logger = logging.getLogger("recovery.slurm")

FAULTS = (DecisionKind.FAULT_CONFIRMED, DecisionKind.FAULTS_CONFIRMED_TOGETHER, DecisionKind.FAULT_ADDED)
ENDS = (DecisionKind.JOB_COMPLETED, DecisionKind.JOB_FAILED, DecisionKind.JOB_CANCELLED)
RETRIES = 5
"""scontrol is tried this often (slurmctld restarting, a failover) before the bridge gives up on one action"""


@dataclass
class SlurmBridge:
    nats_url: str
    scontrol: Scontrol
    stream: str = "RECOVERY"
    state_file: Path | None = None
    """where the last decision's sequence is kept, so that a restarted bridge goes on from there; without one (or
    before it exists) the bridge starts at the end of the log"""
    retry_s: float = 1.0
    jobs: dict[str, SchedulerJob | None] = field(default_factory=dict)
    """the Slurm allocation of each job seen, from its spec; forgotten when the job ends"""
    faults: dict[str, str] = field(default_factory=dict)
    """each job's latest fault, the reason given to the nodes it drains when it requeues"""
    requeued: set[str] = field(default_factory=set)
    actions: int = 0
    """scontrol changes made, for tests and logs"""
    _log: JetStreamLog | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        attempts = Attempts(logger, "NATS: the bridge acts on nothing until it connects", self.nats_url)
        connected = False

        async def on_error(exc: Exception) -> None:
            if not connected:
                attempts.failed(exc)

        servers = [s.strip() for s in self.nats_url.split(",") if s.strip()]
        nc: Client = await nats.connect(servers, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                        name="recovery-slurm", error_cb=on_error)
        connected = True
        try:
            log = JetStreamLog(nc, nc.jetstream(timeout=5.0), self.stream, owns_connection=False)
            self._log = log
            last = await until_streams_exist(log.last_seq, logger, self.stream)
            start = self._saved_seq()
            start = last + 1 if start is None else start + 1
            logger.info("following decisions from sequence %d", start)
            task_status.started()
            async for record in log.follow(start, subjects.DECISIONS):
                decision = record.envelope.data if isinstance(record, Record) else None
                if isinstance(decision, Decision) and await self.handle(record.seq, decision):
                    self._save_seq(record.seq)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    # -- the decisions ---------------------------------------------------------------------------------
    async def handle(self, seq: int, decision: Decision) -> bool:
        """Act on one decision; True if Slurm was asked to change something."""
        acted = False
        job = decision.job
        if decision.kind in FAULTS:
            self.faults[job] = decision.reason
        for command in decision.commands:
            if isinstance(command, IsolateNode):
                acted |= await self._act(self.scontrol.drain, command.node, f"{command.reason} (job {job})")
        if decision.kind is DecisionKind.HARDWARE_RELEASED and decision.detail.get("device") is None:
            node = decision.detail.get("node")
            if isinstance(node, str):
                acted |= await self._resume(node, decision.reason)
        elif decision.kind is DecisionKind.ATTEMPT_WAITING and _short_of_spares(decision):
            acted |= await self._requeue(seq, job, [str(n) for n in decision.detail["vacate"]])
        elif decision.kind in ENDS:
            self.jobs.pop(job, None)
            self.faults.pop(job, None)
            self.requeued.discard(job)
        return acted

    async def _resume(self, node: str, why: str) -> bool:
        try:
            state = await self.scontrol.node(node)
        except ScontrolFailed as exc:
            logger.warning("cannot read the state of %s to resume it: %s", node, exc)
            return False
        if not state.drained_by_recovery:
            logger.info("%s released (%s) but not drained by recovery (%s: %r): left as it is", node, why,
                        "+".join(sorted(state.states)), state.reason)
            return False
        return await self._act(self.scontrol.resume, node)

    async def _requeue(self, seq: int, job: str, lost: list[str]) -> bool:
        if job in self.requeued:
            return False  # the job waits again (another fault joined): its allocation is already on its way back
        allocation = await self._allocation(job, seq)
        if allocation is None:
            return False  # not run in a Slurm allocation: the engine's wait stands (a spare may join the pool)
        try:
            info = await self.scontrol.job(allocation.id)
        except ScontrolFailed as exc:
            logger.warning("cannot read Slurm job %s of %s: %s", allocation.id, job, exc)
            return False
        restarts = info.get("Restarts", "0")
        if info.get("JobState") != "RUNNING" or restarts != str(allocation.restarts):
            # A later run of the allocation, or one already ended: the decision is about a run that is gone.
            logger.info("Slurm job %s is %s after %s restart(s), not the run %s was submitted in: not requeued",
                        allocation.id, info.get("JobState"), restarts, job)
            return False
        self.requeued.add(job)
        why = self.faults.get(job, "lost, no spare")
        for node in lost:
            await self._act(self.scontrol.drain, node, f"{job} had to leave it, no spare: {why}")
        logger.warning("requeueing Slurm job %s: %s lost %s and no spare can replace it", allocation.id, job,
                       ", ".join(lost))
        return await self._act(self.scontrol.requeue, allocation.id)

    async def _allocation(self, job: str, seq: int) -> SchedulerJob | None:
        """The job's Slurm allocation, from the spec it was submitted with (read back from the log once)."""
        if job not in self.jobs:
            assert self._log is not None
            found: SchedulerJob | None = None
            async for record in self._log.read(1, seq, subjects.job_event(job, "job.submitted")):
                if isinstance(record, Record) and isinstance(record.envelope.data, JobSubmitted):
                    found = record.envelope.data.spec.scheduler_job
            self.jobs[job] = found if found is not None and found.scheduler == "slurm" else None
        return self.jobs[job]

    async def _act(self, action: Callable[..., Awaitable[None]], *args: str) -> bool:
        """One scontrol change, tried again while slurmctld does not answer; logged either way."""
        what = f"{getattr(action, '__name__', 'scontrol')} {' '.join(args)}"
        for attempt in range(1, RETRIES + 1):
            try:
                await action(*args)
            except ScontrolFailed as exc:
                if "Invalid node name" in exc.output or "Invalid job id" in exc.output or attempt == RETRIES:
                    logger.error("slurm: %s failed: %s", what, exc)
                    return False
                logger.warning("slurm: %s failed (attempt %d of %d), trying again: %s", what, attempt, RETRIES, exc)
                await anyio.sleep(self.retry_s * attempt)  # backoff while slurmctld restarts
                continue
            self.actions += 1
            logger.info("slurm: %s", what)
            return True
        return False

    # -- where it left off -----------------------------------------------------------------------------
    def _saved_seq(self) -> int | None:
        if self.state_file is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return int(self.state_file.read_text().strip())
        return None

    def _save_seq(self, seq: int) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_suffix(".partial")
        partial.write_text(f"{seq}\n")
        os.replace(partial, self.state_file)  # a crash mid-write leaves the previous sequence, never half of one


def _short_of_spares(decision: Decision) -> bool:
    """The job waits because it must leave nodes and there are fewer spares than nodes to leave (not, say, for a
    device reset it may still try)."""
    vacate, spares = decision.detail.get("vacate"), decision.detail.get("spares")
    return isinstance(vacate, list) and bool(vacate) and isinstance(spares, int) and spares < len(vacate)

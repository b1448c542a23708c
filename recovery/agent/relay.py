"""The SDK's words relayed as the job's events: what a process says over the agent's socket (`channel.py`), folded
into one `progress.report` per job per period where it is only a sign of life or of progress (`progress.py`).

`Relay` is the part of the agent (`recovery.agent.agent.Agent` derives from it) that speaks for its ranks.
"""

from __future__ import annotations

import logging
import time
from typing import Any, get_args

import anyio
from pydantic import BaseModel, ValidationError

from events.values import STORAGE_HOLDER, Capability, Tier
from recovery.agent import ranks
from recovery.agent.config import AgentConfig
from recovery.agent.jobs import JobOnNode
from recovery.agent.memory import MemoryTier
from recovery.agent.progress import ProgressFold, SilenceWatch, measured, wire_loss, wire_skip
from recovery.agent.standby import StandbyPool

CAPABILITIES = frozenset(get_args(Capability))
"""what an SDK may announce; a word a newer SDK adds is not relayed (the engine would refuse the event)"""

logger = logging.getLogger("recovery.agent")
_PROGRESS = ("process.heartbeat", "progress.step", "progress.report")


class Relay:
    cfg: AgentConfig
    node: str
    jobs: dict[str, JobOnNode]
    progress: ProgressFold
    silence: SilenceWatch
    memory: MemoryTier
    standbys: StandbyPool

    def publish(self, job: str, type_: str, data: dict[str, Any] | BaseModel, event_id: str | None,
                heartbeat: bool) -> None:
        """Put one event of `job` in the outbox (the agent's)."""
        raise NotImplementedError

    async def suspect_peer(self, job: str, rank: int, generation: int, error: str) -> None:
        """Tell the daemon that `rank` lost a peer's connection (the agent's)."""
        raise NotImplementedError

    def standbys_wanted(self, job: JobOnNode) -> int:
        """The standbys the job keeps on this node now (the agent's)."""
        raise NotImplementedError

    def job_event(self, job: str, type_: str, data: dict[str, Any] | BaseModel, event_id: str | None = None) -> None:
        if type_ not in _PROGRESS:
            self.flush(job)  # what the ranks said before this change reaches the engine before it
        self.publish(job, type_, data, event_id, heartbeat=type_ == "process.heartbeat")

    def checkpoint_saved(self, job: str, step: int, tier: str, shards: list[int]) -> None:
        """A checkpoint this node holds (or, tier `storage`, persisted) reported as the job's event."""
        holder = STORAGE_HOLDER if Tier(tier) is Tier.STORAGE else self.node
        self.job_event(job, "checkpoint.saved", {"step": step, "tier": tier, "shards": shards, "holder": holder})

    def flush(self, job: str) -> None:
        """Send what the ranks of `job` said since the last report, if anything."""
        report = self.progress.take(job)
        if report is not None:
            # Droppable while NATS is away (the next report says the same, newer) unless it carries a step.
            lively = all(entry["step"] is None for entry in report["ranks"])
            self.publish(job, "progress.report", report, None, heartbeat=lively)

    async def report_to_daemon(self, job: str) -> None:
        """The period's report of `job` over core NATS, for the daemon's summary (`progress = "summary"`): a healthy
        job's "still training" costs the log one record a job a period, not one a node. Lost if NATS is away, as a
        beat may be: the next period's says newer."""
        raise NotImplementedError

    def report_period(self, job_id: str) -> float:
        """How often `job`'s report goes: `report_s`, or longer for a job of more nodes than `job_reports_per_s`
        (its agents together then still send that many a second)."""
        job = self.jobs.get(job_id)
        nodes = len(job.nodes) if job is not None else 1
        return max(self.cfg.report_s, nodes / self.cfg.job_reports_per_s)

    async def fold_reports(self) -> None:
        """Every `report_s`: each job's report that is due, and each rank silent past `rank_silence_s` reported
        hung."""
        flushed: dict[str, float] = {}
        while True:
            await anyio.sleep(self.cfg.report_s)  # the period of the reports
            now = time.monotonic()
            self._ending_alive(now)
            for job in self.progress.jobs():
                # A tick early still counts: the ticks drift, and a period of 2 ticks must not become 3.
                if now - flushed.get(job, -1e18) >= self.report_period(job) - self.cfg.report_s / 2:
                    flushed[job] = now
                    if self.cfg.progress == "summary":
                        await self.report_to_daemon(job)
                    else:
                        self.flush(job)
            if len(flushed) > len(self.jobs) + 64:
                flushed = {job: at for job, at in flushed.items() if job in self.jobs}
            if self.cfg.rank_silence_s > 0:
                for job_id, rank, seconds in self.silence.silent(time.monotonic(), self.cfg.rank_silence_s):
                    job = self.jobs.get(job_id)
                    proc = job.processes.get(rank) if job is not None else None
                    if proc is not None and proc.alive and proc.ending_since is None:
                        logger.warning("rank %d of %s silent for %.1f s: reported hung", rank, job_id, seconds)
                        self.job_event(job_id, "process.hang", {"rank": rank, "attempt": proc.attempt,
                                                                "seconds_without_progress": round(seconds, 3)})

    def _ending_alive(self, now: float) -> None:
        """A rank whose script said it is done (`closing`) or whose interpreter is exiting (`exiting`) sends nothing
        more, yet its process may take seconds to end (a final save, torch's teardown on a loaded host): the agent
        says it lives, as its heartbeat would, until it exits, so that the engine never takes a finished rank for a
        hung one; for `ending_alive_s` at most, past which a process that has not ended is silent again."""
        for job_id, job in self.jobs.items():
            for rank, proc in job.processes.items():
                if proc.alive and proc.ending_since is not None and now - proc.ending_since < self.cfg.ending_alive_s:
                    said = self.progress.known.get((job_id, rank))
                    if said is not None:
                        self.progress.note(job_id, rank, None, said[0])

    def _progress(self, job_id: str, rank: int, step: int | None, attempt: int, compute_s: float | None = None,
                  loss: float | str | None = None, skip: list[str] | None = None) -> None:
        if self.cfg.report_s > 0:
            if self.progress.note(job_id, rank, step, attempt, compute_s, loss, skip):
                # A rank that joined a generation, its first step there (news for a recovery), or a loss that may be
                # a bad step (news for a roll-back).
                self.flush(job_id)
        elif step is None:
            self.job_event(job_id, "process.heartbeat", {"rank": rank, "attempt": attempt})
        else:
            extra: dict[str, Any] = {} if compute_s is None else {"compute_s": compute_s}
            if loss is not None:
                extra.update(loss=loss, **({"skip": skip} if skip else {}))
            self.job_event(job_id, "progress.step", {"rank": rank, "step": step, "attempt": attempt, **extra})

    async def _report(self, job_id: str, message: dict[str, Any]) -> None:
        """What a process says through the SDK, relayed as the job's events."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        rank, attempt, op = message["rank"], message.get("attempt", 0), message.get("op")
        proc = job.processes.get(rank)  # the rank's process now (a survivor's generation moves on)
        if op in ("closing", "exiting"):
            # the script is done, or its interpreter exits: its silence from here on is no hang
            self.silence.forget(job_id, rank)
            pid = message.get("pid")  # an SDK of old sends none
            if proc is not None and proc.alive and (pid is None or ranks.in_session(pid, proc)):
                # not a stopped process of the rank's generation before, whose exit handlers may speak late
                proc.closing = proc.closing or op == "closing"
                if proc.ending_since is None:
                    proc.ending_since = time.monotonic()
            return
        counted = proc is not None and proc.counted_only
        if (proc is None or proc.ending_since is None) and not counted:
            # A heartbeat sent while it ends starts no silence watch; nor does the step hook's, whose script may hold
            # the interpreter for seconds in a native call that no SDK user chose: its hangs are seen from outside.
            self.silence.spoke(job_id, rank, time.monotonic())
        try:
            if op == "step" or (op == "heartbeat" and message.get("step") is not None):
                job.stepped.set()  # the ranks' start-up is over: standbys may import now
            if op == "heartbeat":
                if not counted:  # the step hook's: only its counts are news (the engine reads no silence of it)
                    self._progress(job_id, rank, message.get("step"), attempt)
            elif op == "step":
                self._progress(job_id, rank, message["step"], attempt, measured(message.get("compute_s")),
                               wire_loss(message.get("loss")), wire_skip(message.get("skip")))
            elif op == "joined":
                self._progress(job_id, rank, None, attempt)
            elif op in ("checkpoint", "saved"):
                tier = Tier(message["tier"])
                # a dying checkpoint written to storage every node reads (`shared`) outlives its node, which a
                # preemption is taking away; one on the node's own disk goes with it
                shared = tier is Tier.STORAGE or (tier is Tier.DYING and message.get("shared") is True)
                holder = STORAGE_HOLDER if shared else self.node
                self.job_event(job_id, "checkpoint.saved", {"step": message["step"], "tier": tier,
                                                            "shards": message["shards"], "holder": holder})
                if op == "saved":
                    done = job.saves.get(str(message.get("id")))
                    if done is not None:
                        done.set()
            elif op == "memory_saved":
                # the SDK's copy into this node's shared memory (`recovery.agent.memory`): reported, then persisted
                storage, held_for = message.get("storage"), message.get("held_for")
                self.memory.saved(job_id, rank, int(message["step"]), [int(s) for s in message["shards"]],
                                  str(message["file"]), storage if isinstance(storage, str) else None,
                                  held_for=int(held_for) if held_for is not None else None,
                                  keep=int(message.get("keep", 1)))
            elif op == "join":
                # Only a process this agent runs for the rank may join a new generation: one it does not know (it
                # outlived an agent and was not adopted) or that a replacement superseded would join beside the
                # rank's real process. Answered once the missed commands are caught up with (`_fence`).
                if job.caught_up.is_set():
                    # Found by its pid, not its rank: a scale that keeps it renumbers it (the SDK learns its new rank
                    # from the job store, maybe before this agent has carried the scale out).
                    ok = any(other.alive and ranks.in_session(message.get("pid"), other)
                             for other in job.processes.values())
                    await job.channel.send(rank, {"op": "join_ok" if ok else "join_refused",
                                                  "generation": message.get("generation")})
                    if not ok:
                        logger.warning("rank %s of %s (pid %s) may not join generation %s: the agent does not run "
                                       "it", rank, job_id, message.get("pid"), message.get("generation"))
            elif op == "collective_failed":
                # Its own event, at once: with every rank alive the engine retries the step in a new generation.
                self.job_event(job_id, "process.collective_failed", {
                    "rank": rank, "attempt": message.get("generation", attempt), "step": message["step"],
                    "operation": str(message.get("operation") or "allreduce")[:64],
                    "timeout_s": message.get("timeout_s", 0), "error": str(message.get("error", ""))[:1024]})
            elif op == "peer_lost":
                # A survivor's group lost a peer's connection: the peer's host may be gone with its agent, which
                # then says nothing; the daemon asks the job's agents at once (`recovery.service.reachability`).
                await self.suspect_peer(job_id, rank, int(message.get("generation", attempt)),
                                        str(message.get("error", "")))
            elif op == "caps":
                # What the script wired up through the SDK: how much a fault of the job may restart (`Job.can`).
                said = message.get("caps")
                caps = sorted({c for c in said if c in CAPABILITIES}) if isinstance(said, list) else []
                if proc is not None and proc.alive:
                    proc.caps = frozenset(caps)
                    if "reform" in caps:  # it recovers in place: the job needs no standby for every rank here
                        for extra in self.standbys.trim(job_id, self.standbys_wanted(job)):
                            await extra.close()
                    if proc.counted_only:
                        self.silence.forget(job_id, rank)  # its hello started a watch its hook's silence must not end
                self.job_event(job_id, "process.capabilities", {"rank": rank, "attempt": attempt, "caps": caps})
            elif op == "save_failed":
                request = str(message.get("id"))
                done = job.saves.get(request)
                if done is not None:
                    job.save_failures[request] = str(message.get("reason") or "the save failed")
                    done.set()
        except (ValueError, KeyError, ValidationError) as exc:
            logger.warning("bad report from rank %s of %s: %s", rank, job_id, exc)

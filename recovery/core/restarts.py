"""An attempt's way to its restart: where the state comes from (the checkpoint policy, a dying checkpoint saved or
awaited), stopping the processes that must go, the restart, migrate or scale commands, and their acknowledgements.

`Restarts` is the half of the incident lifecycle (`recovery.core.incidents.Incidents`, which derives from it) that
talks to executors; planning, deadlines and closing are the other half.
"""

from __future__ import annotations

from itertools import chain, repeat
from typing import Any, Literal

from events import kinds
from events.commands import MigrateRanks, RestartJob, RestartRanks, RetryStep, SaveCheckpoint, ScaleJob, StopRanks
from events.names import AttemptOutcome, AttemptPurpose, DecisionKind, IncidentCause, TimerPurpose
from events.values import Granularity, ResumePlan, Tier
from policies.base import NS, AwaitDying, CheckpointContext, CheckpointPlan, Resume, SaveDying
from recovery.core.addressing import command_nodes
from recovery.core.cluster import ClusterView
from recovery.core.job import Attempt, Incident, Job
from recovery.core.placement import Placement
from recovery.core.record import RecordEffects
from recovery.core.sandbox import consult
from recovery.core.timers import Timekeeper, TimerRequest

G = Granularity


class Restarts:
    cluster: ClusterView
    timekeeper: Timekeeper
    placement: Placement

    # Provided by Incidents: an attempt that cannot go on ends (and the policy is asked again), or fails the job.
    def end_attempt(self, out: RecordEffects, job: Job, attempt: Attempt, outcome: AttemptOutcome, reason: str,
                    cancelled: list[str] | None = None, plan: bool = True) -> None:
        raise NotImplementedError

    def fail_job(self, out: RecordEffects, job: Job, reason: str, policy: str | None) -> None:
        raise NotImplementedError

    def restoring(self, out: RecordEffects, job: Job, attempt: Attempt, cancelled: list[str]) -> None:
        """The executors have started the attempt's processes: wait for them to show it worked."""
        raise NotImplementedError

    def _resume_step(self, job: Job, attempt: Attempt) -> int:
        """The step the attempt's restarted processes resume from: the plan's checkpoint (0 without one), or the
        fault's step for a retry (nothing is lost)."""
        if attempt.granularity is G.RETRY:
            assert job.incident is not None
            return job.incident.fault_step
        return attempt.plan.checkpoint_step or 0 if attempt.plan else 0

    def _resumed_at(self, job: Job, attempt: Attempt, step: int) -> int:
        """Where the processes resumed, once the first of them reported `step` past `_resume_step`: a script whose
        ranks said they report no checkpoints resumed from its own, which only its first step tells (the step before
        it, if it reports every step)."""
        resume = self._resume_step(job, attempt)
        if job.caps is not None and not job.can("checkpoints") and attempt.granularity is not G.RETRY:
            resume = max(resume, step - 1)
        return resume

    def _progress_past(self, job: Job, incident: Incident, attempt: Attempt, step: int) -> tuple[str, int | None]:
        """Why `step` closes the incident, and the steps trained again (None: not known). Steps the step hook counts
        (`Job.counted`) number each process's optimizer steps from 1: progress and time, but no resume point."""
        if job.counted:
            return f"progress: {step} optimizer step(s) counted in the restarted processes", None
        resume = self._resumed_at(job, attempt, step)
        lost = max(0, incident.fault_step - resume) if incident.cause is IncidentCause.FAULT else 0
        return f"progress to step {step} past resume point {resume}", lost

    def _checkpoint_ctx(self, job: Job, attempt: Attempt, dying_allowed: bool, peer_allowed: bool
                        ) -> CheckpointContext:
        incident = job.incident
        assert incident is not None
        # A dying checkpoint is asked only of ranks that said they can write one (a save handler): asked of a
        # script that cannot answer, it fails after its deadline, and the restart waited for nothing.
        dying_allowed = dying_allowed and job.can("save")
        alive_list = list(map(bool, job.alive))
        if attempt.granularity is G.IN_PLACE:
            for rank in attempt.ranks:  # restarting: no source of state
                alive_list[rank] = False
        catalog = job.frozen_catalog()
        if incident.bad_step is not None:
            # The state is poisoned from the bad step on, in every live replica and in every checkpoint of it or
            # later: the policy sees only the checkpoints before it, and no live state to take or save.
            catalog = {step: tiers for step, tiers in catalog.items() if step < incident.bad_step}
            alive_list = [False] * job.world
            dying_allowed = peer_allowed = False
        alive = tuple(alive_list)
        # Built at C speed: a 131,072-rank job's contexts are most of the time its fault takes to become commands.
        placement = tuple(chain.from_iterable(zip(*repeat(job.nodes, job.rpn), strict=True)))[:job.world]
        return CheckpointContext(
            layout=job.layout, catalog=catalog, placement=placement,
            unreachable=self._unreachable(job) | incident.dead_hosts,
            alive=alive, steps=tuple(job.steps), dying_allowed=dying_allowed, peer_allowed=peer_allowed,
            restarting=frozenset(attempt.ranks),
            exiting=incident.exiting if dying_allowed and not incident.awaited else frozenset(),
            ended=frozenset(incident.ended), shard_counts=job.shard_counts,
        )

    def _unreachable(self, job: Job) -> frozenset[str]:
        """The job's nodes whose memory and disk cannot be read now: impaired nodes only can be (`ClusterView`)."""
        cluster = self.cluster
        found = [name for name in cluster.impaired() if not cluster.reachable(name)]
        if not found:
            return frozenset()
        mine = set(job.nodes)
        return frozenset(name for name in found if name in mine)

    def _refresh_plan(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        """The plan a restart carries is made from what is known when the command is sent: while processes were
        stopped, live replicas may have trained on, a newer checkpoint (a dying one written by SIGTERM handlers)
        may have landed, or a holder may have gone. Ask again; a different answer replaces the plan."""
        plan = attempt.plan
        if plan is None or attempt.planned_at == out.seq:
            return  # planned by this very record (nothing to stop first): nothing can have changed since
        peer = any(source.tier is Tier.PEER for source in plan.shards)
        answer = consult(out, job, "checkpoint", "plan", self._checkpoint_ctx(job, attempt, False, peer))
        fresh = _skipping(job, _resume_of(answer)) or plan
        if fresh != plan:
            attempt.plan = fresh
            why = (f"{plan.checkpoint_step} is no longer where the live replicas are" if peer else
                   f"step {plan.checkpoint_step} is no longer the newest complete, reachable checkpoint"
                   if fresh.model_copy(update={"skip_steps": plan.skip_steps, "skip_data": plan.skip_data}) != plan
                   else "the data to skip changed (an earlier bad step was heard)")
            detail: dict[str, Any] = {"checkpoint_step": fresh.checkpoint_step, "next_step": fresh.next_step,
                                      "tiers": _tier_counts(fresh)}
            if fresh.skip_steps or fresh.skip_data:
                detail.update(skip_steps=fresh.skip_steps, skip_data=fresh.skip_data)
            out.decide(job, DecisionKind.CHECKPOINT_PLAN, f"again before the restart: {why}",
                       policy=job.policies.labels["checkpoint"], detail=detail)

    def checkpoint(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        """Choose the resume point; first ask live replicas for a dying checkpoint if the policy says so."""
        incident = job.incident
        assert incident is not None
        ctx = self._checkpoint_ctx(job, attempt, not incident.dying_tried, not incident.peer_tried)
        answer = consult(out, job, "checkpoint", "plan", ctx)
        policy = job.policies.labels["checkpoint"]
        if isinstance(answer, SaveDying):
            save = answer.save
            incident.dying_tried = True
            attempt.save = save
            incident.move("save", out.ts)
            command = SaveCheckpoint(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                     deadline_s=60, ranks=list(save.ranks), step=save.step)
            timer = self._ack_timer(out, job, command.id, command.deadline_s)
            attempt.pending = {command.id: (command.kind, timer.id)}
            attempt.acks_due = self._acks_due(job, [command])
            out.decide(job, DecisionKind.CHECKPOINT_DYING, answer.reason, policy=policy,
                       commands=[command], timers=[timer],
                       detail={"step": save.step, "savers": list(save.ranks)})
            return
        resume = _skipping(job, answer.plan if isinstance(answer, Resume) else answer.fallback)
        if any(source.tier is Tier.PEER for source in resume.shards):
            incident.peer_tried = True  # if the peers fail this attempt, the next one saves a dying checkpoint
        if isinstance(answer, AwaitDying) and answer.wait_ns > 0 and not incident.awaited:
            incident.awaited = True  # once per incident: the next plan takes what has landed by then
            attempt.plan = resume
            attempt.awaiting = answer.step
            incident.move("save", out.ts)
            purpose = f"{TimerPurpose.AWAIT}/{incident.id}/{attempt.number}"
            timer = self.timekeeper.request(out, job, purpose, answer.wait_ns)
            attempt.pending = {f"await:{answer.step}": ("await_dying", timer.id)}
            awaiting: dict[str, Any] = {"step": answer.step, "wait_s": answer.wait_ns / NS,
                                        "exiting": len(incident.exiting)}
            commands: list[Any] = []
            if answer.save is not None and answer.save.ranks:
                # The live ranks' shards, asked now: the wait ends when the step is complete, whoever wrote each
                # shard, or at the timer. Their ack is not waited for (a failed save leaves the step incomplete).
                incident.dying_tried = True
                commands.append(SaveCheckpoint(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                               deadline_s=answer.wait_ns / NS, ranks=list(answer.save.ranks),
                                               step=answer.save.step))
                awaiting["savers"] = list(answer.save.ranks)
            out.decide(job, DecisionKind.CHECKPOINT_AWAITING, answer.reason, policy=policy, timers=[timer],
                       commands=commands, detail=awaiting)
            return
        attempt.plan = resume
        attempt.planned_at = out.seq
        detail: dict[str, Any] = {"checkpoint_step": resume.checkpoint_step, "next_step": resume.next_step,
                                  "tiers": _tier_counts(resume)}
        if incident.bad_step is not None:
            detail.update(bad_step=incident.bad_step, skip_steps=resume.skip_steps, skip_data=resume.skip_data)
        out.decide(job, DecisionKind.CHECKPOINT_PLAN, answer.reason, policy=policy, detail=detail)
        self._stop(out, job, attempt)

    def _acks_due(self, job: Job, commands: list[Any]) -> dict[str, tuple[str, ...]]:
        """Per command, the nodes whose agents must each report it done: every node it is addressed to (as the
        daemon addresses it, from the placement after this record) except hosts this incident declared gone or the
        cluster sees unreachable, whose agents cannot answer (a migration away from a lost node is done when the
        node joined says so). Acting on the first node's `done` would restart a job while another node still stops
        or saves its part."""
        incident = job.incident
        gone = incident.dead_hosts if incident is not None else frozenset()
        due: dict[str, tuple[str, ...]] = {}
        for command in commands:
            nodes = tuple(n for n in command_nodes(command, job.node_of, job.nodes)
                          if n not in gone and self.cluster.reachable(n))
            if len(nodes) > 1:
                due[command.id] = nodes
        return due

    def _ack_timer(self, out: RecordEffects, job: Job, command_id: str, deadline_s: float) -> TimerRequest:
        return self.timekeeper.request(out, job, f"{TimerPurpose.ACK}/{command_id}", int(deadline_s * NS))

    def _stop(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        incident = job.incident
        assert incident is not None
        stopping = [r for r in attempt.stopping if job.alive[r]]
        if not stopping:
            self._reschedule(out, job, attempt)
            return
        incident.move("stop", out.ts)
        # Hung or faulty processes are killed, and so are healthy ones on a node being vacated: the plan takes their
        # state from elsewhere, so a grace period buys nothing. The rest of a job stopped whole gets SIGTERM and a
        # grace period to exit cleanly.
        faulty = {r for f in incident.faults for r in f["ranks"]}
        kill = attempt.granularity in (G.IN_PLACE, G.MIGRATE) or all(r in faulty for r in stopping)
        mode: Literal["graceful", "kill"] = "kill" if kill else "graceful"
        # A rank that cannot run a handler after a fault waits on a rank the fault took: killed at once (agents that
        # announce capabilities know the word; a log of older ones is decided as it was). A drain's or an operator's
        # stop waits for every rank: its collectives complete.
        stuck: Literal["wait", "kill"] = ("kill" if mode == "graceful" and incident.cause is IncidentCause.FAULT
                                          and job.caps is not None else "wait")
        command = StopRanks(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                            ranks=stopping, mode=mode, grace_s=30.0, stuck=stuck)
        incident.stopped |= frozenset(stopping)
        timer = self._ack_timer(out, job, command.id, command.deadline_s)
        attempt.pending = {command.id: (command.kind, timer.id)}
        attempt.acks_due = self._acks_due(job, [command])
        out.decide(job, DecisionKind.RANKS_STOPPING, f"stop {len(stopping)} rank(s) ({mode})",
                   commands=[command], timers=[timer])

    def _reschedule(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        incident = job.incident
        assert incident is not None
        g = attempt.granularity
        incident.move("reschedule", out.ts)
        if g is G.DUMP:
            step = attempt.plan.checkpoint_step if attempt.plan else None
            self.fail_job(out, job, f"dumped: checkpoint at step {step}; the job stops for an operator", None)
            return
        if attempt.purpose is AttemptPurpose.PAUSE:
            self.timekeeper.cancel(attempt.deadline_timer)
            attempt.outcome = AttemptOutcome.PAUSED
            incident.move("pause", out.ts)
            out.decide(job, DecisionKind.JOB_PAUSED, attempt.reason, trigger="pause",
                       cancelled=[attempt.deadline_timer] if attempt.deadline_timer else [])
            return
        self._refresh_plan(out, job, attempt)
        if attempt.carried and (not _same_sources(incident.attempts[-2].plan, attempt.plan, attempt.carried)
                                or set(attempt.carried) >= set(attempt.ranks)):
            # The carried processes were started to resume from another source or step than this plan's (their
            # peer replica died too, say): they restart with it, the restart command replacing them. Nor is a
            # restart made of carried ranks alone: an empty command would leave the attempt waiting for no ack.
            attempt.carried, attempt.carried_ids = (), ()
        cid = out.command_id(job.id)
        commands: list[Any] = []
        if g is G.RETRY:
            # A retry is a new generation with no process restarted: a process group whose collective failed is
            # unusable, so every rank forms the next generation's in its own process (as survivors of an in-place
            # restart do) and trains the interrupted step again. No rank's process is replaced (rank_gen stays).
            job.generation += 1
            commands.append(RetryStep(id=cid, job=job.id, attempt=job.generation, deadline_s=60,
                                      step=incident.fault_step + 1))
        else:
            plan = attempt.plan
            assert plan is not None
            job.generation += 1
            gen = job.generation
            # Compute times are compared within a generation: a rank moved off a slow node starts a clean tally.
            job.compute_steps = [0] * job.world
            job.compute_ns = [0] * job.world
            if g is G.IN_PLACE:
                commands.append(RestartRanks(id=cid, job=job.id, attempt=gen, deadline_s=120,
                                             ranks=[r for r in attempt.ranks if r not in attempt.carried], plan=plan,
                                             reset_devices={n: list(d) for n, d in attempt.reset.items()}))
            elif g is G.MIGRATE:
                spares = self.placement.spares_for(job)
                moved_off = [name for name in attempt.vacate if name not in job.nodes]
                if moved_off:
                    # A move of an earlier attempt failed while this one stopped its ranks, and was undone: the
                    # nodes this attempt was to vacate no longer hold the job's ranks. Plan again on the placement
                    # as it is now.
                    job.generation -= 1
                    self.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED,
                                     f"the placement changed under it: {', '.join(moved_off)} no longer in the job")
                    return
                if len(spares) < len(attempt.vacate):
                    job.generation -= 1
                    self.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED, "the spare nodes it needed are gone")
                    return
                for index, name in enumerate(attempt.vacate):
                    target = spares[index]
                    ranks = list(job.ranks_on(name))
                    self.cluster.release(name, job.id)
                    self.cluster.assign(target, job.id)
                    job.replace_node(name, target)
                    move = MigrateRanks(id=cid if index == 0 else out.command_id(job.id), job=job.id,
                                        attempt=gen, deadline_s=300, ranks=ranks, from_node=name,
                                        to_node=target, plan=plan)
                    attempt.moves[move.id] = (name, target)
                    commands.append(move)
                moved = {r for c in commands for r in c.ranks}  # type: ignore[attr-defined]
                staying = [r for r in attempt.ranks if r not in moved]
                if staying:
                    commands.append(RestartRanks(id=out.command_id(job.id), job=job.id, attempt=gen,
                                                 deadline_s=120, ranks=staying, plan=plan,
                                                 reset_devices={n: list(d) for n, d in attempt.reset.items()}))
            else:
                placement = self.placement.place(job, attempt)
                if placement is None:
                    job.generation -= 1
                    self.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED, "not enough usable nodes left")
                    return
                nodes, dp = placement
                # The survivors chosen when the attempt started, if still live where the placement keeps them.
                kept = {old: new for old, new in self.placement.survivors(job, nodes).items()
                        if old not in attempt.ranks} if dp != job.layout.dp else {}
                if dp != job.layout.dp and len(kept) < job.world - len(attempt.ranks):
                    # Some are gone, or on a node the placement no longer keeps (it became unusable meanwhile): the
                    # plan may name them as the source of the state. Plan again with what is left.
                    job.generation -= 1
                    self.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED,
                                     "the processes it was to keep are not all kept now")
                    return
                for name in job.nodes:
                    if name not in nodes:
                        self.cluster.release(name, job.id)
                for name in nodes:
                    self.cluster.assign(name, job.id)
                if dp != job.layout.dp:
                    job.reshard(job.layout.scaled(dp), plan.checkpoint_step)
                    job.resize(job.layout.scaled(dp), nodes, out.ts)
                    for rank in kept.values():
                        job.put(job.alive, rank, 1)  # their processes live on, in the new world
                    attempt.ranks = tuple(range(job.world))
                    attempt.covered = None
                    # The old world's rank numbers name no rank of the new one (they are renumbered, and fewer
                    # after a scale-in), and no process of the new world is exiting or stopped by the engine: the
                    # kept ones live on, the rest start now. Subtracting the new numbers below would leave old
                    # ones past the new world, for a policy to index.
                    incident.exiting = incident.stopped = frozenset()
                    commands.append(ScaleJob(id=cid, job=job.id, attempt=gen, deadline_s=600, dp=dp,
                                             nodes=nodes, plan=plan, kept=sorted(kept.values())))
                else:
                    job.nodes = nodes
                    commands.append(RestartJob(id=cid, job=job.id, attempt=gen, deadline_s=600, nodes=nodes,
                                               plan=plan))
            started = [r for r in attempt.ranks if r not in attempt.carried]
            for rank in started:
                job.put(job.rank_gen, rank, job.generation)  # these ranks get new processes
            attempt.restart_ids = tuple(c.id for c in commands)
            incident.fresh = incident.fresh | frozenset(started) if g is G.IN_PLACE else frozenset()
            restarted = frozenset(attempt.ranks)
            # Their new processes are neither stopping nor exiting: an exit of theirs is news again.
            incident.exiting -= restarted
            incident.stopped -= restarted
            # Every rank rolls back to the resume point, restarted or not.
            start = plan.checkpoint_step or 0
            job.steps = [start] * job.world
            job.step = start
            job.step_ts = None
        timers = [self._ack_timer(out, job, c.id, c.deadline_s) for c in commands]
        attempt.pending = {c.id: (c.kind, t.id) for c, t in zip(commands, timers, strict=True)}
        attempt.acks_due = self._acks_due(job, commands)
        out.decide(job, DecisionKind.RANKS_RESCHEDULING, f"{g.value}: {len(commands)} command(s)",
                   commands=commands, timers=timers,
                   detail={"attempt": attempt.number, "generation": job.generation,
                           "nodes": list(job.nodes)})

    def ack(self, out: RecordEffects, job: Job, data: kinds.CommandAck) -> None:
        incident = job.incident
        if incident is not None and data.status != "accepted":
            self._settle_move(job, incident, data.command_id, data.status == "done")
        attempt = incident.attempt if incident is not None else None
        if attempt is not None and data.status == "failed" and data.command_id in attempt.carried_ids:
            self.end_attempt(out, job, attempt, AttemptOutcome.FAILED, f"the restart of rank(s) "
                             f"{', '.join(map(str, attempt.carried))} it carried over failed: {data.reason}")
            return
        if attempt is None or data.command_id not in attempt.pending or attempt.awaiting is not None:
            return  # an ack for a finished or superseded attempt, or for isolate commands: kept in the log
        if data.status == "accepted":
            return
        due = attempt.acks_due.get(data.command_id)
        if data.status == "done" and due is not None:
            # An ack that names no node (an executor that answers once per command) completes the command, as
            # before acks named their node.
            node = data.result.get("node")
            left = tuple(n for n in due if n != node) if isinstance(node, str) else ()
            if left:
                attempt.acks_due[data.command_id] = left
                return
            del attempt.acks_due[data.command_id]
        kind, ack_timer = attempt.pending.pop(data.command_id)
        cancelled = self.timekeeper.cancel(ack_timer)
        if data.status == "failed":
            if kind == "save_checkpoint":
                out.decide(job, DecisionKind.CHECKPOINT_DYING_FAILED, data.reason or "dying checkpoint failed",
                           cancelled=cancelled)
                attempt.pending.clear()
                self.checkpoint(out, job, attempt)
                return
            if kind == "restart_ranks":
                self._reset_failed(attempt, data)
            self.end_attempt(out, job, attempt, AttemptOutcome.FAILED, f"{kind} failed: {data.reason}".rstrip(": "),
                              cancelled)
            return
        if attempt.pending:
            if cancelled:
                out.decide(job, DecisionKind.COMMAND_DONE, f"{kind} done", cancelled=cancelled)
            return
        assert incident is not None
        if incident.phase == "saving":
            out.decide(job, DecisionKind.CHECKPOINT_DYING_DONE, f"dying checkpoint at step "
                       f"{attempt.save.step if attempt.save else '?'} saved",
                         cancelled=cancelled)
            self.checkpoint(out, job, attempt)
        elif incident.phase == "stopping":
            for rank in attempt.stopping:
                job.put(job.alive, rank, 0)
            out.decide(job, DecisionKind.RANKS_STOPPED, f"{len(attempt.stopping)} rank(s) stopped",
                       cancelled=cancelled)
            self._reschedule(out, job, attempt)
        elif incident.phase == "rescheduling":
            self.restoring(out, job, attempt, cancelled)

    def _reset_failed(self, attempt: Attempt, data: kinds.CommandAck) -> None:
        """The devices an agent could not reset (`result.reset_failed`, on its node `result.node`) are bad again:
        the attempt counted them usable when it started (`start`), and a restart on them would fail the same way.
        They stay out of `resettable`, so the ladder moves their ranks rather than trying the reset again. Anything
        else in the result (a device the attempt did not reset, not a list) is an agent's mistake: ignored."""
        node, devices = data.result.get("node"), data.result.get("reset_failed")
        if not isinstance(node, str) or not isinstance(devices, list):
            return
        meant = attempt.reset.get(node, ())
        failed = {d for d in devices if isinstance(d, int) and not isinstance(d, bool) and d in meant}
        if failed and node in self.cluster.nodes:
            self.cluster.node(node).bad_devices.update(failed)

    def _reset_unconfirmed(self, attempt: Attempt) -> None:
        """The attempt timed out while the restart that resets its devices was unanswered: the reset may never have
        run. (A superseded attempt's restart is still under way: its executor does the reset.) Its devices count
        bad again, as before the attempt (`start` counted them usable), and a reset may still clear them. Counted
        usable, a job-level restart put ranks on a device that still needed a reset, and every executor refused it
        for as long as the job lived."""
        if attempt.reset and any(kind == "restart_ranks" for kind, _ in attempt.pending.values()):
            for name, devices in sorted(attempt.reset.items()):
                if name in self.cluster.nodes:
                    self.cluster.node(name).bad_devices.update(devices)
                    self.cluster.node(name).resettable.update(devices)

    def _settle_move(self, job: Job, incident: Incident, command_id: str, done: bool) -> None:
        """A migration's outcome is known: done, it stays; failed or unanswered, the ranks never left their node, so
        the placement goes back and the target returns to the spare pool. Without this the job's placement and the
        cluster's drift apart: the next move names a node the job is not on, and the target is lost to the pool.

        A later attempt may have moved the same ranks on from the target while this move was under way (it was
        superseded before its ack): the ranks never reached the target, so every later move of that slot fails too.
        The slot goes back to the source wherever the chain of moves put it, and each node of the chain is a free
        spare again."""
        for attempt in reversed(incident.attempts):  # a superseded attempt's move may still be under way
            move = attempt.moves.pop(command_id, None)
            if move is None:
                continue
            if done:
                return
            source, target = move
            chain = [target]
            while chain[-1] not in job.nodes and len(chain) <= len(incident.attempts):
                onward = self._onward_move(incident, chain[-1])
                if onward is None:
                    return  # the slot went elsewhere (a job-level restart placed it anew): nothing to undo
                chain.append(onward)
            holder = chain[-1]
            owner = self.cluster.nodes[source].job if source in self.cluster.nodes else None
            if holder in job.nodes and source not in job.nodes and owner is None:
                job.replace_node(holder, source)
                for name in chain:
                    self.cluster.release(name, job.id)
                    if self.cluster.node(name).job is None:
                        self.cluster.node(name).spare = True
                self.cluster.assign(source, job.id)
            return

    @staticmethod
    def _onward_move(incident: Incident, node: str) -> str | None:
        """The target of a move still under way from `node` (dropped: it cannot succeed once the move to `node`
        failed), or None."""
        for attempt in incident.attempts:
            for command_id, (source, target) in list(attempt.moves.items()):
                if source == node:
                    del attempt.moves[command_id]
                    return target
        return None


def _skipping(job: Job, plan: ResumePlan | None) -> ResumePlan | None:
    """`plan` with the data the job skips (its bad steps'), whichever policy made it."""
    if plan is None:
        return None
    steps, data = job.skips()
    if not steps and not data:
        return plan
    return plan.model_copy(update={"skip_steps": steps, "skip_data": data})


def _resume_of(answer: CheckpointPlan) -> ResumePlan | None:
    """The plan an answer would restart from (none for a dying checkpoint to save first)."""
    if isinstance(answer, Resume):
        return answer.plan
    return answer.fallback if isinstance(answer, AwaitDying) else None


def _same_sources(before: ResumePlan | None, after: ResumePlan | None, ranks: tuple[int, ...]) -> bool:
    """Would `ranks`, started under `before`, resume as `after` says: from the same step and tier, or from live
    peers under both (a process started to take its state from live replicas takes it at whatever step they are
    at when it joins, and from whichever of them the group names)?"""
    if before is None or after is None:
        return False
    if all(_tier_of(before, r) is Tier.PEER and _tier_of(after, r) is Tier.PEER for r in ranks):
        return True
    return before.checkpoint_step == after.checkpoint_step and all(
        _tier_of(before, r) == _tier_of(after, r) for r in ranks)


def _tier_of(plan: ResumePlan, rank: int) -> Tier | None:
    return plan.shards[rank % len(plan.shards)].tier if plan.shards else None


def _tier_counts(plan: ResumePlan) -> dict[str, int]:
    """Shards per tier the plan reads from."""
    counts: dict[str, int] = {}
    for source in plan.shards:
        counts[source.tier.value] = counts.get(source.tier.value, 0) + 1
    return dict(sorted(counts.items()))

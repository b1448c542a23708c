"""The incident lifecycle: from a confirmed fault (or an operator's order) to progress past the resume point.

An incident is open while the job recovers. Each attempt of it is planned by the job's rescheduling policy
(start a rung, wait for nodes, settle, or fail), saves a dying checkpoint or awaits one if the checkpoint policy
says so, chooses its resume point, stops the processes that must go, sends the restart, migrate or scale commands,
and waits for their acknowledgements and then for progress past the resume point; a deadline, a failed command or
a fault outside the attempt ends it and the policy is asked again.
"""

from __future__ import annotations

from typing import Any, Literal

from events import kinds
from events.commands import (
    FailJob,
    MigrateRanks,
    RestartJob,
    RestartRanks,
    RetryStep,
    SaveCheckpoint,
    ScaleJob,
    StopRanks,
)
from events.names import (
    ATTEMPT_ENDED,
    AttemptOutcome,
    AttemptPurpose,
    DecisionKind,
    IncidentCause,
    IncidentOutcome,
    TimerPurpose,
)
from events.values import FaultClass, Granularity, Layout, ResumePlan, Tier
from policies.base import (
    NS,
    AwaitDying,
    CheckpointContext,
    CheckpointPlan,
    Fail,
    RescheduleContext,
    Resume,
    SaveDying,
    Settle,
    StartRung,
    Wait,
)
from recovery.core.addressing import command_nodes
from recovery.core.cluster import ClusterView
from recovery.core.job import CLOSED_INCIDENTS, Attempt, Incident, Job
from recovery.core.machine import fire
from recovery.core.placement import Placement, fit_dp
from recovery.core.record import RecordEffects, Rejected, ask, expect
from recovery.core.timers import Timekeeper, TimerRequest

G = Granularity
MAX_PLANS_PER_RECORD = 16
"""a record that would ask the rescheduling policy more often than this (each answer superseded at once) makes the
job wait instead: a policy and a cluster that keep refusing each other must not loop"""
MAX_WAIT_NS = 4 * 3600 * NS
"""the deadline of a wait the policy set none for, or that the engine made because it could not place the policy's
choice: then the policy is asked for its fallback, and a fallback the engine cannot place either fails the job"""
RESTARTS = (G.IN_PLACE, G.MIGRATE, G.RESTART_JOB, G.SCALE_IN, G.SCALE_OUT)
"""granularities that count against the job's `max_restarts`"""


class Incidents:
    def __init__(self, cluster: ClusterView, timekeeper: Timekeeper, placement: Placement) -> None:
        self.cluster = cluster
        self.timekeeper = timekeeper
        self.placement = placement

    def plan(self, out: RecordEffects, job: Job, forced: Granularity | None = None) -> None:
        incident = job.incident
        assert incident is not None
        if incident.phase != "planning":
            incident.move("plan", out.ts)
        vacate = self.placement.vacate(job)
        spares = self.placement.spares_for(job)
        fault_class = incident.fault_class or FaultClass.PROCESS
        migrate = vacate or self.placement.fault_nodes(job)
        ctx = RescheduleContext(
            fault_class=fault_class, scope="job", needs_move=bool(vacate),
            any_lost=not all(job.alive), previous=incident.history(), used=_incident_usage(incident),
            restarts_used=job.restarts_used, max_restarts=job.spec.max_restarts,
            nodes_to_replace=len(vacate), nodes_to_migrate=len(migrate), spares_available=len(spares),
            dp=job.layout.dp,
            scale_in_dp=self.placement.scale_in_dp(job, vacate), forced=forced,
            widened=incident.widened, step_time_ns=job.step_time, wait_expired=incident.wait_expired,
            waited_ns=0 if incident.waiting_since is None else out.ts - incident.waiting_since,
            reset_clears=self.placement.reset_clears(vacate),
            nodes_after_reset=len(self.placement.split_by_reset(vacate)[0]),
        )
        answer = ask(job, "rescheduling", job.policies.rescheduling.decide, ctx)
        expect(job, "rescheduling", answer, (StartRung, Wait, Settle, Fail))
        policy = job.policies.labels["rescheduling"]
        out.plans += 1
        short = None
        if isinstance(answer, StartRung):
            short = self._unplaceable(job, answer, vacate, migrate, len(spares), forced)
        if short is None and out.plans > MAX_PLANS_PER_RECORD:
            short = f"asked {out.plans} times within one record"
        if short is not None:
            chose = answer.granularity.value if isinstance(answer, StartRung) else "nothing"
            if incident.wait_expired:
                # The wait has run out and the fallback cannot be placed either: waiting again would have no end.
                self.fail_job(out, job, f"waited for nodes until the deadline; then {policy} chose {chose}, which "
                                        f"cannot be placed: {short}", policy)
                return
            # The policy chose what the cluster cannot carry out now. Asking again at once would get the same answer
            # (a policy is a pure function of the same context): wait until nodes come back, and say why.
            timers, cancelled = self._wait(out, job, MAX_WAIT_NS)
            out.decide(job, DecisionKind.ATTEMPT_WAITING, f"{policy} chose {chose}, which cannot be placed: {short}; "
                       f"wait for nodes", policy=policy, timers=timers, cancelled=cancelled,
                       detail={"vacate": vacate, "spares": len(spares), "refused": answer.reason})
            return
        if isinstance(answer, Settle):
            purpose = f"{TimerPurpose.SETTLE}/{incident.id}/{len(incident.attempts)}"
            timer = self.timekeeper.request(out, job, purpose, answer.settle_ns)
            incident.settle_timer = timer.id
            incident.move("settle", out.ts)
            out.decide(job, DecisionKind.ATTEMPT_SETTLING, answer.reason, policy=policy,
                       timers=[timer], detail={"faults": len(incident.faults)})
            return
        if isinstance(answer, Wait):
            deadline = MAX_WAIT_NS if answer.deadline_ns is None else answer.deadline_ns
            timers, cancelled = self._wait(out, job, deadline)
            out.decide(job, DecisionKind.ATTEMPT_WAITING, answer.reason, policy=policy, timers=timers,
                       cancelled=cancelled, detail={"vacate": vacate, "spares": len(spares)})
            return
        if isinstance(answer, Fail) or answer.granularity is G.FAIL:
            self.fail_job(out, job, answer.reason, policy)
            return
        g = answer.granularity
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=g, rung=answer.rung,
                          purpose=AttemptPurpose.DUMP if g is G.DUMP else AttemptPurpose.RECOVER,
                          reason=answer.reason, started=out.ts)
        if answer.reset_devices:
            # The reset makes those nodes usable: their ranks restart where they are, only the rest move.
            vacate, attempt.reset = self.placement.split_by_reset(vacate)
        keys = (f"{fault_class.value}/{g.value}", g.value)
        attempt.budget_keys = keys
        for key in keys:
            job.used[key] = job.used.get(key, 0) + 1
        if g in RESTARTS:
            job.restarts_used += 1
        self.start(out, job, attempt, answer.deadline_ns, policy, vacate)

    def _wait(self, out: RecordEffects, job: Job, deadline_ns: int) -> tuple[list[TimerRequest], list[str]]:
        """The job waits for nodes, until `deadline_ns` after the stretch of waiting began: a job asked again while
        it waits (a fault joins, a node returns) keeps the start of its stretch, so that no stretch outlasts the
        deadline of the policy's latest answer. The timer is armed again only when that deadline moves (an XID 48
        alone waits minutes for a spare, a lost host joining it hours). Returns the timers armed and cancelled."""
        incident = job.incident
        assert incident is not None
        incident.move("wait", out.ts)
        if incident.wait_expired:
            # The policy chose to wait again after its deadline: a new stretch with a deadline of its own (a deadline
            # already past would fire at once, and again, without end).
            incident.wait_expired = False
            incident.waiting_since = None
        if incident.waiting_since is None:
            incident.waiting_since = out.ts
        due = incident.waiting_since + deadline_ns
        armed = self.timekeeper.table.get(incident.wait_timer) if incident.wait_timer is not None else None
        if armed is not None and armed[1] == max(due, out.ts + 1):
            return [], []
        cancelled = self.timekeeper.cancel(incident.wait_timer)
        purpose = f"{TimerPurpose.WAIT}/{incident.id}/{len(incident.attempts)}"
        timer = self.timekeeper.request(out, job, purpose, max(1, due - out.ts))
        incident.wait_timer = timer.id
        return [timer], cancelled

    def _end_wait(self, incident: Incident) -> list[str]:
        """The stretch of waiting is over (an attempt starts): its deadline goes, and the next wait starts afresh."""
        incident.waiting_since = None
        incident.wait_expired = False
        cancelled = self.timekeeper.cancel(incident.wait_timer)
        incident.wait_timer = None
        return cancelled

    def _unplaceable(self, job: Job, answer: StartRung, vacate: list[str], migrate: list[str], spares: int,
                     forced: Granularity | None) -> str | None:
        """Why an attempt of granularity `g` cannot be carried out on the cluster as it is, or None if it can.
        The engine checks every policy's answer: a third-party ladder that picks a restart the cluster cannot
        place must not make the engine supersede, refund and ask again without end."""
        g = answer.granularity
        if answer.reset_devices:
            must_move, reset = self.placement.split_by_reset(vacate)
            if not reset or g not in (G.IN_PLACE, G.MIGRATE):
                return "no device a reset clears keeps the ranks off their nodes"
            if g is G.IN_PLACE and must_move:
                return f"a device reset leaves {len(must_move)} node(s) unusable"
            if g is G.MIGRATE and not must_move:
                return "nothing to move once the devices are reset"
            if g is G.MIGRATE and len(must_move) > spares:
                return f"{len(must_move)} node(s) to move after the reset, {spares} spare(s)"
            return None
        if g is G.MIGRATE and len(migrate) > spares:
            return f"{len(migrate)} node(s) to move, {spares} spare(s)"
        if g in (G.RESTART_JOB, G.DUMP) and len(vacate) > spares:
            return f"{len(vacate)} node(s) to replace, {spares} spare(s)"
        if g is G.IN_PLACE and vacate and forced is None:
            return f"node(s) {', '.join(vacate)} cannot run processes now"
        if g is G.SCALE_IN:
            elastic = job.spec.elastic
            if elastic is None:
                return "the job is not elastic"
            if self.placement.scale_in_dp(job, vacate) is None:
                return f"no data-parallel size within [{elastic.min_dp}, {elastic.max_dp}] fits the usable nodes"
        if g is G.SCALE_OUT:
            return "scale-out is started by the engine when nodes return, not a recovery"
        return None

    def start(self, out: RecordEffects, job: Job, attempt: Attempt, deadline_ns: int, policy: str | None,
               vacate: list[str], trigger: str | None = None) -> None:
        incident = job.incident
        assert incident is not None
        if incident.phase != "planning":
            incident.move("plan", out.ts)  # a resume from `paused`
        # An operator's order can start an attempt while a settle window is open: the window has no more to say.
        settle = self.timekeeper.cancel(incident.settle_timer) + self._end_wait(incident)
        incident.settle_timer = None
        for name, devices in attempt.reset.items():
            # The restart resets these devices first: the cluster counts them usable from now on, as a repair would.
            self.cluster.node(name).bad_devices.difference_update(devices)
            self.cluster.node(name).resettable.difference_update(devices)
        incident.widened = False
        incident.attempts.append(attempt)
        g = attempt.granularity
        dead = tuple(r for r in range(job.world) if not job.alive[r])
        if g is G.RETRY:
            attempt.ranks = ()
        elif g is G.IN_PLACE:
            # Faults from before a scale-in may name ranks the smaller job no longer has (as in _fault_nodes).
            fault_ranks = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(set(dead) | fault_ranks))
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        elif g is G.MIGRATE:
            vacate = vacate or self.placement.fault_nodes(job)
            attempt.vacate = tuple(vacate)
            moved = {r for n in vacate for r in job.ranks_on(n)}
            # Dead or faulty ranks on the nodes that stay restart where they are, in the same attempt.
            faulty = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(moved | set(dead) | faulty))
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        else:  # job level: restart, scale, dump
            attempt.ranks = tuple(range(job.world))
            attempt.stopping = tuple(r for r in range(job.world) if job.alive[r])
            attempt.vacate = tuple(vacate)
        timer = self.timekeeper.request(out, job, f"{TimerPurpose.ATTEMPT}/{incident.id}/{attempt.number}", deadline_ns)
        attempt.deadline_timer = timer.id
        out.decide(job, DecisionKind.ATTEMPT_STARTED, attempt.reason, trigger=trigger, policy=policy, timers=[timer],
                   cancelled=settle, detail={"attempt": attempt.number, "granularity": g.value, "rung": attempt.rung,
                           "ranks": list(attempt.ranks), "vacate": list(attempt.vacate)})
        if g is G.RETRY:
            self._reschedule(out, job, attempt)
        else:
            self.checkpoint(out, job, attempt)

    def _checkpoint_ctx(self, job: Job, attempt: Attempt, dying_allowed: bool, peer_allowed: bool
                        ) -> CheckpointContext:
        incident = job.incident
        assert incident is not None
        saving_ranks = set(attempt.ranks) if attempt.granularity is G.IN_PLACE else set()
        alive = tuple(bool(job.alive[r]) and r not in saving_ranks for r in range(job.world))
        return CheckpointContext(
            layout=job.layout, catalog=job.frozen_catalog(), placement=tuple(job.nodes[r // job.rpn]
                                                                              for r in range(job.world)),
            unreachable=frozenset(n for n in job.nodes if not self.cluster.reachable(n)) | incident.dead_hosts,
            alive=alive, steps=tuple(job.steps), dying_allowed=dying_allowed, peer_allowed=peer_allowed,
            restarting=frozenset(attempt.ranks),
            exiting=incident.exiting if dying_allowed and not incident.awaited else frozenset(),
        )

    def _refresh_plan(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        """The plan a restart carries is made from what is known when the command is sent: while processes were
        stopped, live replicas may have trained on, a newer checkpoint (a dying one written by SIGTERM handlers)
        may have landed, or a holder may have gone. Ask again; a different answer replaces the plan."""
        plan = attempt.plan
        if plan is None:
            return
        peer = any(source.tier is Tier.PEER for source in plan.shards)
        answer = ask(job, "checkpoint", job.policies.checkpoint.plan, self._checkpoint_ctx(job, attempt, False, peer))
        expect(job, "checkpoint", answer, CHECKPOINT_ANSWERS)
        fresh = _resume_of(answer) or plan
        if fresh != plan:
            attempt.plan = fresh
            why = (f"{plan.checkpoint_step} is no longer where the live replicas are" if peer else
                   f"step {plan.checkpoint_step} is no longer the newest complete, reachable checkpoint")
            out.decide(job, DecisionKind.CHECKPOINT_PLAN, f"again before the restart: {why}",
                       policy=job.policies.labels["checkpoint"],
                       detail={"checkpoint_step": fresh.checkpoint_step, "next_step": fresh.next_step,
                               "tiers": _tier_counts(fresh)})

    def checkpoint(self, out: RecordEffects, job: Job, attempt: Attempt) -> None:
        """Choose the resume point; first ask live replicas for a dying checkpoint if the policy says so."""
        incident = job.incident
        assert incident is not None
        ctx = self._checkpoint_ctx(job, attempt, not incident.dying_tried, not incident.peer_tried)
        answer = ask(job, "checkpoint", job.policies.checkpoint.plan, ctx)
        expect(job, "checkpoint", answer, CHECKPOINT_ANSWERS)
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
        resume = answer.plan if isinstance(answer, Resume) else answer.fallback
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
            out.decide(job, DecisionKind.CHECKPOINT_AWAITING, answer.reason, policy=policy, timers=[timer],
                       detail={"step": answer.step, "wait_s": answer.wait_ns / NS,
                               "exiting": len(incident.exiting)})
            return
        attempt.plan = resume
        out.decide(job, DecisionKind.CHECKPOINT_PLAN, answer.reason, policy=policy,
                   detail={"checkpoint_step": resume.checkpoint_step, "next_step": resume.next_step,
                           "tiers": _tier_counts(resume)})
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
        command = StopRanks(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                            ranks=stopping, mode=mode, grace_s=30.0)
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
        cid = out.command_id(job.id)
        commands: list[Any] = []
        if g is G.RETRY:
            commands.append(RetryStep(id=cid, job=job.id, attempt=job.generation, deadline_s=60,
                                      step=incident.fault_step + 1))
        else:
            plan = attempt.plan
            assert plan is not None
            job.generation += 1
            gen = job.generation
            if g is G.IN_PLACE:
                commands.append(RestartRanks(id=cid, job=job.id, attempt=gen, deadline_s=120,
                                             ranks=list(attempt.ranks), plan=plan,
                                             reset_devices={n: list(d) for n, d in attempt.reset.items()}))
            elif g is G.MIGRATE:
                spares = self.placement.spares_for(job)
                if len(spares) < len(attempt.vacate):
                    job.generation -= 1
                    self.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED, "the spare nodes it needed are gone")
                    return
                for index, name in enumerate(attempt.vacate):
                    target = spares[index]
                    ranks = list(job.ranks_on(name))
                    self.cluster.release(name, job.id)
                    self.cluster.assign(target, job.id)
                    job.nodes[job.nodes.index(name)] = target
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
                for name in job.nodes:
                    if name not in nodes:
                        self.cluster.release(name, job.id)
                for name in nodes:
                    self.cluster.assign(name, job.id)
                if dp != job.layout.dp:
                    job.resize(Layout(dp=dp, tp=job.layout.tp, pp=job.layout.pp), nodes, out.ts)
                    attempt.ranks = tuple(range(job.world))
                    attempt.covered = None
                    commands.append(ScaleJob(id=cid, job=job.id, attempt=gen, deadline_s=600, dp=dp,
                                             nodes=nodes, plan=plan))
                else:
                    job.nodes = nodes
                    commands.append(RestartJob(id=cid, job=job.id, attempt=gen, deadline_s=600, nodes=nodes,
                                               plan=plan))
            for rank in attempt.ranks:
                job.put(job.rank_gen, rank, job.generation)  # these ranks get new processes
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
            incident.move("restore", out.ts)
            for rank in attempt.ranks:
                job.put(job.alive, rank, 1)
            job.last_seen = [out.ts] * job.world
            job.last_progress = [out.ts] * job.world
            out.decide(job, DecisionKind.RANKS_RESTORING, "executors done: waiting for progress past step "
                       f"{self._resume_step(job, attempt)}",
                         cancelled=cancelled)

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

    def _settle_move(self, job: Job, incident: Incident, command_id: str, done: bool) -> None:
        """A migration's outcome is known: done, it stays; failed or unanswered, the ranks never left their node, so
        the placement goes back and the target returns to the spare pool. Without this the job's placement and the
        cluster's drift apart: the next move names a node the job is not on, and the target is lost to the pool."""
        for attempt in reversed(incident.attempts):  # a superseded attempt's move may still be under way
            move = attempt.moves.pop(command_id, None)
            if move is None:
                continue
            if done:
                return
            source, target = move
            owner = self.cluster.nodes[source].job if source in self.cluster.nodes else None
            if target in job.nodes and source not in job.nodes and owner is None:
                job.nodes[job.nodes.index(target)] = source
                self.cluster.release(target, job.id)
                self.cluster.node(target).spare = True
                self.cluster.assign(source, job.id)
            return

    def _resume_step(self, job: Job, attempt: Attempt) -> int:
        if attempt.granularity is G.RETRY:
            assert job.incident is not None
            return job.incident.fault_step
        return attempt.plan.checkpoint_step or 0 if attempt.plan else 0

    def check_restored(self, out: RecordEffects, job: Job, rank: int, step: int) -> None:
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is None or job.phase != "restoring":
            return
        if attempt.granularity is not G.RETRY and rank not in attempt.ranks:
            return
        resume = self._resume_step(job, attempt)
        if step <= resume:
            return
        assert incident is not None
        attempt.outcome = AttemptOutcome.RECOVERED
        cancelled = self.timekeeper.cancel(attempt.deadline_timer)
        lost = max(0, incident.fault_step - resume) if incident.cause is IncidentCause.FAULT else 0
        incident.lost_steps = lost
        self.close(job, out.ts, IncidentOutcome.RECOVERED)
        out.decide(job, DecisionKind.INCIDENT_CLOSED, f"progress to step {step} past resume point {resume}",
                   trigger="recovered", cancelled=cancelled, timers=self.timekeeper.arm_watchdog(out, job),
                   detail={"incident": incident.id, "lost_steps": lost, "attempts": len(incident.attempts),
                           "granularity": attempt.granularity.value,
                           "mttr_ns": out.ts - incident.opened})

    def close(self, job: Job, ts: int, outcome: IncidentOutcome) -> None:
        incident = job.incident
        assert incident is not None
        incident.move("close", ts)
        incident.phases[-1][2] = ts
        incident.closed = ts
        incident.outcome = outcome
        job.closed.append(incident.summary())
        del job.closed[:-CLOSED_INCIDENTS]
        job.incident = None

    def end_attempt(self, out: RecordEffects, job: Job, attempt: Attempt, outcome: AttemptOutcome, reason: str,
                     cancelled: list[str] | None = None, plan: bool = True) -> None:
        attempt.outcome = outcome
        gone = list(cancelled or [])
        gone += self.timekeeper.cancel(attempt.deadline_timer, *(timer for _, timer in attempt.pending.values()))
        attempt.pending.clear()
        attempt.acks_due.clear()
        if outcome is AttemptOutcome.SUPERSEDED:
            # A fault that widened the incident is not the attempt's failure: give back its budget.
            for key in attempt.budget_keys:
                job.used[key] -= 1
            if attempt.granularity in RESTARTS:
                job.restarts_used -= 1
        out.decide(job, ATTEMPT_ENDED[outcome], reason, cancelled=gone,
                   detail={"attempt": attempt.number, "granularity": attempt.granularity.value})
        if plan:
            self.plan(out, job)

    def supersede(self, out: RecordEffects, job: Job, reason: str) -> None:
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is not None:
            attempt.outcome = AttemptOutcome.SUPERSEDED
            cancelled = self.timekeeper.cancel(attempt.deadline_timer,
                                               *(timer for _, timer in attempt.pending.values()))
            attempt.pending.clear()
            out.decide(job, DecisionKind.ATTEMPT_SUPERSEDED, reason, cancelled=cancelled,
                       detail={"attempt": attempt.number})

    def open(self, out: RecordEffects, job: Job, cause: IncidentCause) -> Incident:
        if job.incident is None:
            cancelled = self.timekeeper.cancel(job.watchdog)
            job.watchdog = None
            job.incident = Incident(id=job.next_incident_id(), opened_seq=out.seq, opened=out.ts,
                                    fault_step=job.step, fault_class=None, cause=cause)
            if cancelled:
                out.decide(job, DecisionKind.WATCHDOG_DISARMED, f"{cause} incident", trigger="recover",
                           cancelled=cancelled)
            else:  # a running job always has its watchdog armed: kept so the machine stays right regardless
                fire(job, "recover")
        return job.incident

    def fail_job(self, out: RecordEffects, job: Job, reason: str, policy: str | None) -> None:
        command = FailJob(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=60,
                          reason=reason)
        cancelled = self.timekeeper.cancel(*self.timekeeper.of_job(job))
        if job.incident is not None:
            self.close(job, out.ts, IncidentOutcome.FAILED)
        job.suspects.clear()
        job.watchdog = None
        for name in job.nodes:
            self.cluster.release(name, job.id)
        out.decide(job, DecisionKind.JOB_FAILED, reason, trigger="fail", policy=policy, commands=[command],
                   cancelled=cancelled)

    def scale(self, out: RecordEffects, job: Job, dp: int, reason: str, cause: IncidentCause) -> None:
        per_replica = job.layout.tp * job.layout.pp
        need = dp * per_replica
        if need % job.rpn:
            raise Rejected("invalid_request", f"dp={dp} needs {need} ranks, not a whole number of "
                                             f"{job.rpn}-rank nodes")
        have = len([n for n in job.nodes if self.cluster.usable_by(n, job.rpn)]) + len(self.placement.spares_for(job))
        dp = min(dp, fit_dp(job.layout, job.rpn, have, dp) or job.layout.dp)
        if dp == job.layout.dp:
            return
        incident = self.open(out, job, cause)
        g = G.SCALE_OUT if dp > job.layout.dp else G.SCALE_IN
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=g, rung=0, purpose=AttemptPurpose.SCALE,
                          reason=reason, started=out.ts, dp=dp)
        self.start(out, job, attempt, 900 * NS, None, [])

    def timer_fired(self, out: RecordEffects, job: Job, timer_id: str) -> None:
        """One of the open incident's timers fired: its settle window, its attempt's deadline, or the time an
        acknowledgement (or a dying checkpoint) was due."""
        incident = job.incident
        if incident is not None and timer_id == incident.wait_timer:
            incident.wait_timer = None
            incident.wait_expired = True
            waited = out.ts - (incident.waiting_since or out.ts)
            out.decide(job, DecisionKind.WAIT_EXPIRED, f"waited {waited / NS:.0f} s for nodes: ask the policy for its "
                       f"fallback", detail={"waited_s": waited / NS})
            self.plan(out, job)
            return
        if incident is not None and timer_id == incident.settle_timer:
            incident.settle_timer = None
            incident.widened = False
            self.plan(out, job)
            return
        attempt = incident.attempt if incident is not None else None
        if attempt is None:
            return
        if timer_id == attempt.deadline_timer:
            attempt.deadline_timer = None
            self.end_attempt(out, job, attempt, AttemptOutcome.TIMED_OUT, f"attempt {attempt.number} "
                                                             f"({attempt.granularity.value}) missed its deadline")
            return
        for cid, (kind, timer) in list(attempt.pending.items()):
            if timer_id == timer:
                if kind in ("save_checkpoint", "await_dying"):
                    attempt.pending.clear()
                    why = ("no ack for the dying checkpoint in time" if kind == "save_checkpoint" else
                           f"the dying checkpoint at step {attempt.awaiting} was not complete in time")
                    attempt.awaiting = None
                    out.decide(job, DecisionKind.CHECKPOINT_DYING_FAILED, why)
                    self.checkpoint(out, job, attempt)
                else:
                    assert incident is not None
                    self._settle_move(job, incident, cid, done=False)
                    self.end_attempt(out, job, attempt, AttemptOutcome.TIMED_OUT, f"no ack for {kind} {cid} in time")
                return


CHECKPOINT_ANSWERS = (Resume, SaveDying, AwaitDying)


def _resume_of(answer: CheckpointPlan) -> ResumePlan | None:
    """The plan an answer would restart from (none for a dying checkpoint to save first)."""
    if isinstance(answer, Resume):
        return answer.plan
    return answer.fallback if isinstance(answer, AwaitDying) else None


def _incident_usage(incident: Incident) -> dict[str, int]:
    """Attempts of this incident by '<class>/<granularity>' and by granularity: the ladder's rung budgets are
    per incident (how often a rung is tried before the next), and the spec's max_restarts covers the job's
    life; a life-long rung budget ran out within two weeks at 16,384 GPUs and failed healthy jobs."""
    used: dict[str, int] = {}
    for attempt in incident.attempts:
        if attempt.outcome is not AttemptOutcome.SUPERSEDED:
            for key in attempt.budget_keys:
                used[key] = used.get(key, 0) + 1
    return used


def _tier_counts(plan: ResumePlan) -> dict[str, int]:
    """Shards per tier the plan reads from."""
    counts: dict[str, int] = {}
    for source in plan.shards:
        counts[source.tier.value] = counts.get(source.tier.value, 0) + 1
    return dict(sorted(counts.items()))

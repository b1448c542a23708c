"""The incident lifecycle: from a confirmed fault (or an operator's order) to progress past the resume point.

An incident is open while the job recovers. Each attempt of it is planned by the job's rescheduling policy
(start a rung, wait for nodes, settle, or fail), saves a dying checkpoint or awaits one if the checkpoint policy
says so, chooses its resume point, stops the processes that must go, sends the restart, migrate or scale commands,
and waits for their acknowledgements and then for progress past the resume point; a deadline, a failed command or
a fault outside the attempt ends it and the policy is asked again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from events import kinds
from events.commands import FailJob
from events.names import (
    ATTEMPT_ENDED,
    AttemptOutcome,
    AttemptPurpose,
    DecisionKind,
    IncidentCause,
    IncidentOutcome,
    TimerPurpose,
)
from events.values import FaultClass, Granularity, Tier
from policies.base import NS, Fail, PastIncident, RescheduleContext, Scope, Settle, StartRung, Wait
from recovery.core.cluster import ClusterView
from recovery.core.job import CLOSED_INCIDENTS, RESTART_TIMES, Attempt, Incident, Job, dead_ranks
from recovery.core.machine import fire
from recovery.core.placement import Placement, fit_dp
from recovery.core.record import RecordEffects, Rejected
from recovery.core.restarts import Restarts
from recovery.core.sandbox import builtin, consult, fail_over
from recovery.core.timers import Timekeeper, TimerRequest

G = Granularity
MAX_PLANS_PER_RECORD = 16
"""a record that would ask the rescheduling policy more often than this (each answer superseded at once) makes the
job wait instead: a policy and a cluster that keep refusing each other must not loop"""
MAX_WAIT_NS = 4 * 3600 * NS
"""the deadline of a wait the policy set none for, or that the engine made because it could not place the policy's
choice: then the policy is asked for its fallback, and a fallback the engine cannot place either fails the job"""
LOOP_ANSWERS = 8
"""a rescheduling plugin's settle windows in a row, or its waits answered after their own deadline, beyond which it
loops: each is a valid answer, together they never end"""
PLAN_BURST = 64
PLAN_BURST_NS = 10 * NS
"""a rescheduling plugin asked PLAN_BURST times within PLAN_BURST_NS of log time loops too"""
MIN_GRACE_NS = 1 * NS
DEFAULT_GRACE_NS = 30 * NS
RECENT_INCIDENTS = 8
"""the closed incidents a rescheduling policy sees"""
RESTARTS = (G.IN_PLACE, G.MIGRATE, G.RESTART_JOB, G.SCALE_IN, G.SCALE_OUT)
"""granularities that count against the job's `max_restarts`"""


class Incidents(Restarts):
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
            fault_class=fault_class, scope=_scope(incident), needs_move=bool(vacate),
            any_lost=not all(job.alive), previous=incident.history(), used=_incident_usage(incident),
            restarts_used=job.restarts_used, max_restarts=job.spec.max_restarts,
            nodes_to_replace=len(vacate), nodes_to_migrate=len(migrate), spares_available=len(spares),
            dp=job.layout.dp,
            scale_in_dp=self.placement.scale_in_dp(job, vacate), forced=forced,
            widened=incident.widened, step_time_ns=job.step_time, wait_expired=incident.wait_expired,
            waited_ns=0 if incident.waiting_since is None else out.ts - incident.waiting_since,
            reset_clears=self.placement.reset_clears(vacate),
            nodes_after_reset=len(self.placement.split_by_reset(vacate)[0]),
            sdk=job.sdk, reform=job.can("reform"), now_ns=out.ts, fault_step=incident.fault_step,
            fault_ranks=tuple(sorted({r for f in incident.faults for r in f["ranks"]})),
            recent=_recent(job), restart_times=job.restart_times, exits=incident.exits, world=job.world,
        )
        answer = consult(out, job, "rescheduling", "decide", ctx)
        loop = self._looping(out, job, incident, answer, ctx)
        if loop is not None:
            answer = fail_over(out, job, "rescheduling", "decide", ctx, loop)
        policy = job.policies.labels["rescheduling"]
        out.plans += 1
        short = None
        if (isinstance(answer, StartRung) and answer.granularity is G.MIGRATE and forced is G.MIGRATE
                and not job.can("reform")):
            # Survivors that cannot join restarted peers: a move is a job-level restart, the nodes off it replaced.
            vacate = migrate
            answer = replace(answer, granularity=G.RESTART_JOB, reason=f"{answer.reason}: the script does not use the "
                             f"SDK, so every rank restarts, off {', '.join(migrate) or 'no node'}")
        if isinstance(answer, StartRung):
            short = self._unplaceable(job, answer, vacate, migrate, len(spares), forced)
        if short is not None and forced is not None:
            # An operator's order the cluster cannot carry out is refused as a whole (the attempt under way goes on),
            # with the reason `recovery-ctl` shows: made to wait for nodes, it would look accepted and do nothing.
            raise Rejected("invalid_request", f"cannot force {forced.value} on job {job.id}: {short}")
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
            job.restart_times = (*job.restart_times[-RESTART_TIMES + 1:], out.ts)
        attempt.grace_ns = max(answer.grace_ns, MIN_GRACE_NS) if isinstance(answer.grace_ns, int) else DEFAULT_GRACE_NS
        self.start(out, job, attempt, answer.deadline_ns, policy, vacate)

    @staticmethod
    def _looping(out: RecordEffects, job: Job, incident: Incident, answer: Any, ctx: RescheduleContext
                 ) -> str | None:
        """Why the job's rescheduling plugin loops, or None: each answer of its may be valid while together they
        never end (Settle again and again, Wait again past every deadline, answers that start nothing that lasts).
        The built-in ladder is ours, and its answers end."""
        if builtin(job.policies.rescheduling):
            return None
        times = (*incident.plan_times[-(PLAN_BURST - 1):], out.ts)
        incident.plan_times = times
        if len(times) >= PLAN_BURST and out.ts - times[0] < PLAN_BURST_NS:
            incident.plan_times = ()
            return (f"was asked {PLAN_BURST} times within {PLAN_BURST_NS / NS:g} s of log time: its answers start "
                    f"nothing that lasts")
        if isinstance(answer, Settle):
            incident.settles += 1
            if incident.settles > LOOP_ANSWERS:
                incident.settles = 0
                return f"answered Settle {LOOP_ANSWERS + 1} times in a row without starting an attempt"
        elif isinstance(answer, Wait) and ctx.wait_expired:
            incident.rewaits += 1
            if incident.rewaits > LOOP_ANSWERS:
                incident.rewaits = 0
                return f"answered Wait {LOOP_ANSWERS + 1} times in a row, each after the last one's deadline"
        elif isinstance(answer, StartRung | Fail):
            incident.settles = incident.rewaits = 0
        return None

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
        if g is G.MIGRATE and not migrate:
            return "no node to move: none is unusable and no rank is faulty or gone"
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
        dead = dead_ranks(job.alive)
        if g is G.RETRY:
            attempt.ranks = ()
        elif g is G.IN_PLACE:
            # Faults from before a scale-in may name ranks the smaller job no longer has (as in _fault_nodes).
            fault_ranks = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(set(dead) | fault_ranks))
            previous = incident.attempts[-2] if len(incident.attempts) > 1 else None
            if (previous is not None and previous.outcome is AttemptOutcome.SUPERSEDED
                    and previous.granularity is G.IN_PLACE and not attempt.reset):
                # A second fault superseded an in-place restart already sent: the processes it started are new and
                # faultless, and take the newest generation's state like any survivor. Replacing them again would
                # cost a second cold start for nothing.
                attempt.carried = tuple(r for r in attempt.ranks if r in incident.fresh)
                attempt.carried_ids = previous.carried_ids + previous.restart_ids
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r] and r not in attempt.carried)
        elif g is G.MIGRATE:
            vacate = vacate or self.placement.fault_nodes(job)
            attempt.vacate = tuple(vacate)
            moved = {r for n in vacate for r in job.ranks_on(n)}
            # Dead or faulty ranks on the nodes that stay restart where they are, in the same attempt.
            faulty = {r for f in incident.faults for r in f["ranks"] if r < job.world}
            attempt.ranks = tuple(sorted(moved | set(dead) | faulty))
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        else:  # job level: restart, scale, dump
            attempt.vacate = tuple(vacate)
            # A scale keeps the live processes on the nodes it keeps (they re-form in the new world and are the
            # peers the others take their state from); everything else restarts.
            placed = self.placement.place(job, attempt) if g in (G.SCALE_IN, G.SCALE_OUT) else None
            if placed is not None:  # the size the plan is made for (its kept processes, its peers): a spare that
                attempt.dp = placed[1]  # joins before the restart must not make it another size, restarting them all
            kept = self.placement.survivors(job, placed[0]) if placed is not None and placed[1] != job.layout.dp else {}
            attempt.ranks = tuple(r for r in range(job.world) if r not in kept)
            attempt.stopping = tuple(r for r in attempt.ranks if job.alive[r])
        timer = self.timekeeper.request(out, job, f"{TimerPurpose.ATTEMPT}/{incident.id}/{attempt.number}", deadline_ns)
        attempt.deadline_timer = timer.id
        detail: dict[str, Any] = {"attempt": attempt.number, "granularity": g.value, "rung": attempt.rung,
                                  "ranks": list(attempt.ranks), "vacate": list(attempt.vacate)}
        if attempt.carried:
            detail["carried"] = list(attempt.carried)
        out.decide(job, DecisionKind.ATTEMPT_STARTED, attempt.reason, trigger=trigger, policy=policy, timers=[timer],
                   cancelled=settle, detail=detail)
        if g is G.RETRY:
            self._reschedule(out, job, attempt)
        else:
            self.checkpoint(out, job, attempt)

    def closes(self, job: Job, rank: int, step: int | None, current: bool) -> bool:
        """Would `rank` reporting `step` (`current`: in the job's newest generation) close the incident?"""
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is None or step is None or job.phase != "restoring":
            return False
        retry = attempt.granularity is G.RETRY
        if retry and not current:
            return False  # a step of the failed group's generation: the retry shows only in the new one
        if step <= self._resume_step(job, attempt):
            return False
        return retry or rank in attempt.restarted  # the step first: `restarted` is a set made on first use

    def may_close(self, job: Job, entries: Sequence[kinds.RankProgress | kinds.StepReported | kinds.Heartbeat]
                  ) -> bool:
        """Could one of these progress entries close the incident (`closes`)? Asked once per record, before any
        entry is applied: a restoring job's every report asks it."""
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        if attempt is None or job.phase != "restoring":
            return False
        resume = self._resume_step(job, attempt)
        steps = [(entry.rank, entry.attempt, step) for entry in entries
                 if (step := getattr(entry, "step", None)) is not None and step > resume]
        if not steps:
            return False
        if attempt.granularity is G.RETRY:
            return any(generation == job.generation for _, generation, _ in steps)
        restarted = attempt.restarted
        return any(rank in restarted for rank, _, _ in steps)

    def check_restored(self, out: RecordEffects, job: Job, rank: int, step: int, current: bool = True) -> None:
        """`rank` reported `step`; `current`: in the job's newest generation."""
        if not self.closes(job, rank, step, current):
            return
        incident = job.incident
        attempt = incident.attempt if incident is not None else None
        assert incident is not None and attempt is not None
        self._recovered(out, job, attempt, *self._progress_past(job, incident, attempt, step))

    def _recovered(self, out: RecordEffects, job: Job, attempt: Attempt, reason: str, lost: int | None) -> None:
        """The attempt worked: close the incident (`lost`: the steps trained again, None when the script reports
        none) and arm the watchdog again."""
        incident = job.incident
        assert incident is not None
        attempt.outcome = AttemptOutcome.RECOVERED
        cancelled = self.timekeeper.cancel(attempt.deadline_timer, attempt.grace_timer)
        incident.lost_steps = lost
        self.close(job, out.ts, IncidentOutcome.RECOVERED)
        out.decide(job, DecisionKind.INCIDENT_CLOSED, reason,
                   trigger="recovered", cancelled=cancelled,
                   timers=self.timekeeper.arm_watchdog(out, job) if job.watchdog is None else [],
                   detail={"incident": incident.id, "lost_steps": lost, "attempts": len(incident.attempts),
                           "granularity": attempt.granularity.value,
                           "mttr_ns": out.ts - incident.opened})

    def restoring(self, out: RecordEffects, job: Job, attempt: Attempt, cancelled: list[str]) -> None:
        incident = job.incident
        assert incident is not None
        incident.move("restore", out.ts)
        for rank in attempt.ranks:
            job.put(job.alive, rank, 1)
        job.last_seen = [out.ts] * job.world
        job.last_progress = [out.ts] * job.world
        timers: list[TimerRequest] = []
        if not job.sdk and attempt.granularity is not G.RETRY:
            # A stock script reports no step: the processes running for the policy's grace period is the only
            # sign that the restart worked (an exit within it fails the attempt).
            timer = self.timekeeper.request(out, job, f"{TimerPurpose.GRACE}/{incident.id}/{attempt.number}",
                                            attempt.grace_ns)
            attempt.grace_timer = timer.id
            timers.append(timer)
            why = (f"executors done: the script reports no steps, so the restarted processes must run "
                   f"{attempt.grace_ns / NS:g} s")
        else:
            why = f"executors done: waiting for progress past step {self._resume_step(job, attempt)}"
        out.decide(job, DecisionKind.RANKS_RESTORING, why, cancelled=cancelled, timers=timers)

    def _running(self, job: Job, attempt: Attempt) -> bool:
        """Are the attempt's processes of a stock script all running (it reports no step to tell more)?"""
        return not job.sdk and job.phase == "restoring" and all(job.alive[r] for r in attempt.ranks)

    def close(self, job: Job, ts: int, outcome: IncidentOutcome) -> None:
        incident = job.incident
        assert incident is not None
        incident.move("close", ts)
        incident.phases[-1][2] = ts
        incident.closed = ts
        incident.outcome = outcome
        if incident.bad_steps:  # skipped by every later plan too: an older checkpoint must not train them again
            steps, data = job.skips()
            job.skip_steps, job.skip_data = tuple(steps), tuple(data)
        job.closed.append(incident.summary())
        del job.closed[:-CLOSED_INCIDENTS]
        job.incident = None

    def end_attempt(self, out: RecordEffects, job: Job, attempt: Attempt, outcome: AttemptOutcome, reason: str,
                     cancelled: list[str] | None = None, plan: bool = True) -> None:
        attempt.outcome = outcome
        gone = list(cancelled or [])
        gone += self.timekeeper.cancel(attempt.deadline_timer, *(timer for _, timer in attempt.pending.values()))
        if outcome is AttemptOutcome.TIMED_OUT:
            self._reset_unconfirmed(attempt)
        attempt.pending.clear()
        attempt.acks_due.clear()
        if outcome is AttemptOutcome.SUPERSEDED:
            # A fault that widened the incident is not the attempt's failure: give back its budget, and a transfer
            # from live peers it planned may be planned again (no peer failed it).
            incident = job.incident
            if incident is not None and attempt.plan is not None and any(
                    source.tier is Tier.PEER for source in attempt.plan.shards):
                incident.peer_tried = False
            for key in attempt.budget_keys:
                job.used[key] -= 1
            if attempt.granularity in RESTARTS:
                job.restarts_used -= 1
                if attempt.started in job.restart_times:
                    times = list(job.restart_times)
                    del times[len(times) - 1 - times[::-1].index(attempt.started)]
                    job.restart_times = tuple(times)
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

    def disarm_watchdog(self, job: Job) -> list[str]:
        """An incident opens: the watchdog stops, unless the agents of the job's nodes send heartbeats. Then it goes
        on through the recovery, watching the agents only (`Detection.watchdog`): a host lost while the job recovers
        is found as one lost while it runs, not by an attempt waiting out its agent's answer."""
        if self.cluster.agents_heard(job.nodes):
            return []
        cancelled = self.timekeeper.cancel(job.watchdog)
        job.watchdog = None
        return cancelled

    def open(self, out: RecordEffects, job: Job, cause: IncidentCause) -> Incident:
        if job.incident is None:
            cancelled = self.disarm_watchdog(job)
            job.incident = Incident(id=job.next_incident_id(), opened_seq=out.seq, opened=out.ts,
                                    fault_step=job.step, fault_class=None, cause=cause)
            if cancelled:
                out.decide(job, DecisionKind.WATCHDOG_DISARMED, f"{cause} incident", trigger="recover",
                           cancelled=cancelled)
            else:  # the watchdog goes on watching the agents (or was not armed): the job recovers all the same
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
        per_replica = job.layout.per_replica
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
        if timer_id == attempt.grace_timer:
            attempt.grace_timer = None
            if self._running(job, attempt):
                self._recovered(out, job, attempt, f"the {len(attempt.ranks)} restarted process(es) ran "
                                f"{attempt.grace_ns / NS:g} s without exiting (the script reports no steps)", None)
            return
        if timer_id == attempt.deadline_timer:
            attempt.deadline_timer = None
            if self._running(job, attempt):
                # Never kill a stock script that trains: its processes run, which is all it can show.
                self._recovered(out, job, attempt, f"the {len(attempt.ranks)} restarted process(es) still run at "
                                f"the attempt's deadline (the script reports no steps)", None)
                return
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


def _recent(job: Job) -> tuple[PastIncident, ...]:
    """The job's latest closed incidents as a policy sees them, oldest first."""
    recent = []
    for summary in job.closed[-RECENT_INCIDENTS:]:
        fault_class = summary["fault_class"]
        resumes = [a["resume_step"] for a in summary["attempts"] if a["resume_step"] is not None]
        recent.append(PastIncident(
            fault_class=None if fault_class is None else FaultClass(fault_class), fault_step=summary["fault_step"],
            resume_step=resumes[-1] if resumes else None, opened_ns=summary["opened"],
            closed_ns=summary["closed"] if summary["closed"] is not None else summary["opened"],
            outcome=str(summary["outcome"]),
            ranks=tuple(sorted({r for f in summary["faults"] for r in f["ranks"]})),
            nodes=tuple(summary.get("nodes", ()))))  # none kept before nodes were: say none, not a guess
    return tuple(recent)


_SCOPES: tuple[Scope, ...] = ("rank", "device", "link", "node", "job")


def _scope(incident: Incident) -> Scope:
    """The widest scope of the incident's faults: a host that fell silent is a node's loss, not the job's."""
    widest = max((_SCOPES.index(f["scope"]) for f in incident.faults if f.get("scope") in _SCOPES), default=4)
    return _SCOPES[widest]

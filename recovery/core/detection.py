"""Detection: what a signal means for a job, and when a suspicion becomes a fault.

The job's detection policy classifies each signal (ignore, suspect, clear, fault, drain) and checks the watchdog
view on every tick; this part keeps the suspicions and their confirmation timers, confirms suspicions due
together as one fault set, plans drains of sub-healthy nodes, marks hardware out of service, and records each
confirmed fault in the job's incident (opening one, or widening the one under way).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from events import kinds
from events.commands import DumpStacks, IsolateDevice, IsolateNode
from events.names import AttemptOutcome, AttemptPurpose, DecisionKind, IncidentCause, TimerPurpose
from events.values import FaultClass, Granularity
from policies.base import NS, Clear, Drain, Fault, Ignore, RankColumns, Signal, Suspect, Verdict, WatchdogView
from policies.detection import DefaultDetection
from recovery.core.cluster import ClusterView
from recovery.core.failures import note_exit
from recovery.core.incidents import Incidents
from recovery.core.job import Attempt, Incident, Job
from recovery.core.placement import Placement
from recovery.core.record import RecordEffects, expect
from recovery.core.sandbox import consult, knows_deadlines
from recovery.core.timers import Timekeeper, TimerRequest

G = Granularity
_PROCESS_FAULTS = (FaultClass.PROCESS, FaultClass.HANG, None)
_SEVERITY = {FaultClass.PROCESS: 1, FaultClass.HANG: 2, FaultClass.NETWORK: 3, FaultClass.DEVICE: 4,
             FaultClass.PREEMPTION: 5, FaultClass.NODE: 6, FaultClass.BAD_STEP: 0}
"""how much of the job a fault class's recovery must redo, least first: a widened incident takes the worst"""


class Detection:
    def __init__(self, cluster: ClusterView, timekeeper: Timekeeper, placement: Placement,
                 incidents: Incidents) -> None:
        self.cluster = cluster
        self.timekeeper = timekeeper
        self.placement = placement
        self.incidents = incidents
        self.hardware = DefaultDetection()  # judges device faults on nodes no job runs on
        self.ending: int | None = None  # the rank whose exit the record being handled reports, while it is

    def signal(self, out: RecordEffects, job: Job, signal: Signal) -> None:
        if job.state in ("submitted", "paused"):
            if isinstance(signal.data, kinds.DeviceFault):  # no recovery now, but the hardware is what it is
                verdict = consult(out, job, "detection", "classify", signal)
                if isinstance(verdict, Fault):
                    self.mark_hardware(verdict)
            return
        verdict = consult(out, job, "detection", "classify", signal)
        note_exit(job, signal.data, signal.ts)  # counted before the plan this exit may bring about
        if isinstance(verdict, Fault) and job.incident is None:
            # A fault that opens the incident: its exit is counted in it before the first plan too.
            self.fault(out, job, verdict, job.policies.labels["detection"], plan=False, signal_type=signal.type)
            if job.incident is not None:
                note_exit(job, signal.data, signal.ts)
                self.incidents.plan(out, job)
            return
        self.verdict(out, job, verdict, type_=signal.type)

    def mark_hardware(self, verdict: Fault) -> None:
        """What a confirmed fault says of the hardware, whoever runs there: an isolated node, a bad device."""
        if verdict.node is None:
            return
        if verdict.isolate == "node":
            self.cluster.node(verdict.node).isolated = True
        if verdict.needs_move and verdict.device is not None:
            node = self.cluster.node(verdict.node)
            node.bad_devices.add(verdict.device)
            if verdict.reset_clears and verdict.isolate is None:
                node.resettable.add(verdict.device)
            else:
                node.resettable.discard(verdict.device)  # isolated, or worse than a reset clears
            if verdict.isolate == "device":
                node.isolated_devices.add(verdict.device)

    def verdict(self, out: RecordEffects, job: Job, verdict: Verdict, type_: str) -> None:
        policy = job.policies.labels["detection"]
        if isinstance(verdict, Fault):
            self.fault(out, job, verdict, policy, signal_type=type_)
        elif isinstance(verdict, Ignore):
            if type_ not in ("network.link_up", "node.ready", "device.recovered"):
                out.decide(job, DecisionKind.SIGNAL_IGNORED, verdict.reason, policy=policy,
                           detail={"signal": type_, "code": verdict.code})
        elif isinstance(verdict, Clear):
            entry = job.suspects.pop(verdict.key, None)
            if entry is None:
                return
            cancelled = self.timekeeper.cancel(entry[1])
            out.decide(job, DecisionKind.FAULT_CLEARED, verdict.reason, policy=policy,
                       cancelled=cancelled, detail={"key": verdict.key})
        elif isinstance(verdict, Suspect):
            key = verdict.key or f"{type_}:{out.seq}"
            if key in job.suspects:
                return  # already counting down: a repeated signal does not restart the debounce
            timer = self.timekeeper.request(out, job, f"{TimerPurpose.CONFIRM}/{key}", verdict.confirm_after_ns)
            job.suspects[key] = (verdict.fault, timer.id)
            out.decide(job, DecisionKind.FAULT_SUSPECTED, verdict.reason, policy=policy,
                       timers=[timer], detail={"key": key, "ranks": list(verdict.fault.ranks)})
        elif isinstance(verdict, Drain):
            node = verdict.node
            if node is None or node not in job.nodes or node in job.drains:
                return
            job.drains[node] = verdict.reason
            out.decide(job, DecisionKind.NODE_DRAIN_PLANNED, verdict.reason, policy=policy,
                       detail={"node": node, "device": verdict.device, "code": verdict.code,
                               **dict(verdict.evidence)})
        else:
            expect(job, "detection", verdict, (Ignore, Suspect, Clear, Fault, Drain))

    def drain(self, out: RecordEffects, job: Job, step: int) -> None:
        """Move the ranks off sub-healthy nodes now that `step` is a complete checkpoint: a planned pod-level move
        that loses nothing, instead of a fault later."""
        for gone in [n for n in job.drains if n not in job.nodes]:
            del job.drains[gone]  # the job left it meanwhile
        nodes = list(job.drains)
        if not nodes:
            return
        spares = self.placement.spares_for(job)
        if len(spares) < len(nodes):
            out.decide(job, DecisionKind.NODE_DRAIN_DEFERRED, f"{len(nodes)} node(s) to drain, {len(spares)} spare(s): "
                       f"try again at the next checkpoint",
                         detail={"nodes": nodes, "step": step})
            return
        for name in nodes:
            self.cluster.node(name).drained = True  # no new work lands there until it rejoins
        reasons = "; ".join(job.drains[n] for n in nodes)
        job.drains.clear()
        incident = self.incidents.open(out, job, IncidentCause.DRAIN)
        attempt = Attempt(number=len(incident.attempts) + 1, granularity=G.MIGRATE, rung=0,
                          purpose=AttemptPurpose.DRAIN,
                          reason=f"checkpoint at step {step} complete: drain {', '.join(nodes)} ({reasons})",
                          started=out.ts)
        self.incidents.start(out, job, attempt, 900 * NS, None, nodes)

    def release_due(self, out: RecordEffects, job: Job, timer_id: str) -> bool:
        """An isolation's expiry fired (`<job>/release/<node>/<device or ->/<seq>`): the node or device is usable
        again unless a repair or a replacement released it already. False if `timer_id` is no expiry."""
        prefix = f"{job.id}/{TimerPurpose.RELEASE}/"
        if not timer_id.startswith(prefix):
            return False
        name, device_text, _ = timer_id[len(prefix):].rsplit("/", 2)  # a node id may hold a slash
        node = self.cluster.nodes.get(name)
        if node is None:
            return True
        if device_text == "-":
            if not node.isolated:
                return True
            node.isolated = False
            what = f"node {name}"
        else:
            device = int(device_text)
            if device not in node.isolated_devices:
                return True
            node.isolated_devices.discard(device)
            node.bad_devices.discard(device)
            what = f"{name} device {device}"
        out.decide(job, DecisionKind.HARDWARE_RELEASED, f"the isolation of {what} set by "
                   f"{job.policies.labels['detection']} expired: usable again",
                   detail={"node": name, "device": None if device_text == "-" else int(device_text),
                           "by": "expiry"})
        return True

    def fault(self, out: RecordEffects, job: Job, verdict: Fault, policy: str, plan: bool = True,
              signal_type: str | None = None) -> None:
        """Record a confirmed fault; with `plan`, decide what to do (off for all but the last of a batch).
        `signal_type`: the event it came from, if one did."""
        commands: list[Any] = []
        timers: list[TimerRequest] = []
        if verdict.isolate is not None and verdict.node is not None and verdict.isolate_for_ns is not None:
            # The policy bounds the isolation: a timer in the log ends it, and its release is a decision.
            which = "-" if verdict.isolate == "node" else str(verdict.device or 0)
            timers.append(self.timekeeper.request(out, job, f"{TimerPurpose.RELEASE}/{verdict.node}/{which}",
                                                  verdict.isolate_for_ns))
        if verdict.isolate is not None and verdict.node is not None:
            if verdict.isolate == "node":
                commands.append(IsolateNode(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                            deadline_s=60, node=verdict.node, reason=verdict.reason))
            else:
                commands.append(IsolateDevice(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                              deadline_s=60, node=verdict.node, device=verdict.device or 0,
                                              reason=verdict.reason))
        if verdict.fault_class is FaultClass.HANG and job.state != "submitted":
            # Seed 004's `dump`, before acting: every process's stack while it still hangs, for the postmortem to
            # compare (the odd one out is the rank the others wait for). The agents hold back a kill until it is
            # taken; the engine waits for nothing.
            commands.append(DumpStacks(id=out.command_id(job.id), job=job.id, attempt=job.generation, deadline_s=30,
                                       reason=verdict.reason))
        self.mark_hardware(verdict)
        if not verdict.ranks and verdict.scope != "job":
            # Hardware none of the job's ranks uses: marked out of service, and the job goes on.
            out.decide(job, DecisionKind.HARDWARE_MARKED, verdict.reason, policy=policy, commands=commands,
                       timers=timers, detail={"node": verdict.node, "device": verdict.device, "code": verdict.code})
            return
        if verdict.lost:
            for rank in verdict.ranks:
                job.put(job.alive, rank, 0)
        fault = self._fault_record(out, verdict)
        incident = job.incident
        if incident is not None:
            incident.faults.append(fault)
            incident.struck |= self._struck(job, verdict)
            if incident.fresh.intersection(verdict.ranks):
                incident.fresh = incident.fresh.difference(verdict.ranks)  # a new process that failed: none to carry
            if _SEVERITY.get(verdict.fault_class, 0) > _SEVERITY.get(incident.fault_class, 0):
                # A widened incident is planned for the worst fault it holds: a crash joined by a GPU that fell off
                # the bus needs the node ladder (move now), not the process ladder's restart in place.
                incident.fault_class = verdict.fault_class
            self._note_exiting(incident, verdict)
            self._note_dead_hosts(job, incident, verdict)
            attempt = incident.attempt
            if incident.phase == "waiting" or attempt is None:
                out.decide(job, DecisionKind.FAULT_ADDED, verdict.reason, policy=policy, commands=commands,
                           timers=timers)
                if plan and incident.settle_timer is None:  # a settle window decides when it closes
                    self.incidents.plan(out, job)
                return
            # A collective that failed again under a retry is of the retry's own generation (older ones are dropped as
            # stale before they get here): the group formed again and the step failed again.
            retried_again = attempt.granularity is G.RETRY and signal_type == "process.collective_failed"
            if incident.phase in ("rescheduling", "restoring") and (retried_again or (
                    verdict.fault_class in _PROCESS_FAULTS and (
                        attempt.granularity is G.RETRY or any(r in attempt.ranks for r in verdict.ranks)))):
                # The restarted (or retried) processes themselves crashed or hung: this attempt did not work. New
                # hardware under them (a device, a node, a link) is a new fault instead: it widens the incident.
                out.decide(job, DecisionKind.FAULT_ADDED, verdict.reason, policy=policy, commands=commands,
                           timers=timers)
                why = f"attempt {attempt.number} ({attempt.granularity.value}) failed: {verdict.reason}"
                self.incidents.end_attempt(out, job, attempt, AttemptOutcome.FAILED, why, plan=plan)
                return
            if self._covered(job, attempt, verdict):
                out.decide(job, DecisionKind.FAULT_ABSORBED, verdict.reason, policy=policy, commands=commands,
                           timers=timers, detail={"attempt": attempt.number})
                return
            out.decide(job, DecisionKind.FAULT_ADDED, verdict.reason, policy=policy, commands=commands,
                       timers=timers)
            incident.widened = True
            self.incidents.end_attempt(out, job, attempt, AttemptOutcome.SUPERSEDED, f"new fault outside attempt "
                                       f"{attempt.number}: {verdict.reason}", plan=plan)
            return
        # Pending suspicions stay: the other nodes behind a failed switch confirm later and join this incident.
        cancelled = self.incidents.disarm_watchdog(job)
        job.incident = Incident(id=job.next_incident_id(), opened_seq=out.seq, opened=out.ts,
                                fault_step=job.step, fault_class=verdict.fault_class, cause=IncidentCause.FAULT,
                                faults=[fault], struck=self._struck(job, verdict),
                                ended=set() if self.ending is None else {self.ending})
        self._note_exiting(job.incident, verdict)
        self._note_dead_hosts(job, job.incident, verdict)
        out.decide(job, DecisionKind.FAULT_CONFIRMED, verdict.reason, trigger="recover", policy=policy,
                   commands=commands, timers=timers, cancelled=cancelled, detail={"fault": fault, "step": job.step})
        if plan:
            self.incidents.plan(out, job)

    def bad_step(self, out: RecordEffects, job: Job, verdict: Fault, generation: int, named: tuple[str, ...]) -> None:
        """A bad step (a NaN or spiking loss) reported by a process of `generation`, whose script named `named` as its
        data: every rank rolls back to the newest checkpoint before it, and its data is skipped from then on.

        One rank's bad gradients reach every replica through the all-reduce, so one bad step is followed by bad
        losses everywhere: only the earliest of a generation is rolled back and skipped; a later one is its
        consequence (no decision). An earlier one heard late (another node's report was quicker) moves the
        roll-back before it, as long as the restart has not been sent."""
        policy = job.policies.labels["detection"]
        step = verdict.bad_step
        assert step is not None
        entry = (generation, step, named)
        incident = job.incident
        if incident is not None and incident.bad_step is not None:
            first = next((e for e in incident.bad_steps if e[0] == generation), None)
            if first is not None and step >= first[1]:
                return
            incident.bad_steps = tuple(sorted((*(e for e in incident.bad_steps if e[0] != generation), entry)))
            incident.bad_step = min(incident.bad_step, step)
            incident.faults.append(self._fault_record(out, verdict))
            incident.struck |= self._struck(job, verdict)
            attempt = incident.attempt
            if attempt is not None and incident.phase in ("rescheduling", "restoring") and first is None:
                # The processes the roll-back started report a bad step of their own: the attempt did not work.
                out.decide(job, DecisionKind.FAULT_ADDED, verdict.reason, policy=policy,
                           detail={"bad_step": step})
                self.incidents.end_attempt(out, job, attempt, AttemptOutcome.FAILED, f"attempt {attempt.number} "
                                           f"({attempt.granularity.value}) failed: {verdict.reason}")
                return
            heard = first[1] if first is not None else incident.bad_step
            out.decide(job, DecisionKind.FAULT_ADDED, f"{verdict.reason}: before the bad step {heard} heard first: "
                       f"roll back before it", policy=policy, detail={"bad_step": step})
            return
        if incident is not None:  # another fault's incident: it now resumes before the bad step too
            incident.bad_step, incident.bad_steps = step, (entry,)
            self.fault(out, job, verdict, policy)
            return
        self.fault(out, job, verdict, policy, plan=False)
        incident = job.incident
        assert incident is not None
        incident.bad_step, incident.bad_steps = step, (entry,)
        self.incidents.plan(out, job)

    @staticmethod
    def _fault_record(out: RecordEffects, verdict: Fault) -> dict[str, Any]:
        return {"class": verdict.fault_class.value if verdict.fault_class else None, "scope": verdict.scope,
                "ranks": list(verdict.ranks), "node": verdict.node, "device": verdict.device,
                "code": verdict.code, "reason": verdict.reason, "seq": out.seq, "ts": out.ts}

    @staticmethod
    def _struck(job: Job, verdict: Fault) -> frozenset[str]:
        """The nodes a fault struck, named when it comes: a move takes its ranks elsewhere, and a policy that looks for
        a node in repeated incidents (`PastIncident.nodes`) must see where they ran then. Kept beside the fault's
        record, which decisions carry: a log written before must replay to the decisions it holds."""
        struck = {job.node_of(rank) for rank in verdict.ranks}
        if verdict.node is not None:
            struck.add(verdict.node)
        return frozenset(struck)

    def _note_dead_hosts(self, job: Job, incident: Incident, verdict: Fault) -> None:
        """A node fault declares its hosts gone (their ranks fell silent together, or a host stayed not ready): what
        they held in memory or on local disk is no source for this incident's restarts, whatever the cluster view
        says of their readiness (a silent host has not said it is not ready)."""
        if verdict.fault_class is FaultClass.NODE and verdict.lost:
            hosts = _hosts(job, verdict)
            if not incident.dead_hosts.issuperset(hosts):
                incident.dead_hosts = incident.dead_hosts | hosts
            for host in sorted(hosts):
                # Gone for every job and every placement until it speaks again: no restart lands on it, and a
                # policy sees that its ranks must move (`needs_move`).
                if not self.cluster.node(host).gone:
                    self.cluster.node(host).gone = True

    @staticmethod
    def _note_exiting(incident: Incident, verdict: Fault) -> None:
        """Processes the platform stopped (a preemption whose processes are gone) write a dying checkpoint on their
        way out: the checkpoint policy may hold the restart for it."""
        if verdict.fault_class is FaultClass.PREEMPTION and verdict.lost and not incident.exiting.issuperset(
                verdict.ranks):
            incident.exiting = incident.exiting | frozenset(verdict.ranks)

    def _covered(self, job: Job, attempt: Attempt, verdict: Fault) -> bool:
        """Is this fault already handled by the attempt under way (its ranks restart or stop anyway)?"""
        if attempt.granularity is G.RETRY:
            return not verdict.lost and not verdict.needs_move
        if verdict.node is not None and verdict.node not in attempt.vacate and (
                verdict.needs_move or not self.cluster.usable_by(verdict.node, job.rpn)):
            return False  # the attempt restarts ranks on a node that can take none now: leave it, or wait for it
        if verdict.fault_class is FaultClass.NODE and verdict.lost and not _hosts(job, verdict).issubset(
                attempt.vacate):
            # Hosts declared gone (several at once name no one node) that the attempt keeps: it would wait for their
            # agents' answers until its deadline, and restart ranks where nothing runs.
            return False
        if attempt.covered is None:  # built once: a burst of exits during a 16k-rank restart asks per exit
            attempt.covered = frozenset(attempt.ranks) | frozenset(attempt.stopping)
        covered = attempt.covered
        return all(rank in covered for rank in verdict.ranks)

    def _confirm(self, out: RecordEffects, job: Job, key: str) -> Fault | None:
        """Turn the suspicion `key` into a confirmed fault, or drop it (with a decision) if it no longer applies."""
        verdict, _ = job.suspects.pop(key)
        gone = verdict.node is not None and verdict.node not in job.nodes
        if gone or job.state == "paused":
            # The job left that node (migrated or scaled in) while the suspicion counted down, so its ranks there
            # are gone or renumbered; or an operator paused the job, which takes no signals (as in _signal).
            # Either way there is nothing left to confirm.
            why = f"job no longer on {verdict.node}" if gone else "job is paused"
            out.decide(job, DecisionKind.FAULT_CLEARED, f"{verdict.reason}: {why}",
                       policy=job.policies.labels["detection"], detail={"key": key})
            return None
        ranks = verdict.ranks
        if verdict.node is not None:
            # A resize since the suspicion may have renumbered the node's ranks: keep each rank's slot on the
            # node (rank % ranks_per_node), not its old number.
            on_node = job.ranks_on(verdict.node)
            ranks = tuple(on_node[r % job.rpn] for r in verdict.ranks)
        return replace(verdict, reason=f"confirmed: {verdict.reason}", ranks=ranks)

    def watchdog(self, out: RecordEffects, job: Job, late_ns: int = 0) -> WatchdogView | None:
        """A tick of the job's watchdog, logged `late_ns` after it was due. It ticks through a recovery when the job's
        agents send heartbeats (`Incidents.disarm_watchdog`), looking for lost hosts only. The view it checked (None:
        none, the job idle or the tick late)."""
        recovering = job.state == "recovering"
        if job.state != "running" and not recovering:
            return None
        if late_ns >= int(job.spec.watchdog_interval_s * NS):
            # The tick could not be logged on time: the control plane itself was away (NATS restarting, the daemon
            # down), and so were the events the agents kept in their outboxes meanwhile; some may land just before
            # this tick, the rest just after. The silence up to now is the control plane's, not the job's: count it
            # from now, and the agents' flushed events arrive within the window, or a real silence is found a window
            # later.
            job.last_seen = [out.ts] * job.world  # whole, not rank by rank: the journal restores the old list
            for name in job.nodes:
                if self.cluster.nodes.get(name) is not None and self.cluster.nodes[name].heard is not None:
                    self.cluster.node(name).heard = out.ts
                    if self.cluster.nodes[name].silent is not None:
                        self.cluster.node(name).silent = out.ts
            return None
        view = self._view(out, job, recovering)
        verdicts = consult(out, job, "detection", "check", view)
        if recovering:
            self._hosts_lost(out, job, verdicts)
            return view
        for verdict in verdicts:
            if job.state != "running" or job.incident is not None:
                break
            self.verdict(out, job, verdict, type_="watchdog")
        return view

    def tick(self, out: RecordEffects, job: Job, late_ns: int) -> None:
        """The job's watchdog fired. A tick a summary moved a period and an interval away (`watch`: once, not
        periodic) that fires means that no summary came since: the daemon that wrote them was away or replaced (its
        successor has heard nothing yet), or every rank of the job fell silent at once. Which one, the log cannot
        tell; so the silence up to now is not counted, as a tick logged late does not count it, and the watchdog
        ticks every interval again: a job that stays silent is found a bound later. A tick moved to a deadline
        (periodic) checks, as every tick did."""
        if job.watchdog in self.timekeeper.table:  # periodic: the watchdog as it always ticked
            self.watchdog(out, job, late_ns)
            return
        self.watchdog(out, job, late_ns=max(late_ns, int(job.spec.watchdog_interval_s * NS)))
        if job.state in ("running", "recovering"):
            out.decide(job, DecisionKind.WATCHDOG_RESUMED, "no progress summary since the watchdog's last move: its "
                       "silence until now is not counted, and it ticks every interval again",
                       timers=self.timekeeper.arm_watchdog(out, job))
        else:
            job.watchdog = None  # fired, and gone: armed again when the job runs again

    def watch(self, out: RecordEffects, job: Job, period_s: float) -> None:
        """A progress summary that stands for the job's watchdog tick (`ProgressSummary.watch`): the check runs at its
        record, as at a tick, and the watchdog's next tick moves to an interval after the earliest time the check could
        find anything if nothing else is heard (`DefaultDetection.next_check`), and ticks on from there; or, when that
        is a period and an interval away or more, to a tick there that means the summaries stopped (`tick`). The next
        summary moves it again: a healthy job's watchdog never ticks into the log while its summaries come, and a
        rank's silence is found at the first summary past its bound, or by the deadline's tick. A policy that cannot
        say when (a plugin's) ticks an interval after each summary, and on."""
        timer = job.watchdog
        entry = self.timekeeper.table.get(timer) if timer is not None else None
        if entry is None or job.state not in ("running", "recovering"):
            return
        # A tick overdue at the summary could not be logged on time: the control plane was away, and what its
        # summarizer heard meanwhile is lost. The summary is that late tick, and excuses the silence as it would.
        checked = self.watchdog(out, job, late_ns=max(0, out.ts - entry[1]))
        if job.watchdog != timer or job.state not in ("running", "recovering"):
            return  # the check opened an incident: the watchdog stopped, or goes on watching the agents
        interval = int(job.spec.watchdog_interval_s * NS)
        due, every = out.ts + interval, interval
        policy = job.policies.detection
        if knows_deadlines(policy):
            earliest = policy.next_check(self._view(out, job, job.state == "recovering", checked, deadlines=True))
            cap = due + int(period_s * NS)
            if earliest is None or earliest + interval >= cap:  # the next summary's, should none come (`tick`)
                due, every = cap, None
            elif earliest > out.ts:
                # An interval past the deadline: a tick finds what it would have found before, at the latest, and
                # never sooner than one would have, when a summary that was to refresh the ranks is late.
                due = earliest + interval
            # else: the check may find now what it did not act on (a verdict the job's state set aside): ticks go on
        if (due, every) != self.timekeeper.table[timer][1:]:
            self.timekeeper.move(timer, due, every)

    def _view(self, out: RecordEffects, job: Job, recovering: bool, checked: WatchdogView | None = None,
              deadlines: bool = False) -> WatchdogView:
        """What the watchdog's check sees of the job at the record; its ranks' columns those of `checked`, the view
        the check just saw at this record, if any. For `next_check` (`deadlines`), an agent watched off the log is
        heard by no time: it is never silent by time alone, the monitor's `node.silent` says it is."""
        agents = self.cluster.nodes
        if deadlines:
            heard = tuple(None if n in agents and agents[n].live and agents[n].silent is None
                          else agents[n].heard_at(out.ts) if n in agents else None for n in job.nodes)
        else:
            heard = tuple(agents[n].heard_at(out.ts) if n in agents else None for n in job.nodes)
        unreachable = frozenset(i for i, n in enumerate(job.nodes) if n in agents and agents[n].unreachable is not None
                                ) if self.cluster.any_unreachable else frozenset()
        if checked is not None:  # the same record, nothing changed since: its columns, not copied again
            return WatchdogView(out.ts, job.step_time, (), tuple(job.nodes), job.rpn, heard, job.sdk,
                                columns=RankColumns(checked.last_seen, checked.last_progress, checked.steps,
                                                    checked.compute_steps, checked.compute_ns, checked.spoke),
                                recovering=recovering, unreachable=unreachable)
        world = job.world
        # Columns copied at C speed (a 131,072-rank job is checked every few seconds); a rank's own slot only.
        seen = tuple(job.last_seen[:world])
        alive = job.alive[:world]
        if not recovering and 0 in alive:
            # A rank whose process ended outside a recovery ended without a fault (its script's own end, exit 0):
            # done, not silent. The others may take seconds more to end, and none of them is a hang for it.
            seen = tuple(at if r >= len(alive) or alive[r] else out.ts for r, at in enumerate(seen))
        columns = RankColumns(seen, tuple(job.last_progress[:world]), tuple(job.steps[:world]),
                              tuple(job.compute_steps[:world]), tuple(job.compute_ns[:world]),
                              None if 0 not in (spoke := job.spoke[:world]) else bytes(spoke))
        return WatchdogView(out.ts, job.step_time, (), tuple(job.nodes), job.rpn, heard, job.sdk, columns=columns,
                            recovering=recovering, unreachable=unreachable)

    def _hosts_lost(self, out: RecordEffects, job: Job, verdicts: list[Verdict]) -> None:
        """The watchdog's verdicts while the job recovers: only a host lost (its agent fell silent) is news. The ranks
        are being stopped and started, so a policy's word on their silence or progress means nothing now; and a host
        this incident declared gone already stays silent at every tick."""
        incident = job.incident
        if incident is None:
            return
        for verdict in verdicts:
            if not (isinstance(verdict, Fault) and verdict.fault_class is FaultClass.NODE and verdict.lost):
                continue
            if _hosts(job, verdict).issubset(incident.dead_hosts):
                continue
            self.verdict(out, job, verdict, type_="watchdog")
            return  # the fault replanned the incident: the next tick sees what is left

    def suspicion_due(self, out: RecordEffects, job: Job, timer_id: str, due: int) -> bool:
        """A confirmation timer fired: confirm its suspicion, with every other one due by now. False if
        `timer_id` is no suspicion's."""
        fired = next((key for key, (_, timer) in job.suspects.items() if timer == timer_id), None)
        if fired is None:
            return False
        # Suspicions due by now confirm together (the nodes behind one failed switch), so that they make
        # one fault set and one attempt rather than a chain of attempts each superseding the last.
        keys = [fired] + [key for key, (_, timer) in job.suspects.items()
                          if key != fired and self.timekeeper.due_by(timer, due)]
        cancelled = self.timekeeper.cancel(*(job.suspects[key][1] for key in keys[1:]))
        confirmed = [v for v in (self._confirm(out, job, key) for key in keys) if v is not None]
        if cancelled:
            out.decide(job, DecisionKind.FAULTS_CONFIRMED_TOGETHER, f"{len(keys)} suspicions due at once",
                       cancelled=cancelled, detail={"keys": keys})
        policy = job.policies.labels["detection"]
        for index, verdict in enumerate(confirmed):
            self.fault(out, job, verdict, policy, plan=index == len(confirmed) - 1)
        return True


def _hosts(job: Job, verdict: Fault) -> frozenset[str]:
    """The job's nodes that run the ranks a fault names."""
    return frozenset(job.nodes[r // job.rpn] for r in verdict.ranks if r < job.world)

"""Operator requests: cancel, pause, resume, scale and force a recovery, each checked against the job's state; and the
control plane's own word about a job that cannot start, `job.unserved`."""

from __future__ import annotations

from typing import Any

from events.commands import StopRanks
from events.names import AttemptPurpose, DecisionKind, IncidentCause, IncidentOutcome
from events.values import Granularity
from policies.base import NS
from recovery.core.cluster import ClusterView
from recovery.core.incidents import Incidents
from recovery.core.job import Attempt, Job
from recovery.core.placement import Placement
from recovery.core.record import RecordEffects, Rejected
from recovery.core.timers import Timekeeper

G = Granularity


class Operators:
    def __init__(self, cluster: ClusterView, timekeeper: Timekeeper, placement: Placement,
                 incidents: Incidents) -> None:
        self.cluster = cluster
        self.timekeeper = timekeeper
        self.placement = placement
        self.incidents = incidents

    def release(self, out: RecordEffects, job: Job, data: Any) -> bool:
        """An operator ends an isolation; True if something was isolated (nodes may have come back)."""
        node = self.cluster.nodes.get(data.node)
        if node is None:
            raise Rejected("invalid_request", f"node {data.node} was never seen")
        if data.device is None:
            if not node.isolated:
                raise Rejected("invalid_state", f"node {data.node} is not isolated")
            self.cluster.node(data.node).isolated = False
            what = f"node {data.node}"
        else:
            if data.device not in node.isolated_devices:
                raise Rejected("invalid_state", f"device {data.device} of {data.node} is not isolated")
            changed = self.cluster.node(data.node)
            changed.isolated_devices.discard(data.device)
            changed.bad_devices.discard(data.device)
            what = f"{data.node} device {data.device}"
        out.decide(job, DecisionKind.HARDWARE_RELEASED, f"an operator released {what}"
                   + (f": {data.reason}" if data.reason else ""),
                   detail={"node": data.node, "device": data.device, "by": "operator"})
        return True

    def unserved(self, out: RecordEffects, job: Job, data: Any) -> None:
        """The daemon saw no agent on some of a job's nodes while the job waited to start: say so in the job's
        decisions (its state stays `submitted`: an agent that comes starts the ranks). Only the nodes the engine too
        has never heard an agent on, or holds gone, are named; a report about none of them changes nothing."""
        if job.state != "submitted":
            raise Rejected("invalid_state", f"job {job.id} is {job.state}: its ranks started")
        placed = set(job.nodes)
        outside = sorted(set(data.nodes) - placed)
        if outside:
            raise Rejected("invalid_request", f"nodes {outside} are not job {job.id}'s")
        known = self.cluster.nodes
        nodes = [n for n in data.nodes if n not in known or known[n].heard is None or known[n].gone]
        if not nodes:
            raise Rejected("invalid_state", f"agents serve every node of job {job.id} named")
        shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
        out.decide(job, DecisionKind.JOB_UNSERVED, f"no agent serves {shown} after {data.waited_s:g}s: the job's "
                   "ranks there cannot start until one runs", detail={"nodes": nodes})

    def handle(self, out: RecordEffects, job: Job, type_: str, data: Any) -> None:
        if type_ == "operator.cancel":
            stopping = [r for r in range(job.world) if job.alive[r]]
            # With a grace, a graceful stop: each rank gets the signal and the grace to save and end by itself (its
            # SDK's stop first, where it has one); the command is due once the grace and a kill have passed.
            grace = data.grace_s
            command = StopRanks(id=out.command_id(job.id), job=job.id, attempt=job.generation,
                                deadline_s=max(60.0, grace + 30.0), ranks=stopping,
                                mode="graceful" if grace > 0 else "kill", grace_s=grace, signal=data.signal)
            cancelled = self.timekeeper.cancel(*self.timekeeper.of_job(job))
            job.suspects.clear()
            job.watchdog = None
            if job.incident is not None:
                self.incidents.close(job, out.ts, IncidentOutcome.CANCELLED)
            for name in job.nodes:
                self.cluster.release(name, job.id)
            out.decide(job, DecisionKind.JOB_CANCELLED, data.reason or "cancelled by an operator", trigger="cancel",
                       commands=[command] if stopping else [], cancelled=cancelled)
        elif type_ == "operator.pause":
            if job.state in ("paused", "submitted"):
                raise Rejected("invalid_state", f"job {job.id} is {job.state}: nothing to pause")
            self.incidents.supersede(out, job, "operator pause")
            incident = self.incidents.open(out, job, IncidentCause.OPERATOR)
            attempt = Attempt(number=len(incident.attempts) + 1, granularity=G.RESTART_JOB, rung=0,
                              purpose=AttemptPurpose.PAUSE, reason=data.reason or "paused by an operator",
                              started=out.ts)
            self.incidents.start(out, job, attempt, 900 * NS, None, [])
        elif type_ == "operator.resume":
            if job.state != "paused" or job.incident is None:
                raise Rejected("invalid_state", f"job {job.id} is {job.state}, not paused")
            attempt = Attempt(number=len(job.incident.attempts) + 1, granularity=G.RESTART_JOB, rung=0,
                              purpose=AttemptPurpose.RESUME, reason="resumed by an operator", started=out.ts)
            # The job recovers again as the attempt starts: the resume may first need to save, stop stray
            # processes or wait for nodes, like any attempt.
            self.incidents.start(out, job, attempt, 900 * NS, None, self.placement.vacate(job), trigger="resume")
        elif type_ == "operator.scale":
            elastic = job.spec.elastic
            if elastic is None or not elastic.min_dp <= data.dp <= elastic.max_dp:
                limits = "not elastic" if elastic is None else f"elastic [{elastic.min_dp}, {elastic.max_dp}]"
                raise Rejected("invalid_request", f"job {job.id} cannot scale to dp={data.dp}: {limits}")
            if job.state != "running":
                raise Rejected("invalid_state", f"job {job.id} is {job.state}; scale when it is running")
            if data.dp != job.layout.dp:
                self.incidents.scale(out, job, data.dp, f"operator scale to dp={data.dp}", cause=IncidentCause.OPERATOR)
            # Only once _scale accepted it: a rejected dp (not whole nodes) kept as the target made every later
            # node.joined/ready fail in capacity_returned with this job's error.
            job.target_dp = data.dp
            out.reindex(job)
        elif type_ == "operator.force":
            if job.state in ("submitted", "paused"):
                raise Rejected("invalid_state", f"job {job.id} is {job.state}; nothing to recover")
            self.incidents.supersede(out, job, f"operator forced {data.granularity.value}")
            self.incidents.open(out, job, IncidentCause.OPERATOR)
            self.incidents.plan(out, job, forced=data.granularity)

"""Liveness: who is heard from, and what silence counts.

Two rules, both read only the record and the engine's state:

- **A sign of life brings a host back.** A host a node fault declared gone (its agent and ranks fell silent) is back
  as soon as anything of it is heard again: its node events, and the job events its agent or its ranks send (a
  report naming the node, a rank's heartbeat, step or exit from the process the placement runs there, an ack that
  names the node). Only a job the node belongs to, or whose incident declared it gone, can vouch for it: job
  subjects are open to every agent. A recovery that already moved the job off the host stands; the host is usable
  again for whatever needs it next.
- **The control plane's outage is not the job's silence.** The daemon whose NATS connection broke records, when it
  is back and before any timer that fell due meanwhile, a `control.outage` of each job it watches. Within the bound
  the platform sets (`bound_s`), no node's or rank's silence counts for the time the control plane was away: each
  liveness mark is moved on by the part of the outage after it, so a silence that began within the outage counts
  from the record, and one that began before keeps only what was measured while the daemon was connected. Past
  the bound, silence counts as before.
- **An agent nothing listens for is gone.** When something suggests a loss (a survivor lost a peer's connection, an
  incident began), the daemon asks the job's agents whether they live; NATS answers at once, three times over a
  second, that no agent listens on one's subject: `node.unreachable`. The node counts as unreachable until any sign
  of life, and the watchdog's policy may take it as a silence past any bound, judged at the record itself.
- **A live agent's silence is the monitor's word.** An agent that states `live_s` in its `node.heartbeat` beats on
  core NATS instead of the log; the daemon's liveness monitor logs `node.silent` when it heard nothing of the node for
  the job's bound, and `node.heard` when it hears it again. Until a `node.silent`, the watchdog sees such an agent
  heard at every tick (`NodeState.heard_at`); from it, heard last when the monitor last heard it; any sign of life
  (the monitor's `node.heard`, a heartbeat, the job events its agent sends) ends the silence. The engine judges the
  node at the `node.silent` record itself, as a watchdog tick would, so that the silence is answered at once.
"""

from __future__ import annotations

from collections.abc import Callable

from events import kinds
from events.envelope import EnvelopeBase
from events.kinds import JOB_EVENTS
from events.names import DecisionKind
from policies.base import NS
from recovery.core.cluster import ClusterView, NodeState
from recovery.core.job import Job
from recovery.core.record import RecordEffects

_RANKED = frozenset(type_ for type_, payload in JOB_EVENTS.items() if "rank" in payload.model_fields)
"""the job events whose payload names a rank"""


def _excused(mark: int, start: int, end: int) -> int:
    """`mark` (log time of the last sign of life) moved on by the part of the outage [start, end] after it."""
    if mark >= end:
        return mark
    return mark + end - max(mark, start)


class Liveness:
    """The engine's part that keeps who is alive: signs of life from hosts declared gone, and outages of the control
    plane. `guard` opens the record's journal (the engine's), `capacity_returned` lets waiting jobs try again."""

    def __init__(self, cluster: ClusterView, jobs: dict[str, Job], guard: Callable[[Job | None], object],
                 capacity_returned: Callable[[RecordEffects], None]) -> None:
        self.cluster = cluster
        self.jobs = jobs  # the engine's
        self.guard = guard
        self.capacity_returned = capacity_returned

    @staticmethod
    def speaker(job: Job, type_: str, env: EnvelopeBase) -> str | None:
        """The node whose agent or ranks sent this job event, if the event tells (asked before the event is applied:
        it may move the job). A rank's event speaks for the node the placement runs it on only if it comes from
        the process running there now; a replaced one's may come from anywhere."""
        if env.node is not None:
            return env.node
        data = env.data
        if type_ == "command.ack":
            node = data.result.get("node")
            return node if isinstance(node, str) else None
        if type_ == "progress.report":
            if not data.ranks:
                return None
            data = data.ranks[0]
        elif type_ not in _RANKED:
            return None  # asked by type: a missing attribute of a pydantic model costs an exception
        rank = data.rank
        if rank >= job.world or rank // job.rpn >= len(job.nodes):
            return None
        if data.attempt < job.rank_gen[rank]:  # type: ignore[union-attr]
            return None
        return job.nodes[rank // job.rpn]

    def heard_from(self, out: RecordEffects, job: Job, name: str, report: bool) -> None:
        """`name` spoke through a job event of `job` that was applied; `report`: its agent's progress report, which
        stands for the heartbeat the agent does not send in a period it reported in."""
        node = self.cluster.nodes.get(name)
        if node is None:
            return
        if node.gone:
            incident = job.incident
            if name in job.nodes or (incident is not None and name in incident.dead_hosts):
                self.back(out, name)
            return
        if (node.silent is not None or node.unreachable is not None) and node.job == job.id:
            node = self.cluster.node(name)  # its agent speaks for it: whatever the monitor missed, it lives
            node.silent = node.unreachable = None
        if report and node.heard is not None and node.job == job.id:
            # Last, once every entry was applied: nothing after it refuses the record, so only an open journal needs
            # to hear of it (the hot path writes the node in place).
            if self.cluster.journal is not None:
                node = self.cluster.node(name)
            node.heard = out.ts

    def back(self, out: RecordEffects, name: str) -> None:
        """The host a node fault declared gone speaks again: it is back, and jobs waiting for nodes may go on. Its
        agent's silence counts from now, if its agent sends heartbeats at all."""
        self.guard(None)
        node = self.cluster.node(name)
        node.gone = False
        node.silent = node.unreachable = None
        if node.heard is not None:
            node.heard = out.ts
        if node.usable:
            self.capacity_returned(out)

    @staticmethod
    def alive(out: RecordEffects, node: NodeState, data: kinds.NodeHeartbeat | kinds.NodeHeard) -> None:
        """The node's agent is alive: a heartbeat (which states whether its liveness is logged or live), or the
        monitor's `node.heard`. Its silence, if any, is over."""
        if isinstance(data, kinds.NodeHeartbeat):
            node.live = data.live_s is not None
        node.heard = out.ts
        node.silent = node.unreachable = None

    def silent(self, out: RecordEffects, node: NodeState, data: kinds.NodeSilent) -> Job | None:
        """The monitor heard nothing of a live node for `data.silent_s`: from then on the watchdog sees its agent as
        last heard that long before this record. The job to judge now (running or recovering on the node), if any.
        A node whose heartbeats are logged is judged by them: the monitor's word (sent in a race with a change of
        mode) is no evidence beside them."""
        if not node.live:
            return None
        mark = out.ts - int(data.silent_s * NS)
        if node.silent is None or mark < node.silent:
            node.silent = mark
        return self._judged(node)

    def unreachable(self, out: RecordEffects, node: NodeState) -> Job | None:
        """Nothing listened on the node's probe subject when the daemon asked (`node.unreachable`): its agent is
        gone, whatever its mode of liveness. The job to judge now (running or recovering on the node), if any."""
        if node.unreachable is None:
            node.unreachable = out.ts
        self.cluster.any_unreachable = True
        return self._judged(node)

    def _judged(self, node: NodeState) -> Job | None:
        """The job running or recovering on `node`, which the daemon's word on the node is judged for now."""
        job = self.jobs.get(node.job) if node.job is not None else None
        if job is None or job.state not in ("running", "recovering") or node.name not in job.nodes:
            return None
        return job

    def outage(self, out: RecordEffects, job: Job, data: kinds.ControlOutage) -> None:
        """The control plane was away for `data.away_s` up to this record: within the bound, the time is not counted
        in any silence of the job's ranks (heartbeats and progress) and nodes (their agents' heartbeats)."""
        away = int(data.away_s * NS)
        excused = data.away_s <= data.bound_s
        if excused and job.last_seen and job.state != "submitted":
            end, start = out.ts, out.ts - away
            # Whole lists, not rank by rank: the journal restores the old ones.
            job.last_seen = [_excused(mark, start, end) for mark in job.last_seen]
            job.last_progress = [_excused(mark, start, end) for mark in job.last_progress]
            for name in job.nodes:
                node = self.cluster.nodes.get(name)
                if node is not None and node.heard is not None and node.heard < end:
                    self.cluster.node(name).heard = _excused(node.heard, start, end)
                if node is not None and node.silent is not None and node.silent < end:
                    self.cluster.node(name).silent = _excused(node.silent, start, end)
        how = ("silence within it does not count" if excused else
               f"longer than the {data.bound_s:g}s bound: silence within it counts")
        out.decide(job, DecisionKind.CONTROL_OUTAGE, f"the control plane was away for {data.away_s:g}s: {how}",
                   detail={"away_s": data.away_s, "bound_s": data.bound_s, "excused": excused})

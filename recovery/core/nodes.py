"""A node's own events: what its agent, its probes and the scheduler say of its devices, links and readiness.

The cluster view keeps the node's state; an event that repairs or replaces what an isolation was for ends the
isolation; the event is a signal for the detection policy of the job placed on the node (a device fault names the
rank on that device, anything else every rank there), and a device fault of a node without a job is judged by the
built-in hardware verdict, which still decides where the next job or move may go. A node that becomes usable again
lets waiting jobs try again. The daemon's own word on a node (silent, unreachable) is judged at once, as at a tick.

Health checks (`node.checked`, `events.health`): a node whose last checks failed takes no ranks, and one whose agent
said checks follow (`checks` on `node.joined` / `node.ready`) takes no new ranks until they passed. Both are the
node's state, not a policy's: the engine places no rank on a node its agent found unable to train, whatever the job's
policies; the job on the node hears the failure as a signal, and its detection policy decides what it means for
ranks already there (the default: they move).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from events import kinds
from events.health import NodeChecked
from events.names import DecisionKind
from policies.base import Fault, Signal
from recovery.core.cluster import ClusterView, NodeState
from recovery.core.detection import Detection
from recovery.core.job import Job
from recovery.core.liveness import Liveness
from recovery.core.machine import FINAL
from recovery.core.partition import Partition
from recovery.core.placement import Placement
from recovery.core.record import RecordEffects

RETURNS = (kinds.NodeJoined, kinds.NodeReady, kinds.DeviceRecovered, kinds.LinkUp, NodeChecked)
"""the events after which a usable node is capacity come back: waiting jobs try again"""


class NodeHost(Protocol):
    """What a node event reads and changes: the engine's state and parts."""

    cluster: ClusterView
    jobs: dict[str, Job]
    partition: Partition | None
    liveness: Liveness
    detection: Detection
    placement: Placement

    def touch(self, job: Job) -> None:
        """Note `job` in the record's journal, if one is open, before it is changed."""

    def capacity_returned(self, out: RecordEffects) -> None:
        """Nodes came back: waiting jobs try again, elastic jobs below their size grow."""


def apply_node_event(host: NodeHost, out: RecordEffects, name: str, type_: str, data: Any) -> None:
    """Apply one event of node `name` (checked, deduplicated and journaled by the engine)."""
    node = host.cluster.node(name)
    back = node.gone  # the host a node fault declared gone speaks again: usable once its state says so
    if isinstance(data, kinds.NodeSilent | kinds.NodeUnreachable):  # the daemon's word: judged now, as at a tick
        job = (host.liveness.silent(out, node, data) if isinstance(data, kinds.NodeSilent)
               else host.liveness.unreachable(out, node))
        if job is not None:
            host.touch(job)
            host.detection.watchdog(out, job)
        return
    node.gone, node.unreachable = False, None  # any event of its own: its agent speaks
    if isinstance(data, kinds.NodeHeartbeat | kinds.NodeHeard):
        host.liveness.alive(out, node, data)  # for the watchdog of the job on the node, no signal itself
        if back and node.usable:
            host.capacity_returned(out)
        return
    released, device_times, node_times = update_node(host.cluster, node, data, out.ts, host.jobs, host.partition,
                                                     host.touch)
    job = host.jobs.get(node.job) if node.job is not None else None
    if job is not None:
        host.touch(job)
    if released is not None and job is not None and job.state not in FINAL:
        out.decide(job, DecisionKind.HARDWARE_RELEASED, f"isolation ended: {released}",
                   detail={"node": name, "device": getattr(data, "device", None), "by": "repair"})
    if job is not None and job.state not in FINAL and name in job.nodes:
        on_node = job.ranks_on(name)
        spares: int | None = None
        shrink = False
        if isinstance(data, kinds.DeviceFault | kinds.DeviceRecovered):
            ranks: tuple[int, ...] = (on_node[data.device],) if data.device < job.rpn else ()
            if isinstance(data, kinds.DeviceFault):
                # What could replace the device's node, for a policy deciding whether to isolate a lemon.
                spares = len(host.placement.spares_for(job))
                shrink = host.placement.scale_in_dp(job, [name]) is not None
        else:
            ranks = tuple(on_node)
        host.detection.signal(out, job, Signal(type_, data, out.ts, name, ranks, device_times, node_times,
                              job.step_time, job.world, tuple(on_node), spares, shrink))
    elif isinstance(data, kinds.DeviceFault):
        # No job runs here (an idle spare, a node between jobs): its hardware health still decides where the next
        # job or move may go. No job's policy applies, so the built-in detection judges it.
        verdict = host.detection.hardware.classify(Signal(type_, data, out.ts, name, (), device_times, node_times))
        if isinstance(verdict, Fault):
            host.detection.mark_hardware(verdict)
    if (back or isinstance(data, RETURNS)) and node.usable:
        host.capacity_returned(out)


def update_node(cluster: ClusterView, node: NodeState, data: Any, ts: int, jobs: Mapping[str, Job],
                partition: Partition | None, touch: Callable[[Job], None]
                ) -> tuple[str | None, tuple[int, ...], tuple[int, ...]]:
    """Apply a node event of the node's own (not the daemon's word of it), logged at `ts`, to `node`; returns the
    isolation it ends, if any, and for a device fault the device's and the node's fault times. `partition`: the
    engine's, which grants only the spares it owns."""
    name = node.name
    released = None  # an isolation this event ends: a repaired device, a node replaced or rebooted
    if isinstance(data, kinds.DeviceRecovered) and data.device in node.isolated_devices:
        node.isolated_devices.discard(data.device)
        released = f"{name} device {data.device} recovered"
    elif isinstance(data, kinds.NodeJoined) and (node.isolated or node.isolated_devices):
        node.isolated_devices.clear()
        released = f"{name} joined again (repaired or replaced)"
    if isinstance(data, kinds.DeviceFault):
        return released, *cluster.record_device_fault(name, data.device, ts)
    if isinstance(data, kinds.DeviceRecovered):
        node.bad_devices.discard(data.device)
        node.resettable.discard(data.device)
    elif isinstance(data, kinds.NodeNotReady):
        node.ready = False
    elif isinstance(data, kinds.NodeReady):
        node.ready = True
        # An agent started again beside the ranks of a job it adopts: they stay while it checks (a failure moves
        # them); a node without ranks takes none until its checks pass.
        node.unproven = data.checks and node.job is None
    elif isinstance(data, kinds.NodeDrained):
        node.drained = True
    elif isinstance(data, kinds.LinkDown):
        if node.links_down is None:
            node.links_down = set()
        node.links_down.add(data.link)
    elif isinstance(data, kinds.LinkUp):
        if node.links_down:
            node.links_down.discard(data.link)
    elif isinstance(data, NodeChecked):
        node.unproven = False
        node.check_failed = None if data.ok else data.summary() or "a check failed"
    elif isinstance(data, kinds.NodeJoined):
        # A spare every partition hears of is granted by the one partition that owns it (`core.partition`).
        node.spare = data.spare and node.job is None and (partition is None or partition.owns_spare(name))
        node.pool = data.pool
        node.devices = data.devices
        node.ready, node.drained, node.isolated = True, False, False
        node.unproven = data.checks  # booted again, repaired or not: proven by its checks, if its agent runs them
        node.check_failed = None
        node.bad_devices.clear()
        node.resettable.clear()
        node.links_down = None
        # A node that (re)joins has been booted: whatever it held in host memory is gone.
        for other in jobs.values():
            if other.holds_memory_on(name):
                touch(other)
                other.forget_memory(name)
    return released, (), ()

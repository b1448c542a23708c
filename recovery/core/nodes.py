"""What a node's own event says of the node: its state in the cluster view (ready, drained, links, devices, health
checks), before the engine tells the job on it (`Engine._node_event`).

Health checks (`node.checked`, `events.health`): a node whose last checks failed takes no ranks, and one whose agent
said checks follow (`checks` on `node.joined` / `node.ready`) takes no new ranks until they passed. Both are the
node's state, not a policy's: the engine places no rank on a node its agent found unable to train, whatever the job's
policies; the job on the node hears the failure as a signal, and its detection policy decides what it means for
ranks already there (the default: they move).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from events import kinds
from events.health import NodeChecked
from recovery.core.cluster import ClusterView, NodeState
from recovery.core.job import Job
from recovery.core.partition import Partition

RETURNS = (kinds.NodeJoined, kinds.NodeReady, kinds.DeviceRecovered, kinds.LinkUp, NodeChecked)
"""the events after which a usable node may be capacity come back: waiting jobs try again"""


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

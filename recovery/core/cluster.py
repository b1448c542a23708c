"""The cluster view: nodes, devices, health, fault history, placement and the spare pool.

Event-sourced like everything else, and iterated only in orders that come from the log (insertion
order of dicts) or from sorting, so a replay walks it the same way every time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

HISTORY = 64
"""fault times kept per device and per node: enough for any frequency window a policy uses"""


class NodeState:
    __slots__ = (
        "bad_devices",
        "check_failed",
        "device_faults",
        "devices",
        "drained",
        "faults",
        "gone",
        "heard",
        "isolated",
        "isolated_devices",
        "job",
        "links_down",
        "live",
        "name",
        "pool",
        "ready",
        "resettable",
        "silent",
        "spare",
        "unproven",
        "unreachable",
    )

    def __init__(self, name: str, devices: int = 8, spare: bool = False) -> None:
        self.name = name
        self.devices = devices
        self.spare = spare
        self.pool: str | None = None  # the spare pool it joined (`node.joined`'s `pool`): None, the shared one
        self.ready = True
        self.drained = False
        self.isolated = False
        self.job: str | None = None
        self.heard: int | None = None  # log time of its agent's last heartbeat; None: it sends none
        self.gone = False  # a node fault declared the host gone (its agent and ranks fell silent) until it speaks
        # Its agent's liveness is off the log (`node.heartbeat` with `live_s`): the daemon's monitor watches its beats,
        # and `silent` is the log time from which the monitor's `node.silent` says it was heard no more (None: not
        # silent). The watchdog sees such an agent heard at every tick until then (`recovery.core.liveness`).
        self.live = False
        self.silent: int | None = None
        # The log time of the daemon's `node.unreachable` (nothing listened on the agent's probe subject), until any
        # sign of life: the watchdog's policy may take it as a silence past any bound (`WatchdogView.unreachable`).
        self.unreachable: int | None = None
        # Health checks (`node.checked`): what the last ones that failed saw (None: passed, or none ran), and whether
        # its agent said checks follow that have not passed yet (`checks` on node.joined / node.ready).
        self.check_failed: str | None = None
        self.unproven = False
        self.bad_devices: set[int] = set()  # membership only; never iterated for decisions
        self.resettable: set[int] = set()  # bad devices a reset clears (XID 48): sorted when read
        self.isolated_devices: set[int] = set()  # bad devices a policy isolated (lemons): released by a decision
        self.links_down: set[str] | None = None  # made at the node's first link down: most nodes never have one
        self.faults: deque[int] | None = None  # made at the node's first fault: most nodes never have one
        self.device_faults: dict[int, deque[int]] = {}

    def copy(self) -> NodeState:
        twin = NodeState.__new__(NodeState)
        for name in NodeState.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.bad_devices = set(self.bad_devices)
        twin.resettable = set(self.resettable)
        twin.isolated_devices = set(self.isolated_devices)
        twin.links_down = None if self.links_down is None else set(self.links_down)
        twin.faults = None if self.faults is None else deque(self.faults, maxlen=HISTORY)
        twin.device_faults = {d: deque(times, maxlen=HISTORY) for d, times in self.device_faults.items()}
        return twin

    def heard_at(self, now: int) -> int | None:
        """The log time the watchdog takes the node's agent as last heard at `now` (None: it sends no heartbeats): its
        last heartbeat's, or for an agent watched off the log, `now` until the monitor said it fell silent."""
        if self.live:
            return self.silent if self.silent is not None else now
        return self.heard

    @property
    def usable(self) -> bool:
        # A node whose fabric link is down can hold no rank of a collective job: restarting ranks there fails.
        return (self.ready and not self.gone and not self.drained and not self.isolated and not self.bad_devices
                and not self.links_down and self.check_failed is None and not self.unproven)

    def snapshot(self) -> dict[str, object]:
        return {"name": self.name, "devices": self.devices, "spare": self.spare, "ready": self.ready,
                "drained": self.drained, "isolated": self.isolated, "gone": self.gone, "job": self.job,
                "bad_devices": sorted(self.bad_devices), "links_down": sorted(self.links_down or ()),
                # only when set: the snapshot of a node whose heartbeats are logged is what it always was
                **({"live": True, "silent": self.silent} if self.live else {}),
                **({"unreachable": self.unreachable} if self.unreachable is not None else {}),
                **({"check_failed": self.check_failed} if self.check_failed is not None else {}),
                **({"unproven": True} if self.unproven else {})}


class ClusterView:
    any_unreachable = False
    """set at the first `node.unreachable` and never cleared: until then no watchdog check looks for one (its views'
    `unreachable` is empty without a pass over the job's nodes); it decides nothing itself"""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.journal: dict[str, NodeState | None] | None = None
        """while the engine applies a record: each node as it was before the record first touched it (None: the
        record registered it), so that a record that fails half way changes nothing"""
        self.maybe_impaired: dict[str, None] = {}
        """every node changed since it was last found as healthy as a new one (`impaired`): a node not here is usable
        and reachable. Every change goes through `node()`, which notes the node here; so the nodes of a fault's job
        that it must leave are found among these few, not by asking each of a 16,384-node job's nodes."""

    def __getstate__(self) -> dict[str, object]:
        # `maybe_impaired` is a superset kept to find impaired nodes fast, not state: a restored view starts from
        # every node (the first `impaired()` sorts them out), and two views of the same nodes compare equal.
        return {"nodes": self.nodes, "journal": self.journal}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.nodes = state["nodes"]
        self.journal = state["journal"]
        self.maybe_impaired = dict.fromkeys(self.nodes)

    def node(self, name: str) -> NodeState:
        """The node, to read or change; registered on first sight: a job placed on it by the scheduler is proof
        it exists. Every change to a node goes through here, so the journal sees it."""
        state = self.nodes.get(name)
        journal = self.journal
        if journal is not None and name not in journal:
            journal[name] = None if state is None else state.copy()
        if state is None:
            state = self.nodes[name] = NodeState(name)
        self.maybe_impaired[name] = None
        return state

    def impaired(self) -> list[str]:
        """The registered nodes that are not usable now (in the order they were noted), forgetting the ones noted
        that are: O(nodes changed since the last call), not O(nodes)."""
        nodes, noted = self.nodes, self.maybe_impaired
        for name in [name for name in noted if name not in nodes or nodes[name].usable]:
            del noted[name]
        return list(noted)

    def rollback(self, journal: dict[str, NodeState | None]) -> None:
        self.maybe_impaired.update(dict.fromkeys(journal))  # as they were: impaired, maybe
        for name, before in journal.items():
            if before is None:
                self.nodes.pop(name, None)  # registered last, so its removal restores the order
            else:
                self.nodes[name] = before  # an existing key keeps its place: free_spares() order is kept

    def usable(self, name: str) -> bool:
        state = self.nodes.get(name)
        return state is not None and state.usable

    def usable_by(self, name: str, ranks_per_node: int) -> bool:
        """Can the job placed on this node keep its ranks there? A bad device no rank of it uses (local rank r
        runs on device r) does not make it leave; no new job is placed on such a node (`usable`)."""
        state = self.nodes.get(name)
        if state is None:
            return False
        if state.bad_devices and all(d >= ranks_per_node for d in state.bad_devices):
            return (state.ready and not state.gone and not state.drained and not state.isolated
                    and not state.links_down and state.check_failed is None and not state.unproven)
        return state.usable

    def agents_heard(self, names: Iterable[str]) -> bool:
        """Has the agent of any of these nodes sent a heartbeat, so that its silence can be told?"""
        nodes = self.nodes
        return any(nodes[name].heard is not None for name in names if name in nodes)

    def reachable(self, name: str) -> bool:
        """Can a checkpoint held in this node's memory or disk still be read?"""
        state = self.nodes.get(name)
        return state is None or (state.ready and not state.gone and not state.isolated)

    def free_spares(self, pool: str | None = None) -> list[str]:
        """Spare nodes of `pool` (None: the shared pool) that can take ranks now, in the order they joined."""
        return [n.name for n in self.nodes.values() if n.spare and n.job is None and n.usable and n.pool == pool]

    def record_device_fault(self, name: str, device: int, ts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        node = self.node(name)
        history = node.device_faults.get(device)
        if history is None:
            history = node.device_faults[device] = deque(maxlen=HISTORY)
        history.append(ts)
        if node.faults is None:
            node.faults = deque(maxlen=HISTORY)
        node.faults.append(ts)
        return tuple(history), tuple(node.faults)

    def assign(self, name: str, job: str) -> None:
        node = self.node(name)
        node.job = job
        node.spare = False

    def release(self, name: str, job: str) -> None:
        node = self.nodes.get(name)
        if node is not None and node.job == job:
            self.node(name).job = None

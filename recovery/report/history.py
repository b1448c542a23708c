"""What a recorded log says of the cluster before the job it is read for: the node events of its nodes, which the
engine counted (its frequency rule reads every job's device faults), and what they left on the nodes at the job's
submission that their events alone do not re-create.

`recovery.sim.history` replays the events to the simulated engine before its job is submitted; the simulated nodes
then join healthy (the simulator's hardware has no past), so a device still broken at the submission, or one an
earlier job's decision isolated, is said rather than replayed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from events.codec import DecodeError, upcast, validate_envelope
from policies.codes import Action, ascend_fault, nvidia_xid
from recovery.core.cluster import HISTORY
from recovery.report.night import PastEvent
from recovery.report.source import RawDict
from recovery.sim.history import HISTORY_EVENTS

PAST_PER_NODE = 4 * HISTORY
"""node events kept per node: the engine keeps `HISTORY` fault times per device and per node, and a node's conditions
are its latest events'"""
BREAKS_DEVICE = frozenset({Action.RESET_DEVICE, Action.ISOLATE_DEVICE, Action.ISOLATE_NODE})
"""a device fault of these actions leaves its device out of service until `device.recovered`"""
ISOLATIONS = frozenset({"isolate_device", "isolate_node"})


class ClusterPast:
    """The log's node events before the job's submission, read one record at a time."""

    def __init__(self) -> None:
        self.events: dict[str, deque[tuple[int, PastEvent]]] = {}
        """node -> its recent events, each with its sequence (the history is in log order)"""
        self.left: dict[str, dict[str, str]] = {}
        """node -> what is out of service on it (a device, a link, the node) -> why, as the log said"""

    def heard(self, record: RawDict, node: str, kind: str) -> None:
        """A node event before the submission: kept if the engine keeps something of it; either way, what it breaks
        or brings back on the node."""
        if kind == "node.joined":  # booted: whatever was broken or isolated is back in service
            self.left.pop(node, None)
            return
        if kind not in HISTORY_EVENTS:
            return
        envelope = validate_envelope(upcast(record["envelope"]))
        if isinstance(envelope, DecodeError):
            return  # the recorded engine refused it as well
        data: dict[str, Any] = envelope.data.model_dump()
        self.events.setdefault(node, deque(maxlen=PAST_PER_NODE)).append(
            (record["seq"], PastEvent(record["ts"], node, kind, data)))
        left = self.left.setdefault(node, {})
        said = f"{kind} (seq {record['seq']})"
        if kind == "device.fault" and _breaks(data):
            code = f"XID {data['code']}" if data.get("vendor") == "nvidia" else str(data.get("code"))
            left[f"device {data['device']} broken"] = f"{code}, {said}"
        elif kind == "device.recovered":  # a repaired device: out of service no more, isolated or not
            left.pop(f"device {data['device']} broken", None)
            left.pop(f"device {data['device']} isolated", None)
        elif kind == "network.link_down":
            left[f"link {data['link']} down"] = said
        elif kind == "network.link_up":
            left.pop(f"link {data['link']} down", None)
        elif kind == "node.not_ready":
            left["not ready"] = said
        elif kind == "node.drained":
            left["drained"] = said
        elif kind == "node.ready":
            left.pop("not ready", None)

    def decided(self, record: RawDict, decision: dict[str, Any]) -> None:
        """Another job's decision before the submission: an isolation it commanded stays until a repair or its end."""
        for command in decision.get("commands") or []:
            if isinstance(command, dict) and command.get("kind") in ISOLATIONS and isinstance(command.get("node"), str):
                what = "isolated" if command["kind"] == "isolate_node" else f"device {command.get('device')} isolated"
                self.left.setdefault(command["node"], {})[what] = (
                    f"job {decision.get('job')}'s {decision.get('kind')} (seq {record['seq']})")
        detail = decision.get("detail") or {}
        if decision.get("kind") == "hardware.released" and isinstance(detail.get("node"), str):
            left = self.left.get(detail["node"], {})
            left.pop("isolated", None)
            left.pop(f"device {detail.get('device')} isolated", None)

    def of(self, nodes: Iterable[str]) -> list[PastEvent]:
        """The history of `nodes`, in log order."""
        kept = [event for node in nodes for event in self.events.get(node, ())]
        return [event for _, event in sorted(kept, key=lambda pair: pair[0])]

    def left_on(self, nodes: Iterable[str]) -> dict[str, list[str]]:
        """What was out of service on each of `nodes` at the submission, each said with the record that took it out
        (`l1 device 2 broken (XID 48, device.fault (seq 18))`)."""
        return {node: [f"{node} {what} ({why})" for what, why in self.left[node].items()]
                for node in nodes if self.left.get(node)}


def _breaks(data: dict[str, Any]) -> bool:
    vendor, code = data.get("vendor"), str(data.get("code", ""))
    if vendor == "nvidia":
        return nvidia_xid(code).action in BREAKS_DEVICE
    if vendor == "ascend":
        return ascend_fault(code).action in BREAKS_DEVICE
    return bool(data.get("ecc_dbe"))

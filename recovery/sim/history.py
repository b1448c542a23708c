"""The cluster's history before a recorded job: what its nodes said before the job was submitted.

The engine keeps per device and per node the times of their faults, whichever job ran there, and its frequency rule
counts them (a GPU that raised XID 48 under an earlier job is nearer to being a lemon under the next one). A
recorded night replayed by the simulator carries that history: the node events of the simulated cluster's nodes that
the log holds before the job's submission reach the simulated engine before the simulated job is submitted, at their
recorded offsets (`Simulator` sends them at log times before its start). No job runs then, so they open no incident
and book no time; the simulated hardware does not change (a fault still open at the submission is the what-if's to
say, `recovery.report.recorded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HISTORY_EVENTS = frozenset({"device.fault", "device.recovered", "network.link_down", "network.link_up",
                            "node.not_ready", "node.ready", "node.drained"})
"""the node events the engine keeps something of past a job: fault times (what the frequency rule counts) and the
node's conditions. A `node.joined` is not among them: the simulated cluster's nodes join at its start"""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One node event of the history, as recorded, on the simulated node that stands for the recorded one."""

    before_ns: int
    """how long before the job's start (>= 0): the simulated engine hears it that long before its start"""
    node: str
    kind: str
    """the event's type, one of `HISTORY_EVENTS`"""
    data: tuple[tuple[str, Any], ...]
    """the event's data, as recorded (upcast to the current schema)"""
    source: str = "history"

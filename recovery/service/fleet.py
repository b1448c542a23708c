"""The nodes as the engine knows them, for `recovery-ctl nodes` and the `jobs` rows: each node's agent (heard when,
and in what state), the job and ranks it runs, and why it takes no new ranks (failed health checks first).

A node is known from its agent's events or from a job placed on it. One placed on but never heard from has no agent
serving it: its job's ranks cannot start there, which `jobs` says (the job stays `submitted` with none alive, and
without this nothing told why).
"""

from __future__ import annotations

from typing import Any

from recovery.core.cluster import NodeState
from recovery.core.engine import Engine


def agent_state(node: NodeState | None) -> str:
    """What the engine knows of the agent of `node`: none heard, gone, or the node's state as its agent says."""
    if node is None or node.heard is None:
        return "none"
    if node.gone:
        return "gone"
    for flag in ("isolated", "drained"):
        if getattr(node, flag):
            return flag
    if not node.ready:
        return "not ready"
    return "spare" if node.spare and node.job is None else "ready"


def why_out(node: NodeState) -> str | None:
    """Why the node takes no new ranks, in words (None: it may take them): its health checks first, as the most
    common reason a recovery would otherwise land twice on a bad node."""
    if node.check_failed is not None:
        return f"failed health checks: {node.check_failed}"
    if node.unproven:
        return "health checks not passed yet"
    reasons = [flag for flag in ("gone", "isolated", "drained") if getattr(node, flag)]
    if not node.ready:
        reasons.append("not ready")
    if node.bad_devices:
        reasons.append(f"bad devices {sorted(node.bad_devices)}")
    if node.links_down:
        reasons.append(f"links down {sorted(node.links_down)}")
    return ", ".join(reasons) or None


def unserved(engine: Engine, nodes: list[str]) -> list[str]:
    """The nodes of `nodes` that no live agent serves: never heard from, or declared gone."""
    known = engine.cluster.nodes
    return [name for name in nodes if agent_state(known.get(name)) in ("none", "gone")]


def node_rows(engine: Engine) -> list[dict[str, Any]]:
    """One row per node the engine knows, in order of name."""
    rows = []
    for name in sorted(engine.cluster.nodes):
        node = engine.cluster.nodes[name]
        job = engine.jobs.get(node.job) if node.job is not None else None
        ranks: list[int] = []
        if job is not None and name in job.nodes:
            first = job.nodes.index(name) * job.rpn
            ranks = [r for r in range(first, first + job.rpn) if r < job.world]
        rows.append({"node": name, "agent": agent_state(node), "seen": node.heard, "job": node.job,
                     "job_state": None if job is None else job.state, "ranks": ranks,
                     "devices": node.devices, "pool": node.pool, "out": why_out(node)})
    return rows

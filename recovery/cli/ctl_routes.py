"""Where `recovery-ctl` asks on a partitioned control plane, and how the partitions' answers become one.

With P > 1 partitions each partition's active owner answers on `recovery.ctl.p.<k>.<verb>` about its own jobs
(`recovery.service.control`). A request about one job goes to the job's partition, `partition_of(job, P)` (the hash
the log stream files the job's events under); an event about a node to the node's partition (every partition reads
node events: one publish reaches them all, and the node's partition answers with its own decisions); the fleet-wide
queries (status, jobs, nodes, incidents) to every partition at once, merged into the answer one daemon would give,
each row with its partition, and the partitions that gave no answer within the timeout named rather than waited for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from events.subjects import partition_of

FLEET_VERBS = ("status", "jobs", "nodes", "incidents")
"""asked of every partition and merged"""


def targets(verb: str, body: Mapping[str, Any], count: int) -> list[int]:
    """The partitions (of `count`) that answer `verb` with `body`: every one for a fleet-wide query, else the one of
    the job it names (or of the node, for a node event)."""
    if verb in FLEET_VERBS:
        return list(range(count))
    job, node = body.get("job"), body.get("node")
    if isinstance(job, str) and job:
        return [partition_of(job, count)]
    if isinstance(node, str) and node:
        return [partition_of(node, count)]
    return [0]  # nothing to route by (a request the daemon refuses for it): any partition says why


def merge(verb: str, count: int, answers: Mapping[int, dict[str, Any]], missing: Mapping[int, str]
          ) -> dict[str, Any]:
    """One answer out of the partitions' (`answers`, by partition; `missing`: why each other one gave none), in
    the shape of one daemon's, each row saying its partition; `missing` lists the partitions not heard from."""
    out: dict[str, Any] = {"ok": True, "partitions": count, "answered": sorted(answers),
                           "missing": [{"partition": k, "why": why} for k, why in sorted(missing.items())]}
    if verb == "status":
        out["status"] = {str(k): answers[k]["status"] for k in sorted(answers)}
        return out
    if verb == "nodes":
        out["nodes"] = merge_nodes(answers)
        return out
    key = "jobs" if verb == "jobs" else "incidents"
    rows = [{**row, "partition": k} for k in sorted(answers) for row in answers[k][key]]
    # one daemon lists jobs in order of their id, and a job's incidents together (stable: each partition's order)
    out[key] = sorted(rows, key=lambda row: str(row["job"]))
    return out


def merge_nodes(answers: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every partition reads every node's events, so each knows every node's agent; a node's job only the partition
    of that job knows. One row per node: the one that names a job (with its partition), the latest sighting."""
    rows: dict[str, dict[str, Any]] = {}
    for k in sorted(answers):
        for row in answers[k]["nodes"]:
            have = rows.get(row["node"])
            if have is None or (have["job"] is None and row["job"] is not None):
                seen = row["seen"] if have is None else max(have["seen"] or 0, row["seen"] or 0) or None
                rows[row["node"]] = {**row, "seen": seen, "partition": k if row["job"] is not None else None}
            elif row["seen"] is not None and (have["seen"] is None or row["seen"] > have["seen"]):
                have["seen"] = row["seen"]
    return [rows[name] for name in sorted(rows)]

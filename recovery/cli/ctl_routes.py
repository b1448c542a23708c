"""Where `recovery-ctl` asks on a partitioned control plane, and how the partitions' answers become one.

With P > 1 partitions each partition's active owner answers on `recovery.ctl.p.<k>.<verb>` about its own jobs
(`recovery.service.control`). A request about one job goes to the job's partition, `partition_of(job, P)` (the hash
the log stream files the job's events under); an event about a node to the node's partition (every partition reads
node events: one publish reaches them all, and the node's partition answers with its own decisions); the fleet-wide
queries (status, jobs, incidents) to every partition at once, merged into the answer one daemon would give, each row
with its partition, and the partitions that gave no answer within the timeout named rather than waited for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from events.subjects import partition_of

FLEET_VERBS = ("status", "jobs", "incidents")
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
    key = "jobs" if verb == "jobs" else "incidents"
    rows = [{**row, "partition": k} for k in sorted(answers) for row in answers[k][key]]
    # one daemon lists jobs in order of their id, and a job's incidents together (stable: each partition's order)
    out[key] = sorted(rows, key=lambda row: str(row["job"]))
    return out

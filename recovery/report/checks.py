"""The nodes whose health checks failed, as `recovery-replay report` lists them: every failed run counts, the idle
spare's and the joining node's too, which no incident names (a node that failed its checks while it held no rank
left the pool before any job's fault could show it). Bounded by the fleet's nodes, never by the log's length."""

from __future__ import annotations

from typing import Any

MAX_CHECK_NAMES = 16
"""failed checks kept by name per node (a node failing every configured command lists the first ones)"""
SAW_CHARS = 200


class FailedChecks:
    """Per node: its failed runs, the checks that failed, what the last one saw, and whether a later run passed."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}

    def add(self, node: str, data: dict[str, Any], ts: int) -> None:
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list):
            return
        failed = [r for r in results if isinstance(r, dict) and not r.get("ok")]
        entry = self.nodes.get(node)
        if not failed:
            if entry is not None and entry["passed_ns"] is None:
                entry["passed_ns"] = ts  # back in service: a later run passed
            return
        if entry is None:
            entry = self.nodes[node] = {"node": node, "failed_runs": 0, "checks": [], "first_failed_ns": ts,
                                        "last_failed_ns": ts, "when": [], "saw": "", "passed_ns": None}
        entry["failed_runs"] += 1
        entry["last_failed_ns"] = ts
        entry["passed_ns"] = None
        for result in failed:
            name = str(result.get("check", ""))
            if name not in entry["checks"] and len(entry["checks"]) < MAX_CHECK_NAMES:
                entry["checks"].append(name)
        moment = str(data.get("when", ""))
        if moment and moment not in entry["when"]:
            entry["when"].append(moment)  # join, start, spare (an idle spare's own refresh too), fault
        entry["saw"] = "; ".join(f"{r.get('check', '')}: {r.get('saw', '')}" for r in failed)[:SAW_CHARS]

    def result(self) -> list[dict[str, Any]]:
        return [{**entry, "checks": sorted(entry["checks"])} for _, entry in sorted(self.nodes.items())]

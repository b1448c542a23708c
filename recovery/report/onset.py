"""When a fault began, as far as the log tells: a fault is confirmed after its signs began (a node unheard for the
agent silence bound, a rank silent for the hang bound), and the time a postmortem counts is from the first sign.

- a node's loss found by its silence: from when its agent was last heard (its last word in the log: a heartbeat, a
  ready), or from `node.silent`'s own `silent_s` where the liveness monitor found it (its heartbeats are not logged);
- a silence the watchdog found: from when the silent ranks were last heard (a heartbeat or a step);
- a hang an agent saw (`process.hang`: a stock rank stopped, or still): `seconds_without_progress` before it;
- anything else (an exit, an XID, a node that said it is not ready): its signal's time.

Some confirmations carry no fault record of their own (a `fault.added` during a recovery): the built-in detection's
words for a silent agent name its nodes, and the fault is then known to be that node's."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

NS = 1_000_000_000
SILENT_AGENT = re.compile(r"^agent of (.+?) silent for more than ")
"""the built-in detection's reason for an agent gone silent (`policies/detection.py`)"""


def silent_nodes(reason: str, job_nodes: Sequence[str]) -> list[str]:
    """The job's nodes a silent-agent reason names ([] if it names none)."""
    found = SILENT_AGENT.match(reason)
    if found is None:
        return []
    named = {name.strip() for name in found.group(1).split(",")}
    return [node for node in job_nodes if node in named]


def by_watchdog(cause: Mapping[str, Any] | None) -> bool:
    """Was the fault found at a watchdog's tick (not a suspicion's confirmation timer)?"""
    env = (cause or {}).get("envelope") or {}
    return env.get("type") == "timer.fired" and "/watchdog/" in str((env.get("data") or {}).get("timer_id", ""))


def onset(fault_class: str | None, nodes: Sequence[str], ranks: Sequence[int], cause: Mapping[str, Any] | None,
          ts: int, node_heard: Mapping[str, int], rank_heard: Mapping[int, int]) -> int:
    """The earliest sign of a fault signalled at `ts` (see the module's docstring), never after `ts`."""
    start = ts
    env = (cause or {}).get("envelope") or {}
    still = (env.get("data") or {}).get("seconds_without_progress") if env.get("type") == "process.hang" else None
    if _seconds(still) and cause is not None:  # a hang its agent saw: the rank stopped making progress that long ago
        return min(start, int(cause["ts"]) - round(still * NS))
    if fault_class not in ("hang", "node") or not (by_watchdog(cause) or env.get("type") == "node.silent"):
        return start  # signalled by an event of its own (an exit, an XID): it began then
    if fault_class == "node":
        heard = [node_heard[n] for n in nodes if n in node_heard]
        if heard:
            start = min(start, min(heard))
        silent = (env.get("data") or {}).get("silent_s") if env.get("type") == "node.silent" else None
        if _seconds(silent) and cause is not None:
            start = min(start, int(cause["ts"]) - round(silent * NS))
    if by_watchdog(cause):
        heard = [rank_heard[r] for r in ranks[:4096] if r in rank_heard]
        if heard:
            start = min(start, min(heard))
    return start


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e9

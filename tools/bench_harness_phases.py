"""Reading a recovery back from the log, for `python tools/bench.py e2e`: when the fault was detected and decided,
the replacement started, the group formed again, the state was loaded and the steps lost were trained again."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from events.envelope import Record

WORLD = 4
"""the bench's job: two nodes of two ranks"""


@dataclass
class Outcome:
    """One case's run: the total, its phases, how many processes started after the fault, the final parameters."""

    recovered_s: float
    phases: dict[str, float]
    processes_restarted: int
    recomputed_steps: int
    out: Path


def unfolded(records: list[Record]) -> list[Any]:
    """The records, each `progress.report` in them as its ranks' own heartbeats and steps at its log time."""
    out: list[Any] = []
    for r in records:
        if r.envelope.type != "progress.report":
            out.append(r)
            continue
        for word in r.envelope.data.ranks:  # type: ignore[union-attr]
            type_ = "process.heartbeat" if word.step is None else "progress.step"
            out.append(SimpleNamespace(ts=r.ts, envelope=SimpleNamespace(type=type_, data=word)))
    return out


def phases_of_ours(records: list[Record], sent: list[tuple[int, str]], struck: int, target: int, victim: int,
                    out: Path) -> Outcome:
    records = unfolded(records)

    def data(r: Any) -> Any:
        return r.envelope.data

    def first(pred: Callable[[Any], bool]) -> Any:
        return next(r for r in records if r.ts >= struck and pred(r))

    exited = first(lambda r: r.envelope.type == "process.exited" and data(r).rank == victim)
    decided = min(ts for ts, kind in sent if ts >= struck and kind in ("restart_ranks", "migrate_ranks", "restart_job"))
    started = [r for r in records if r.ts >= struck and r.envelope.type == "process.started"]
    replacement = started[0]
    new_generation = data(replacement).attempt
    joined = [first(lambda r, rank=rank: r.envelope.type in ("process.heartbeat", "progress.step")
                    and data(r).rank == rank and (data(r).attempt or 0) >= new_generation)
              for rank in range(WORLD) if rank != victim]
    formed = max(r.ts for r in joined)
    recovered = first(lambda r: r.envelope.type == "progress.step" and data(r).rank == victim
                      and (data(r).attempt or 0) >= new_generation and data(r).step > target)
    resumed = first(lambda r: r.envelope.type == "progress.step" and r.ts >= formed
                    and (data(r).attempt or 0) >= new_generation)
    recomputed = data(recovered).step - data(resumed).step + 1
    step_s = median_step_s(records, struck)
    catch_up = recomputed * step_s
    phases = {
        "detect": exited.ts - struck, "decide": decided - exited.ts, "stop": replacement.ts - decided,
        "restart": formed - replacement.ts,
        "load_state": max(0.0, recovered.ts - formed - catch_up * 1e9), "catch_up": catch_up * 1e9,
    }
    return Outcome((recovered.ts - struck) / 1e9, {k: v / 1e9 for k, v in phases.items()}, len(started),
                   recomputed, out)


def median_step_s(records: list[Any], before: int) -> float:
    """Rank 0's time per step before `before`: from its step reports, each step or a period's newest."""
    points = [(r.ts, r.envelope.data.step) for r in records if r.ts < before and r.envelope.type == "progress.step"
              and r.envelope.data.rank == 0]
    gaps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in itertools.pairwise(points) if b[1] > a[1]][-20:]
    return statistics.median(gaps) / 1e9


def confirmed_after(records: list[Record], struck: int) -> float:
    confirmed = [r.ts for r in records if r.ts >= struck and r.envelope.type == "decision"
                 and r.envelope.data.kind == "fault.confirmed"]  # type: ignore[union-attr]
    return (confirmed[0] - struck) / 1e9 if confirmed else float("nan")

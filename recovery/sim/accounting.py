"""Where a simulated run's time went: productive training and lost time by cause, MTTR per fault class,
restarts by granularity; as JSON and as a readable summary.

The ledger splits the run's wall time into labelled intervals, one label at a time, so the causes add up to
the wall time by construction; training intervals are split further by the world (new steps are productive,
steps done again are recomputation, in-memory snapshot stalls are checkpoint overhead). `Result.check()`
verifies the sum.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

NS = 1_000_000_000

CAUSES: dict[str, str] = {
    "detection": "waiting for detection: the job is stopped and the control plane has not confirmed a fault",
    "saving": "saving a dying checkpoint",
    "stopping": "stopping processes",
    "rescheduling": "restarting, moving or rescheduling processes",
    "loading": "loading the resume checkpoint",
    "blocked": "processes restarted but the job cannot run (a link still down, a rank not back)",
    "waiting": "waiting for nodes (not enough spares)",
    "recompute": "recomputing lost steps (and the step in progress at the fault)",
    "checkpoint": "periodic checkpoint stalls (in-memory snapshots and persistent saves)",
    "straggler": "training slowed by a straggler in the placement (the job's pace is its slowest node's)",
    "failed": "the job failed: the rest of the run",
}
"""Causes of lost time, in the order of the summary."""

STATE_LABEL = {
    "submitted": "detection", "running": "detection", "planning": "detection", "settling": "detection",
    "saving": "saving", "stopping": "stopping", "rescheduling": "rescheduling", "restoring": "blocked",
    "waiting": "waiting", "paused": "waiting", "completed": "failed", "failed": "failed", "cancelled": "failed",
}
"""The label of a stopped job's time, from the phase of its recovery or else its state (the world labels training
and loading)."""


class Ledger:
    """Wall time by label: `label(t, name)` ends the current interval at t and starts one of `name`."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.totals: dict[str, int] = {}
        self.current: str | None = None
        self.since = start

    def label(self, t: int, name: str) -> None:
        if name == self.current:
            return
        if self.current is not None:
            self.totals[self.current] = self.totals.get(self.current, 0) + (t - self.since)
        self.current = name
        self.since = t

    def close(self, t: int) -> None:
        self.label(t, "")
        self.totals.pop("", None)


@dataclass
class FaultOutcome:
    index: int
    component: str
    fault_class: str
    at_s: float
    recovered_s: float | None = None
    """when the job made progress again (the incident closed), seconds since the start; None: never"""

    @property
    def ttr_s(self) -> float | None:
        return None if self.recovered_s is None else self.recovered_s - self.at_s


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Result:
    profile: str
    policies: dict[str, str]
    seed: int
    gpus: int
    days: float
    wall_s: float
    productive_s: float
    lost_s: dict[str, float]
    faults: list[FaultOutcome]
    restarts: dict[str, dict[str, int]]
    """granularity -> {"started": n, "recovered": n, "failed": n, "timed_out": n, "superseded": n}"""
    events: int
    decisions: int
    rejections: dict[str, int]
    records: int
    job_state: str
    steps: int
    sim_seconds: float
    """wall-clock seconds the run took"""
    policy_failures: int = 0
    """`policy.failed` decisions: a plugin raised, answered out of bounds or looped, and the built-in answered"""
    engine_seconds: float = 0.0
    """of which in the recorder and the engine (log appends, Engine.apply, recording decisions)"""
    stats: dict[str, int] = field(default_factory=dict)
    landed_on_bad: int = 0
    """recoveries (incidents closed) whose restarts put ranks on a node with a latent bad device: a second fault
    follows within minutes (`recovery.sim.health`)"""
    check_added_s: list[float] = field(default_factory=list)
    """with the agents' health checks on: per recovery, what waiting for the checks added to it"""

    # -- derived --------------------------------------------------------------------------------------
    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s else math.nan

    @property
    def lost_total_s(self) -> float:
        return sum(self.lost_s.values())

    @property
    def recoveries(self) -> int:
        """Incidents closed: the job made progress again after them."""
        return sum(counts.get("recovered", 0) for counts in self.restarts.values())

    def gpu_hours(self, seconds: float) -> float:
        return seconds * self.gpus / 3600

    @property
    def lost_gpu_hours(self) -> float:
        return self.gpu_hours(self.lost_total_s)

    def mttr(self) -> dict[str, dict[str, float]]:
        """Per fault class: how many struck the job, how many were recovered, and time to recovery p50/p95 (from
        the fault to the job's first step after it), in seconds."""
        out: dict[str, dict[str, float]] = {}
        for cls in sorted({f.fault_class for f in self.faults}):
            of = [f for f in self.faults if f.fault_class == cls]
            ttr = [f.ttr_s for f in of if f.ttr_s is not None]
            out[cls] = {"faults": len(of), "recovered": len(ttr), "p50_s": round(percentile(ttr, 50), 1),
                        "p95_s": round(percentile(ttr, 95), 1)}
        return out

    def check(self, tolerance_s: float = 1e-6) -> None:
        """productive + lost = wall time, to the nanosecond (the figures are sums of integer nanoseconds)."""
        total = self.productive_s + self.lost_total_s
        if abs(total - self.wall_s) > tolerance_s:
            raise AssertionError(f"accounting does not add up: productive {self.productive_s} + lost "
                                 f"{self.lost_total_s} = {total} != wall {self.wall_s}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile, "policies": self.policies, "seed": self.seed, "gpus": self.gpus,
            "days": self.days, "ettr": round(self.ettr, 6), "wall_s": self.wall_s,
            "productive_s": self.productive_s, "lost_s": {k: round(v, 3) for k, v in self.lost_s.items()},
            "lost_gpu_hours": {k: round(self.gpu_hours(v), 1) for k, v in self.lost_s.items()},
            "lost_gpu_hours_total": round(self.lost_gpu_hours, 1), "mttr": self.mttr(),
            "restarts": self.restarts, "faults": [asdict(f) for f in self.faults],
            "events": self.events, "decisions": self.decisions, "rejections": self.rejections,
            "policy_failures": self.policy_failures,
            "records": self.records, "job_state": self.job_state, "steps": self.steps,
            "sim_seconds": round(self.sim_seconds, 3), "engine_seconds": round(self.engine_seconds, 3),
            "stats": self.stats, "landed_on_bad": self.landed_on_bad,
            "check_added_s": {"recoveries": len(self.check_added_s),
                              "p50_s": round(percentile(self.check_added_s, 50), 3) if self.check_added_s else 0.0,
                              "total_s": round(sum(self.check_added_s), 3)},
        }

    # -- readable -------------------------------------------------------------------------------------
    def render(self, console: Any | None = None) -> None:
        """Print the summary with rich."""
        # Imported here for start-up time (rich takes 40 ms): simulations in worker processes print nothing.
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        faults = len(self.faults)
        console.print(f"[bold]{self.profile}[/bold] ({', '.join(self.policies.values())}), seed {self.seed}: "
                      f"{self.gpus:,} GPUs for {self.days:g} days, {faults} faults struck the job; "
                      f"job {self.job_state} at step {self.steps:,}; simulated in {self.sim_seconds:.1f} s, "
                      f"{self.engine_seconds:.1f} s of it in the engine and recorder ({self.events:,} events, "
                      f"{self.decisions:,} decisions)")
        console.print(f"ETTR [bold]{self.ettr:.4f}[/bold]: productive {self.productive_s / 3600:,.1f} h of "
                      f"{self.wall_s / 3600:,.1f} h; lost {self.lost_gpu_hours:,.0f} GPU-hours")
        if self.rejections:
            # A policy that raises, or inputs the engine refuses, leave no incident behind: say so up front.
            letters = sum(self.rejections.values())
            errors = self.rejections.get("policy_error", 0)
            codes = ", ".join(f"{code} {n:,}" for code, n in self.rejections.items())
            console.print(f"[bold red]{letters:,} dead letter(s)[/bold red] ({codes})"
                          + (f": [bold red]a policy raised {errors:,} time(s)[/bold red], and each record it was "
                             f"asked about changed nothing" if errors else ""))
        if self.policy_failures:
            console.print(f"[bold red]a policy failed {self.policy_failures:,} time(s)[/bold red]: it raised, answered "
                          f"out of bounds or looped, and the built-in policy of its family answered instead "
                          f"(decisions policy.failed)")
        if self.landed_on_bad or self.check_added_s:
            checks = self.check_added_s
            added = f"; the health checks added {sum(checks):,.0f} s to {len(checks)} recoveries" if checks else ""
            console.print(f"{self.landed_on_bad} of {self.recoveries} recoveries put ranks on a node with a latent bad "
                          f"device{added}")
        lost = Table(title="lost time by cause")
        for col in ("cause", "hours", "GPU-hours", "share of wall"):
            lost.add_column(col, justify="left" if col == "cause" else "right")
        for cause in CAUSES:
            seconds = self.lost_s.get(cause, 0.0)
            if seconds:
                lost.add_row(cause, f"{seconds / 3600:,.2f}", f"{self.gpu_hours(seconds):,.0f}",
                             f"{100 * seconds / self.wall_s:.2f}%")
        console.print(lost)
        mttr = Table(title="time to recovery by fault class (fault -> first step after it)")
        for col in ("class", "faults", "recovered", "p50 s", "p95 s"):
            mttr.add_column(col, justify="left" if col == "class" else "right")
        for cls, m in self.mttr().items():
            mttr.add_row(cls, str(int(m["faults"])), str(int(m["recovered"])), f"{m['p50_s']:.1f}",
                         f"{m['p95_s']:.1f}")
        console.print(mttr)
        restarts = Table(title="recovery attempts by granularity")
        outcomes = ("started", "recovered", "failed", "timed_out", "superseded")
        restarts.add_column("granularity")
        for col in outcomes:
            restarts.add_column(col, justify="right")
        for g, counts in self.restarts.items():
            restarts.add_row(g, *(str(counts.get(o, 0)) for o in outcomes))
        console.print(restarts)


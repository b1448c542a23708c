"""Fault storms: every profile on the same faults at 1x, 10x and 30x the Llama 3 rate, seed by seed, and where our
default falls short. Behind `python tools/bench.py storm` (the full 54-day table) and `tests/test_storm.py` (a short
version in the test suite, so that no change of a policy can silently lose a job the cluster can still run).

The default falls short on a seed when its job fails (the faults here are all of the infrastructure, or a script's
crashes that a restart clears: none is a reason to end the job), or when another profile's ETTR on the same faults
is higher.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from recovery.sim.bench import Outcome, Run, execute

STORM_RATES = (1.0, 10.0, 30.0)
"""times the Llama 3 rate (1.97e-5 faults per GPU-hour): 2e-5, 2e-4 and 6e-4 faults per GPU-hour"""
STORM_PROFILES = ("default", "mindcluster-like", "torchelastic-like")
OURS = "default"


def sweep(gpus: int, days: float, rates: Sequence[float], seeds: Sequence[int],
          profiles: Sequence[str] = STORM_PROFILES,
          workers: int = 1, note: Callable[[str], None] = lambda _: None) -> list[Outcome]:
    """Every profile on every seed at every rate; the heaviest rates first, so that a pool ends with short runs."""
    todo = [Run(profile, gpus, seed, days, rate) for rate in sorted(rates, reverse=True) for seed in seeds
            for profile in profiles]
    return execute(todo, workers, note)


def shortfalls(outcomes: list[Outcome]) -> list[str]:
    """Where `default` failed its job or trailed another profile's ETTR on the same rate and seed."""
    by = {(o.run.profile, o.run.rate, o.run.seed): o for o in outcomes}
    found: list[str] = []
    for (profile, rate, seed), ours in sorted(by.items()):
        if profile != OURS:
            continue
        if ours.failed:
            found.append(f"{rate:g}x seed {seed}: the default failed the job")
        for (other, other_rate, other_seed), theirs in sorted(by.items()):
            if other != OURS and (other_rate, other_seed) == (rate, seed) and theirs.ettr > ours.ettr:
                found.append(f"{rate:g}x seed {seed}: {other} ETTR {theirs.ettr:.4f} > default {ours.ettr:.4f}")
    return found


def table(outcomes: list[Outcome]) -> str:
    """A markdown table of ETTR by rate and seed (rows) and profile (columns), with each rate's median; `F` marks a
    run whose job failed, `W` one that ended waiting."""
    profiles = list(dict.fromkeys(o.run.profile for o in outcomes))
    by = {(o.run.profile, o.run.rate, o.run.seed): o for o in outcomes}
    lines = ["| rate | seed | " + " | ".join(profiles) + " |", "|---|---|" + "---|" * len(profiles)]
    for rate in sorted({o.run.rate for o in outcomes}):
        seeds = sorted({o.run.seed for o in outcomes if o.run.rate == rate})
        for seed in seeds:
            cells = []
            for profile in profiles:
                o = by.get((profile, rate, seed))
                cells.append("" if o is None else f"{o.ettr:.4f}{' F' if o.failed else ' W' if o.waiting else ''}")
            lines.append(f"| {rate:g}x | {seed} | " + " | ".join(cells) + " |")
        medians = [statistics.median(by[(p, rate, s)].ettr for s in seeds if (p, rate, s) in by) for p in profiles]
        lines.append(f"| {rate:g}x | median | " + " | ".join(f"**{m:.4f}**" for m in medians) + " |")
    return "\n".join(lines)

"""The policy benchmark behind `python tools/bench.py policies`: ETTR and lost GPU-hours of our policies and the
baselines on the Llama 3 fault mix, per cluster size, as medians over seeds.

Every profile runs on the same seeds, so on each seed all of them see the same faults at the same times and
places (the fault stream is drawn before a run and does not depend on the policy). Runs are spread over worker
processes; each run is deterministic, so the figures do not depend on the number of workers.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from recovery.sim.config import PROFILES, Cluster, SimConfig
from recovery.sim.sim import simulate

BASELINE = "torchelastic-like"
OURS = ("default", "default-memory")


@dataclass(frozen=True)
class Run:
    profile: str
    gpus: int
    seed: int
    days: float


@dataclass(frozen=True)
class Outcome:
    run: Run
    ettr: float
    lost_gpu_hours: float
    failed: bool
    faults: int
    sim_seconds: float
    engine_seconds: float
    events: int


def one(run: Run) -> Outcome:
    result = simulate(SimConfig(cluster=Cluster(gpus=run.gpus), days=run.days, seed=run.seed,
                                profile=PROFILES[run.profile]))
    return Outcome(run, result.ettr, result.lost_gpu_hours, result.job_state == "failed", len(result.faults),
                   result.sim_seconds, result.engine_seconds, result.events)


def runs(profiles: Sequence[str], scales: Sequence[int], seeds: Sequence[int], days: float) -> list[Run]:
    # the biggest runs first, so that a pool of workers ends with the short ones
    return [Run(p, g, s, days) for g in sorted(scales, reverse=True) for s in seeds for p in profiles]


def execute(todo: list[Run], workers: int, note: Callable[[str], None]) -> list[Outcome]:
    done: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        r = outcome.run
        note(f"  {r.profile:>19} {r.gpus:>6} GPUs seed {r.seed}: ETTR {outcome.ettr:.4f}, lost "
             f"{outcome.lost_gpu_hours:,.0f} GPU-h, {outcome.faults} faults{', job FAILED' if outcome.failed else ''}"
             f" ({outcome.sim_seconds:.1f} s, {outcome.engine_seconds:.1f} s in the engine)")
        done.append(outcome)

    if workers <= 1:
        for run in todo:
            report(one(run))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for outcome in pool.map(one, todo):
                report(outcome)
    return done


def metrics(outcomes: list[Outcome], days: float) -> Iterator[tuple[str, float, str]]:
    """(metric, value, unit): medians over seeds, per cluster size and profile."""
    by = {(o.run.profile, o.run.gpus, o.run.seed): o for o in outcomes}
    for gpus in sorted({o.run.gpus for o in outcomes}, reverse=True):
        at = [o for o in outcomes if o.run.gpus == gpus]
        seeds = sorted({o.run.seed for o in at})
        for profile in sorted({o.run.profile for o in at}, key=lambda p: (p not in OURS, p)):
            mine = [o for o in at if o.run.profile == profile]
            yield f"{profile}.{gpus}gpu.ettr", _sig(statistics.median(o.ettr for o in mine)), "ratio (median)"
            yield (f"{profile}.{gpus}gpu.lost_gpu_hours", _sig(statistics.median(o.lost_gpu_hours for o in mine)),
                   "GPU-h (median)")
            yield f"{profile}.{gpus}gpu.failed_runs", float(sum(o.failed for o in mine)), f"of {len(mine)} runs"
            if profile != BASELINE and all((BASELINE, gpus, s) in by for s in seeds):
                ratios = [by[(profile, gpus, s)].lost_gpu_hours / by[(BASELINE, gpus, s)].lost_gpu_hours
                          for s in seeds if (profile, gpus, s) in by]
                yield (f"{profile}.{gpus}gpu.lost_vs_{BASELINE}", _sig(statistics.median(ratios)),
                       "x (median over seeds of the per-seed ratio)")
        # a run whose job failed stops early: time only the runs that simulated the whole horizon
        timed = [o for o in at if not o.failed] or at
        yield (f"sim.{gpus}gpu.{days:g}d.seconds", _sig(statistics.median(o.sim_seconds for o in timed)),
               "s (median wall time of a run over the whole horizon, any profile)")
        yield (f"sim.{gpus}gpu.{days:g}d.seconds_max", _sig(max(o.sim_seconds for o in timed)), "s (slowest run)")
        yield (f"sim.{gpus}gpu.{days:g}d.seconds_outside_engine",
               _sig(statistics.median(o.sim_seconds - o.engine_seconds for o in timed)),
               "s (median: the simulator itself, without Recorder.feed)")


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def main(seeds: int, scales: Sequence[int], days: float, profiles: Sequence[str], workers: int,
         emit: Callable[[str, float, str], None], note: Callable[[str], None] | None = None) -> list[Outcome]:
    note = note or (lambda message: print(message, file=sys.stderr, flush=True))
    todo = runs(profiles, scales, range(seeds), days)
    note(f"policies bench: {len(todo)} runs ({', '.join(profiles)}) x {list(scales)} GPUs x {seeds} seed(s), "
         f"{days:g} days each, {workers} worker(s)")
    outcomes = execute(todo, workers, note)
    for metric, value, unit in metrics(outcomes, days):
        emit(metric, value, unit)
    return outcomes

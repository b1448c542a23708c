"""The policy benchmark behind `python tools/bench.py policies`: ETTR and lost GPU-hours of our policies and the
baselines, swept over fault rates, cluster sizes and fault mixes, as medians over seeds.

The cases: the Llama 3 mix at each rate factor (1x, 3x, 10x its own rate) on the smallest cluster size, the Llama 3
mix at 1x on every larger size, the double-bit-ECC mix (`data/dbe_repeating.csv`: XID 48 faults that keep
striking the same GPUs until they are replaced) at 3x the Llama 3 rate on the smallest size, and the straggler mix
(`data/stragglers.csv`: nodes that compute 1.6-2x slower, and the synchronous job with them, until repaired or
drained) at 3x on 1,024 GPUs for at most 14 days, with the job's watchdog on (its straggler check reads the ranks'
compute times): what a straggler costs is the time the job trains at its pace, and a policy that drains it at the
next checkpoint loses far less than one that waits for its repair. Every profile runs on
the same seeds, so on each seed all of them see the same faults at the same times and places (the fault stream is
drawn before a run and does not depend on the policy). Runs are spread over worker processes; each run is
deterministic, so the figures do not depend on the number of workers.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from recovery.sim.config import PROFILES, Cluster, SimConfig
from recovery.sim.faults import FaultMix
from recovery.sim.sim import simulate

BASELINES = ("torchelastic-like", "mindcluster-like")
BASELINE = "torchelastic-like"
"""the baseline lost GPU-hours are compared against"""
OURS = ("default", "default-memory")
MIXES: dict[str, Path | None] = {"llama3": None, "dbe": Path(__file__).parent / "data" / "dbe_repeating.csv",
                                 "straggler": Path(__file__).parent / "data" / "stragglers.csv"}
"""mix name -> CSV (None: the Llama 3 mix)"""
STRAGGLER_GPUS = 1_024
STRAGGLER_DAYS = 14.0
"""the straggler mix's case: its watchdog and the agents' reports before each tick cost the simulator per node and
per tick, so it runs on a smaller cluster for at most this long (a straggler's cost shows within days)"""
WATCH_S = 600.0
"""the straggler case's watchdog period: the detection policy's straggler check runs on its ticks"""
DBE_RATE = 3.0
"""the double-bit-ECC mix runs at this many times the Llama 3 rate (a bad batch of HBM, a cooling failure)"""


@dataclass(frozen=True)
class Run:
    profile: str
    gpus: int
    seed: int
    days: float
    rate: float = 1.0
    """times the Llama 3 rate (1.97e-5 faults per GPU-hour)"""
    mix: str = "llama3"

    @property
    def case(self) -> str:
        """`4096gpu.10x`, `16384gpu` (the Llama 3 mix at its own rate), `4096gpu.dbe`: how metrics name the case."""
        name = f"{self.gpus}gpu"
        if self.mix != "llama3":
            return f"{name}.{self.mix}"
        return name if self.rate == 1.0 else f"{name}.{self.rate:g}x"


@dataclass(frozen=True)
class Outcome:
    run: Run
    ettr: float
    lost_gpu_hours: float
    failed: bool
    waiting: bool
    """the job ended the run waiting for nodes"""
    faults: int
    sim_seconds: float
    engine_seconds: float
    events: int
    cpu_seconds: float = 0.0
    """the run's process CPU time: what it costs on a machine shared with other work, where wall time says more
    about the neighbours"""


def one(run: Run) -> Outcome:
    cpu = time.process_time()
    llama = FaultMix.load().rate_per_gpu_hour
    mix = MIXES[run.mix]
    result = simulate(SimConfig(cluster=Cluster(gpus=run.gpus), days=run.days, seed=run.seed,
                                profile=PROFILES[run.profile], mix_path=None if mix is None else str(mix),
                                rate_per_gpu_hour=None if run.rate == 1.0 and mix is None else run.rate * llama,
                                watch_s=WATCH_S if run.mix == "straggler" else None))
    return Outcome(run, result.ettr, result.lost_gpu_hours, result.job_state == "failed",
                   "waiting" in result.job_state, len(result.faults), result.sim_seconds, result.engine_seconds,
                   result.events, time.process_time() - cpu)


def runs(profiles: Sequence[str], scales: Sequence[int], seeds: Sequence[int], days: float,
         rates: Sequence[float] = (1.0,), mixes: Sequence[str] = ("llama3",)) -> list[Run]:
    """The sweep: every rate on the smallest scale, 1x on the larger ones, the DBE mix on the smallest; the biggest
    runs first, so that a pool of workers ends with the short ones."""
    base = min(scales)
    cases: list[tuple[int, float, str]] = []
    if "llama3" in mixes:
        cases += [(g, 1.0, "llama3") for g in sorted(scales, reverse=True) if g != base]
        cases += [(base, r, "llama3") for r in sorted(rates, reverse=True) if r > DBE_RATE]
    cases += [(base, DBE_RATE, m) for m in mixes if m not in ("llama3", "straggler")]
    if "llama3" in mixes:
        cases += [(base, r, "llama3") for r in sorted(rates, reverse=True) if r <= DBE_RATE]
    todo = [Run(p, g, s, days, r, m) for g, r, m in cases for s in seeds for p in profiles]
    if "straggler" in mixes:
        todo += [Run(p, STRAGGLER_GPUS, s, min(days, STRAGGLER_DAYS), DBE_RATE, "straggler")
                 for s in seeds for p in profiles]
    return todo


def execute(todo: list[Run], workers: int, note: Callable[[str], None]) -> list[Outcome]:
    done: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        r = outcome.run
        end = ", job FAILED" if outcome.failed else ", job WAITING at the end" if outcome.waiting else ""
        note(f"  {r.profile:>19} {r.case:>14} seed {r.seed}: ETTR {outcome.ettr:.4f}, lost "
             f"{outcome.lost_gpu_hours:,.0f} GPU-h, {outcome.faults} faults{end}"
             f" ({outcome.sim_seconds:.1f} s, {outcome.engine_seconds:.1f} s in the engine, "
             f"{outcome.cpu_seconds:.1f} s CPU)")
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
    """(metric, value, unit): medians over seeds, per case and profile, and how ours compare on every seed."""
    by = {(o.run.profile, o.run.case, o.run.seed): o for o in outcomes}
    cases = list(dict.fromkeys(o.run.case for o in outcomes))
    for case in cases:
        at = [o for o in outcomes if o.run.case == case]
        seeds = sorted({o.run.seed for o in at})
        profiles = sorted({o.run.profile for o in at}, key=lambda p: (p not in OURS, p))
        for profile in profiles:
            mine = [o for o in at if o.run.profile == profile]
            yield f"{profile}.{case}.ettr", _sig(statistics.median(o.ettr for o in mine)), "ratio (median)"
            yield f"{profile}.{case}.ettr_min", _sig(min(o.ettr for o in mine)), "ratio (worst seed)"
            yield (f"{profile}.{case}.lost_gpu_hours", _sig(statistics.median(o.lost_gpu_hours for o in mine)),
                   "GPU-h (median)")
            yield f"{profile}.{case}.failed_runs", float(sum(o.failed for o in mine)), f"of {len(mine)} runs"
            yield f"{profile}.{case}.waiting_runs", float(sum(o.waiting for o in mine)), f"of {len(mine)} runs"
            for baseline in BASELINES:
                if profile == baseline or not all((baseline, case, s) in by for s in seeds):
                    continue
                pairs = [(by[(profile, case, s)], by[(baseline, case, s)]) for s in seeds if (profile, case, s) in by]
                if baseline == BASELINE:
                    ratios = [ours.lost_gpu_hours / max(theirs.lost_gpu_hours, 1e-9) for ours, theirs in pairs]
                    yield (f"{profile}.{case}.lost_vs_{baseline}", _sig(statistics.median(ratios)),
                           "x (median over seeds of the per-seed ratio)")
                if profile in OURS:
                    yield (f"{profile}.{case}.seeds_below_{baseline}",
                           float(sum(ours.ettr < theirs.ettr for ours, theirs in pairs)),
                           f"of {len(pairs)} seeds with a lower ETTR than {baseline}")
        # a run whose job failed stops early: time only the runs that simulated the whole horizon
        timed = [o for o in at if not o.failed] or at
        yield (f"sim.{case}.{days:g}d.seconds", _sig(statistics.median(o.sim_seconds for o in timed)),
               "s (median wall time of a run over the whole horizon, any profile)")
        yield f"sim.{case}.{days:g}d.seconds_max", _sig(max(o.sim_seconds for o in timed)), "s (slowest run)"
        yield (f"sim.{case}.{days:g}d.cpu_seconds", _sig(sum(o.cpu_seconds for o in at)),
               "s (CPU time of every run of the case, summed)")
        yield (f"sim.{case}.{days:g}d.seconds_outside_engine",
               _sig(statistics.median(o.sim_seconds - o.engine_seconds for o in timed)),
               "s (median: the simulator itself, without Recorder.feed)")


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def main(seeds: int, scales: Sequence[int], days: float, profiles: Sequence[str], workers: int,
         emit: Callable[[str, float, str], None], note: Callable[[str], None] | None = None,
         rates: Sequence[float] = (1.0,), mixes: Sequence[str] = ("llama3",)) -> list[Outcome]:
    note = note or (lambda message: print(message, file=sys.stderr, flush=True))
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        raise ValueError(f"unknown mix(es) {unknown}: known {sorted(MIXES)}")
    todo = runs(profiles, scales, range(seeds), days, rates, mixes)
    note(f"policies bench: {len(todo)} runs ({', '.join(profiles)}) x cases "
         f"{list(dict.fromkeys(r.case for r in todo))} x {seeds} seed(s), {days:g} days each, {workers} worker(s)")
    outcomes = execute(todo, workers, note)
    for metric, value, unit in metrics(outcomes, days):
        emit(metric, value, unit)
    return outcomes

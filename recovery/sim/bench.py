"""The policy benchmark behind `python tools/bench.py policies`: ETTR and lost GPU-hours of our policies and the
baselines, swept over fault rates, cluster sizes and fault mixes, as medians over seeds.

The cases: the Llama 3 mix at each rate factor (1x, 3x, 10x its own rate) on the smallest cluster size, the Llama 3
mix at 1x on every larger size, the double-bit-ECC mix (`data/dbe_repeating.csv`: XID 48 faults that keep
striking the same GPUs until they are replaced) at 3x the Llama 3 rate on the smallest size, and the straggler mix
(`data/stragglers.csv`: nodes that compute 1.6-2x slower, and the synchronous job with them, until repaired or
drained) at 3x on 1,024 GPUs for at most 14 days, with the job's watchdog on (its straggler check reads the ranks'
compute times): what a straggler costs is the time the job trains at its pace, and a policy that drains it at the
next checkpoint loses far less than one that waits for its repair. The latent case (`latent`) is the Llama 3 mix at
3x on the smallest size with latent bad devices (repairs that did not hold, spares that came bad:
`recovery.sim.health`), run with the `default` profile with the node agents' health checks on and off on the same
seeds: what the checks save (`checks_ettr_gain`, `checks_second_fault_share`) and what they cost a recovery
(`checks_recovery_added_s`). Every profile runs on
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

from recovery.sim.accounting import percentile
from recovery.sim.config import PROFILES, Agents, Cluster, Costs, SimConfig
from recovery.sim.faults import FaultMix
from recovery.sim.sim import simulate

BASELINES = ("torchelastic-like", "mindcluster-like")
BASELINE = "torchelastic-like"
"""the baseline lost GPU-hours are compared against"""
OURS = ("default", "default-memory")
MIXES: dict[str, Path | None] = {"llama3": None, "dbe": Path(__file__).parent / "data" / "dbe_repeating.csv",
                                 "straggler": Path(__file__).parent / "data" / "stragglers.csv", "latent": None}
"""mix name -> CSV (None: the Llama 3 mix)"""
STRAGGLER_GPUS = 1_024
STRAGGLER_DAYS = 14.0
"""the straggler mix's case: its watchdog and the agents' reports before each tick cost the simulator per node and
per tick, so it runs on a smaller cluster for at most this long (a straggler's cost shows within days)"""
WATCH_S = 600.0
"""the straggler case's watchdog period: the detection policy's straggler check runs on its ticks"""
DBE_RATE = 3.0
"""the double-bit-ECC mix runs at this many times the Llama 3 rate (a bad batch of HBM, a cooling failure)"""
LATENT_AFTER_REPAIR = 0.1
LATENT_SPARES = 0.05
"""the latent case: the share of repairs that do not hold and of spares that join with a latent bad device
(assumptions: no public figure we have gives either; recovery/sim/README.md)"""
LATENT_CHECK_S = 10.0
"""the latent case's checks take as long as a set that can see a bad GPU (`gpu-compute`: an assumption), not the
CPU-only set's 0.5 s: only the GPU checks find a latent GPU"""
LATENT_PROFILE = "default"


@dataclass(frozen=True)
class Run:
    profile: str
    gpus: int
    seed: int
    days: float
    rate: float = 1.0
    """times the Llama 3 rate (1.97e-5 faults per GPU-hour)"""
    mix: str = "llama3"
    checks: bool = False
    """the node agents run health checks (the latent case runs with and without)"""

    @property
    def case(self) -> str:
        """`4096gpu.10x`, `16384gpu` (the Llama 3 mix at its own rate), `4096gpu.dbe`, `4096gpu.latent.checks`: how
        metrics name the case."""
        name = f"{self.gpus}gpu"
        if self.mix != "llama3":
            return f"{name}.{self.mix}" + (".checks" if self.checks else "")
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
    recoveries: int = 0
    landed_on_bad: int = 0
    """recoveries whose restarts put ranks on a node with a latent bad device"""
    check_added_s: tuple[float, ...] = ()
    """per recovery, what waiting for the health checks added to it (runs with checks)"""


def one(run: Run) -> Outcome:
    cpu = time.process_time()
    llama = FaultMix.load().rate_per_gpu_hour
    mix = MIXES[run.mix]
    latent = run.mix == "latent"
    cluster = (Cluster(gpus=run.gpus, latent_after_repair=LATENT_AFTER_REPAIR, latent_spares=LATENT_SPARES) if latent
               else Cluster(gpus=run.gpus))
    result = simulate(SimConfig(cluster=cluster, days=run.days, seed=run.seed,
                                profile=PROFILES[run.profile], mix_path=None if mix is None else str(mix),
                                rate_per_gpu_hour=None if run.rate == 1.0 and mix is None else run.rate * llama,
                                watch_s=WATCH_S if run.mix == "straggler" else None,
                                agents=Agents(health_checks=run.checks),
                                costs=Costs(check_s=LATENT_CHECK_S) if latent else Costs()))
    return Outcome(run, result.ettr, result.lost_gpu_hours, result.job_state == "failed",
                   "waiting" in result.job_state, len(result.faults), result.sim_seconds, result.engine_seconds,
                   result.events, time.process_time() - cpu, result.recoveries, result.landed_on_bad,
                   tuple(result.check_added_s))


def runs(profiles: Sequence[str], scales: Sequence[int], seeds: Sequence[int], days: float,
         rates: Sequence[float] = (1.0,), mixes: Sequence[str] = ("llama3",)) -> list[Run]:
    """The sweep: every rate on the smallest scale, 1x on the larger ones, the DBE mix on the smallest; the biggest
    runs first, so that a pool of workers ends with the short ones."""
    base = min(scales)
    cases: list[tuple[int, float, str]] = []
    if "llama3" in mixes:
        cases += [(g, 1.0, "llama3") for g in sorted(scales, reverse=True) if g != base]
        cases += [(base, r, "llama3") for r in sorted(rates, reverse=True) if r > DBE_RATE]
    cases += [(base, DBE_RATE, m) for m in mixes if m not in ("llama3", "straggler", "latent")]
    if "llama3" in mixes:
        cases += [(base, r, "llama3") for r in sorted(rates, reverse=True) if r <= DBE_RATE]
    todo = [Run(p, g, s, days, r, m) for g, r, m in cases for s in seeds for p in profiles]
    if "latent" in mixes:  # one profile, with the agents' checks and without, on the same seeds
        todo[:0] = [Run(LATENT_PROFILE, base, s, days, DBE_RATE, "latent", checks)
                    for s in seeds for checks in (False, True)]
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


def checks_metrics(outcomes: list[Outcome]) -> Iterator[tuple[str, float, str]]:
    """The latent case: what the node agents' health checks change, runs with them against runs without on the same
    seeds (the same faults and the same latent devices)."""
    latent = [o for o in outcomes if o.run.mix == "latent"]
    by = {(o.run.gpus, o.run.seed, o.run.checks): o for o in latent}
    for gpus in sorted({o.run.gpus for o in latent}):
        seeds = sorted(s for g, s, checks in by if g == gpus and checks and (g, s, False) in by)
        if not seeds:
            continue
        name = f"{LATENT_PROFILE}.{gpus}gpu.latent"
        gains = [by[(gpus, s, True)].ettr - by[(gpus, s, False)].ettr for s in seeds]
        yield f"{name}.checks_ettr_gain", _sig(statistics.median(gains)), "ETTR (median over seeds: checks - none)"
        for checks, label in ((True, "with"), (False, "without")):
            runs_ = [by[(gpus, s, checks)] for s in seeds]
            recoveries = sum(o.recoveries for o in runs_)
            landed = sum(o.landed_on_bad for o in runs_)
            yield (f"{name}.checks_second_fault_share.{label}", _sig(landed / recoveries if recoveries else 0.0),
                   f"of {recoveries} recoveries landed on a node with a latent bad device ({label} checks)")
        added = [a for s in seeds for a in by[(gpus, s, True)].check_added_s]
        yield (f"{name}.checks_recovery_added_s", _sig(percentile(added, 50) if added else 0.0),
               f"s (median over {len(added)} recoveries with checks: what waiting for them added)")


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
    for metric, value, unit in checks_metrics(outcomes):
        emit(metric, value, unit)
    return outcomes

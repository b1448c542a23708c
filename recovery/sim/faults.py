"""Fault mixes, fault traces and the faults of one run, drawn before it starts.

A mix is a CSV with the columns of `data/llama3_405b_interruptions.csv` (`component, category, count, signal,
scope`). Faults arrive as a Poisson process whose rate is scaled to the job's size (per GPU-hour), and each is
drawn from the mix by its count. Every random choice of a run's faults comes from one RNG seeded by the run's
seed, and all of them are drawn before the run starts: two policies simulated with the same seed see the same
faults at the same times, at the same positions of their placement (common random numbers).

What each row becomes on the wire (which NVIDIA XID, which exit status) is our reading, in `DEVICE_CODES`,
`EXITS` and `OVERRIDES`; README.md (recovery/sim) lists it with the reasons.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from recovery.sim.config import Durations

T = TypeVar("T")

NS = 1_000_000_000
HOUR_NS = 3600 * NS

SIGNALS = ("device", "process", "network", "node", "hang", "straggler")
SCOPES = ("device", "rank", "node", "switch", "job")

PACKAGED_MIX = Path(__file__).parent / "data" / "llama3_405b_interruptions.csv"
SHARED_MIX = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "llama3_405b_interruptions.csv"
"""`../shared/data/...` from the repository root: preferred when present, the packaged copy otherwise."""

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
"""The exposure behind the Llama 3 counts: 16,384 H100 GPUs for 54 days (Llama 3 paper, Section 3.3.4)."""


def default_mix_path() -> Path:
    shared = SHARED_MIX.resolve()
    return shared if shared.is_file() else PACKAGED_MIX


# -- what a row emits ---------------------------------------------------------------------------------------
DEVICE_CODES: dict[str, tuple[tuple[str, int], ...]] = {
    # component -> (NVIDIA XID, weight): the XIDs such a failure raises, read from NVIDIA's XID catalog
    # (policies/codes.py has the meaning of each). The weights are ours.
    "Faulty GPU": (("79", 4), ("119", 2), ("46", 2), ("62", 1)),
    "GPU HBM3 Memory": (("48", 5), ("94", 3), ("95", 2)),
    "GPU SRAM Memory": (("95", 6), ("48", 4)),
    "GPU System Processor": (("119", 6), ("120", 4)),
    "GPU Thermal Interface + Sensor": (("79", 1),),
    "GPU DBE": (("48", 1),),
    "GPU Off The Bus": (("79", 1),),
}
GENERIC_DEVICE_CODES: tuple[tuple[str, int], ...] = (("79", 1), ("48", 1), ("94", 1))
"""XIDs for a device row whose component the table above does not name (another mix)."""

FOLLOW_UPS: dict[str, str] = {"48": "63"}
"""An XID that is followed by another on the same device a second later: a double-bit error (48) is followed
by the row remapping that retires the page (63), which the catalog says to watch, not act on."""

EXITS: tuple[tuple[int | None, int | None, int], ...] = ((None, 11, 4), (134, None, 3), (1, None, 3))
"""(exit code, signal, weight) of a crashed process: SIGSEGV, SIGABRT seen as 128+6, a plain exit 1."""

OVERRIDES: dict[str, str] = {
    # Silent data corruption raises no XID: the training loop's own checks (loss spike, NaN) find it and the
    # rank exits with an error, so it reaches the control plane as a process exit on that rank.
    "Silent Data Corruption": "process",
}


@dataclass(frozen=True, slots=True)
class MixRow:
    component: str
    category: str
    count: int
    signal: str
    scope: str
    repeat: float = 0.0
    """the share of this row's faults that strike a device this row struck before (a lemon: a GPU whose memory
    keeps raising double-bit errors until it is replaced); the optional `repeat` column, 0 when absent"""
    slowdown: float = 1.0
    """a straggler row's factor: the struck node computes each step this many times slower (and the synchronous
    job with it) until it is repaired or drained; the optional `slowdown` column, 1 when absent"""


@dataclass(frozen=True)
class FaultMix:
    """A fault mix: rows with counts, and the GPU-hours they were observed over (for the rate)."""

    rows: tuple[MixRow, ...]
    source: str
    gpus: int = LLAMA3_GPUS
    days: float = LLAMA3_DAYS

    @property
    def total(self) -> int:
        return sum(row.count for row in self.rows)

    @property
    def rate_per_gpu_hour(self) -> float:
        """Interruptions per GPU-hour: 419 / (16,384 x 54 x 24) = 1.97e-5 for the Llama 3 mix."""
        return self.total / (self.gpus * self.days * 24)

    @classmethod
    def load(cls, path: str | Path | None = None, gpus: int = LLAMA3_GPUS, days: float = LLAMA3_DAYS) -> FaultMix:
        """Read a mix CSV (default: the shared Llama 3 mix, else the packaged copy)."""
        where = Path(path) if path is not None else default_mix_path()
        rows: list[MixRow] = []
        with open(where, newline="") as fh:
            for line, raw in enumerate(csv.DictReader(fh), 2):
                try:
                    row = MixRow(raw["component"].strip(), raw["category"].strip(), int(raw["count"]),
                                 raw["signal"].strip(), raw["scope"].strip(), float(raw.get("repeat") or 0.0),
                                 float(raw.get("slowdown") or 1.0))
                except (KeyError, ValueError, AttributeError) as exc:
                    raise ValueError(f"{where}:{line}: not a mix row ({exc})") from exc
                if (row.signal not in SIGNALS or row.scope not in SCOPES or row.count < 0
                        or not 0.0 <= row.repeat <= 1.0 or not 1.0 <= row.slowdown <= 100.0):
                    raise ValueError(f"{where}:{line}: signal must be one of {SIGNALS}, scope one of {SCOPES}, "
                                     f"count >= 0, repeat within [0, 1], slowdown within [1, 100]; got {row}")
                rows.append(row)
        if not rows or sum(r.count for r in rows) == 0:
            raise ValueError(f"{where}: the mix has no faults")
        return cls(tuple(rows), str(where), gpus, days)


# -- the faults of a run ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Collective:
    """A collective that timed out as a recorded night's `network.collective_timeout` reported it: its group, its
    members and those that reported (the others never joined), after `timeout_s`."""

    group: str
    members: tuple[int, ...]
    reporters: tuple[int, ...]
    operation: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class CollectiveFailure:
    """A collective that timed out while every rank lived, as a recorded night's `process.collective_failed` reports
    said: the ranks that reported it, each ns after the first, with the group's timeout and the backend's error."""

    reports: tuple[tuple[int, int, int], ...]
    """(rank, ns after the fault, generations after the fault's): a report in a later generation says that the step
    failed again after a retry formed the group anew"""
    timeout_s: float = 0.0
    operation: str = "allreduce"
    error: str = ""


@dataclass(frozen=True, slots=True)
class LossReport:
    """A rank's report of a bad loss, as a recorded night's engine took it (a NaN, an infinity or a spike): steps are
    counted from the step the job had reached at the fault, so the report names the step the simulated job is at."""

    rank: int
    after_ns: int
    """ns after the fault"""
    step: int
    """the report's step, less the job's step at the fault"""
    loss: float | str
    """as recorded: a number, or "nan", "inf", "-inf" (the wire's spelling of the non-finite ones)"""
    loss_step: int | None = None
    """a node agent's fold (`progress.report`): the step of `loss`, less the job's step at the fault; None: the rank's
    own `progress.step`, whose loss is its step's"""
    skip: tuple[str, ...] = ()
    """the samples or batches the script named for the step"""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: when, what, and where, as a position in the job's placement (so that the same fault strikes
    the same place of the job whichever nodes the policy has moved it to)."""

    index: int
    at_ns: int
    """time since the start of the run"""
    component: str
    signal: str
    scope: str
    position: int
    """index of the struck node in the job's placement"""
    device: int
    code: str | None = None
    """NVIDIA XID of a device fault"""
    exit_code: int | None = None
    exit_signal: int | None = None
    outage_ns: int = 0
    """how long links stay down (network faults); 0 for a fault that stays until repaired"""
    repair_ns: int = 0
    """how long the broken hardware takes to come back (repair, replacement, reboot)"""
    node: str | None = None
    """a trace can name the node instead of a position; a repeating mix row names it too (the lemon is the
    physical device, wherever the job has moved)"""
    repeat: bool = False
    """the fault strikes a device struck before: it does not happen once that device has been replaced"""
    slowdown: float = 1.0
    """a straggler: the node computes this many times slower for `repair_ns`, unless drained first"""
    exits: tuple[int, ...] = ()
    """a process fault's further ranks that exit with its status at its time (a platform's SIGTERM reaches every rank
    of the job), as a recorded night shows them; empty: only the struck rank"""
    dying: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """a process fault's dying checkpoint, written by the ranks' SIGTERM handlers as a recorded night shows it: per
    `checkpoint.saved`, ns after the exit (one at or before it is sent just before the exits) and its shards, at the
    step the job reached. Empty: nothing is saved (the cost model's processes crash)"""
    collective: Collective | None = None
    """a hang found by its peers' collective timeout as a recorded night reported it: the members that never joined
    hang from the fault's time, and the timeout is reported as recorded `timeout_s` later. None: the cost model's
    hang (the agent reports it, the peers time out after `Agents.collective_timeout_s`)"""

    pool: str | None = None
    """a `join`'s spare pool (None: the shared pool)"""
    command: tuple[str, tuple[tuple[str, object], ...]] | None = None
    """an `operator` input's command, as a recorded night's operator sent it: its type (`operator.scale`) and data"""
    silent: bool = False
    """a hang its agent does not report (a recorded night found it only by the rank's silence, on the engine's
    watchdog): the rank stops reporting, nothing else is said"""
    failed_collective: CollectiveFailure | None = None
    """the `collective` signal's reports (a recorded night's `process.collective_failed`): the step under way fails
    with every process alive; None for any other signal"""
    compute_slowdown: float | None = None
    """a recorded straggler: how many times its peers' compute time its ranks reported, where the job's pace
    (`slowdown`) is what the log measured; None: `slowdown` (the cost model's straggler computes the whole step)"""
    losses: tuple[LossReport, ...] = ()
    """the `bad_step` signal's reports (a recorded night's losses the engine took as a bad step), in order"""
    recent_losses: tuple[float, ...] = ()
    """a `bad_step` found by a spike: the finite losses the recorded ranks reported before it, oldest first (what the
    engine judged the spike against); empty for a NaN or an infinity, which need none"""

    @property
    def fault_class(self) -> str:
        return self.signal


def _weighted(rng: random.Random, choices: Sequence[tuple[T, int]]) -> T:
    total = sum(w for _, w in choices)
    pick = rng.random() * total
    for value, weight in choices:
        pick -= weight
        if pick < 0:
            return value
    return choices[-1][0]


def node_name(index: int) -> str:
    """The simulated cluster's name of its node `index` (the job's initial placement first, then the spares)."""
    return f"n{index:05d}"


@dataclass
class FaultDraw:
    """Draws faults from a mix; every draw consumes the same random numbers whatever the outcome (a mix with
    repeating rows draws one more per fault, so a mix without them keeps the stream it always had)."""

    mix: FaultMix
    durations: Durations = field(default_factory=Durations)
    struck: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """per repeating row: the (position, device) pairs it struck, in order"""

    def one(self, rng: random.Random, index: int, at_ns: int, positions: int, devices: int) -> Fault:
        row = _weighted(rng, [(row, row.count) for row in self.mix.rows])
        position = rng.randrange(positions)
        device = rng.randrange(devices)
        repeat = False
        if any(r.repeat > 0 for r in self.mix.rows):
            u_repeat = rng.random()
            earlier = self.struck.setdefault(row.component, []) if row.repeat > 0 else None
            if earlier is not None:
                if earlier and u_repeat < row.repeat:
                    position, device = earlier[int(u_repeat / row.repeat * len(earlier)) % len(earlier)]
                    repeat = True
                else:
                    earlier.append((position, device))
        xid = _weighted(rng, DEVICE_CODES.get(row.component, GENERIC_DEVICE_CODES))
        exit_code, exit_signal, _ = EXITS[_weighted(rng, [(i, weight) for i, (_, _, weight) in enumerate(EXITS)])]
        low, high = self.durations.switch_outage_s
        outage = low + (high - low) * rng.random()
        u_repair = rng.random()
        signal = OVERRIDES.get(row.component, row.signal)
        scope = "rank" if signal == "process" and row.signal != "process" else row.scope
        mean = {"device": self.durations.device_repair_mean_s, "node": self.durations.node_repair_mean_s,
                "network": self.durations.nic_repair_mean_s, "straggler": self.durations.straggler_mean_s,
                }.get(signal, self.durations.node_repair_mean_s)
        repair = -mean * math.log(1.0 - u_repair)
        return Fault(index=index, at_ns=at_ns, component=row.component, signal=signal, scope=scope,
                     position=position, device=device, code=xid if signal == "device" else None,
                     exit_code=exit_code, exit_signal=exit_signal,
                     outage_ns=int(outage * NS) if scope == "switch" else 0,
                     repair_ns=max(NS, int(repair * NS)),
                     node=node_name(position) if row.repeat > 0 else None, repeat=repeat, slowdown=row.slowdown)


def draw_faults(mix: FaultMix, *, gpus: int, positions: int, devices: int, horizon_ns: int, seed: int,
                rate_per_gpu_hour: float | None = None, durations: Durations | None = None) -> list[Fault]:
    """The faults of one run: Poisson arrivals at `rate_per_gpu_hour` x `gpus` (default: the mix's own rate),
    each drawn from the mix, at a uniformly chosen node position and device."""
    rate = (rate_per_gpu_hour if rate_per_gpu_hour is not None else mix.rate_per_gpu_hour) * gpus / HOUR_NS
    rng = random.Random(f"recovery-sim/faults/{seed}")
    draw = FaultDraw(mix, durations or Durations())
    faults: list[Fault] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_ns:
            break
        faults.append(draw.one(rng, len(faults), int(t), positions, devices))
    return faults


# -- traces -------------------------------------------------------------------------------------------------
TRACE_COLUMNS = ("time_s", "node", "position", "device", "signal", "scope", "code", "component", "repair_s",
                 "outage_s")


def read_trace(path: str | Path) -> list[Fault]:
    """A fault trace: CSV with `time_s` (since the start of the run) and `signal`, and optionally `node` (a node
    id) or `position` (index in the job's placement), `device`, `scope`, `code` (an XID), `component`,
    `repair_s`, `outage_s`, `slowdown` (a straggler's factor). `recovery.sim.titan` writes Titan's GPU failures in
    this form."""
    faults: list[Fault] = []
    with open(path, newline="") as fh:
        for line, raw in enumerate(csv.DictReader(fh), 2):
            try:
                faults.append(_trace_row(raw, len(faults)))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: not a trace row ({exc})") from exc
    return sorted(faults, key=lambda f: (f.at_ns, f.index))


def _trace_row(raw: dict[str, str], index: int) -> Fault:
    signal = raw["signal"].strip()
    if signal not in SIGNALS:
        raise ValueError(f"signal {signal!r} is not one of {SIGNALS}")
    default_scope = {"device": "device", "process": "rank", "network": "node", "node": "node", "hang": "job",
                     "straggler": "node"}
    scope = (raw.get("scope") or "").strip() or default_scope[signal]
    node = (raw.get("node") or "").strip() or None
    position = int(raw.get("position") or 0)
    return Fault(index=index, at_ns=int(float(raw["time_s"]) * NS), component=(raw.get("component") or signal),
                 signal=signal, scope=scope, position=position, device=int(raw.get("device") or 0),
                 code=(raw.get("code") or "").strip() or None, exit_code=1 if signal == "process" else None,
                 outage_ns=int(float(raw.get("outage_s") or 0) * NS),
                 repair_ns=int(float(raw.get("repair_s") or 4 * 3600) * NS), node=node,
                 slowdown=float(raw.get("slowdown") or 1.0))


def write_trace(path: str | Path, faults: Iterable[Fault]) -> int:
    count = 0
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(TRACE_COLUMNS)
        for f in faults:
            writer.writerow([f"{f.at_ns / NS:.3f}", f.node or "", f.position, f.device, f.signal, f.scope,
                             f.code or "", f.component, f"{f.repair_ns / NS:.0f}", f"{f.outage_ns / NS:.0f}"])
            count += 1
    return count


def reindex(faults: Iterable[Fault]) -> list[Fault]:
    return [replace(f, index=i) for i, f in enumerate(sorted(faults, key=lambda f: (f.at_ns, f.index)))]

"""Import the OLCF Titan GPU failure history as device faults on a simulated topology.

The data: Ostrouchov et al., "GPU Lifetimes on Titan Supercomputer: Survival Analysis and Reliability", SC20,
https://github.com/olcf/TitanGPULife, `data/gc_full.csv`: one row per GPU placement, with the columns `SN`
(serial), `location` (`c<col>-<row>c<cage>s<slot>n<node>`, e.g. `c11-2c1s4n1`), `insert` and `remove`
(`%Y-%m-%d %H:%M:%S`), `duration`, `out`, and `event`: `DBE` (a double-bit ECC error) or `OTB` (the GPU fell
off the bus) when the placement ended in a failure, empty otherwise. The failure time is `remove`.

Titan had 200 cabinets in 25 columns and 8 rows, 3 cages per cabinet, 8 slots per cage and 4 nodes per slot,
one GPU per node. Each Titan node is a GPU here: its index in cabinet-row-major order
`(((row * 25 + col) * 3 + cage) * 8 + slot) * 4 + node` (0 .. 19,199) packs `gpus_per_node` consecutive Titan
GPUs into one simulated node (index // gpus_per_node, device index % gpus_per_node), so a simulated cluster of
N GPUs replays the failures of Titan's first N GPU positions at Titan's own per-GPU rate. `fold=True` maps every
Titan GPU onto the simulated cluster instead (index modulo N GPUs), which multiplies the rate by 19,200 / N.

DBE becomes NVIDIA XID 48 (double-bit ECC error), OTB XID 79 (fallen off the bus).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from recovery.sim.faults import NS, Fault, reindex

LOCATION = re.compile(r"^c(\d+)-(\d+)c(\d+)s(\d+)n(\d+)$")
COLUMNS, ROWS, CAGES, SLOTS, NODES = 25, 8, 3, 8, 4
TITAN_GPUS = COLUMNS * ROWS * CAGES * SLOTS * NODES
XID = {"DBE": "48", "OTB": "79"}
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True, slots=True)
class TitanFailure:
    serial: str
    location: str
    gpu: int
    """index of the Titan GPU position, cabinet-row-major"""
    at: datetime
    event: str


def titan_index(location: str) -> int:
    """`c11-2c1s4n1` -> index of that GPU position (column 11, row 2, cage 1, slot 4, node 1)."""
    match = LOCATION.match(location.strip())
    if match is None:
        raise ValueError(f"{location!r} is not a Titan location like c11-2c1s4n1")
    col, row, cage, slot, node = (int(g) for g in match.groups())
    if not (col < COLUMNS and row < ROWS and cage < CAGES and slot < SLOTS and node < NODES):
        raise ValueError(f"{location!r} is outside Titan's {COLUMNS}x{ROWS} cabinets, {CAGES} cages, {SLOTS} "
                         f"slots, {NODES} nodes")
    return (((row * COLUMNS + col) * CAGES + cage) * SLOTS + slot) * NODES + node


def _time(text: str) -> datetime:
    return datetime.strptime(text.strip(), TIME_FORMAT).replace(tzinfo=UTC)


def read_failures(path: str | Path) -> tuple[list[TitanFailure], datetime | None]:
    """The failures (rows whose event is DBE or OTB) in time order, and the earliest insert time of the file."""
    failures: list[TitanFailure] = []
    first: datetime | None = None
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = [h.strip().lower() for h in next(reader)]
        col = {name: header.index(name) for name in ("sn", "location", "insert", "remove", "event")
               if name in header}
        if len(col) < 5:
            raise ValueError(f"{path}: expected the columns SN, location, insert, remove, event; got {header}")
        for line, row in enumerate(reader, 2):
            if not row or not any(cell.strip() for cell in row):
                continue
            try:
                inserted = row[col["insert"]].strip()
                if inserted:
                    at = _time(inserted)
                    first = at if first is None or at < first else first
                event = row[col["event"]].strip().upper()
                if event not in XID:
                    continue
                failures.append(TitanFailure(row[col["sn"]].strip(), row[col["location"]].strip(),
                                             titan_index(row[col["location"]]), _time(row[col["remove"]]), event))
            except (IndexError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from exc
    failures.sort(key=lambda f: (f.at, f.gpu))
    return failures, first


def import_titan(path: str | Path, *, gpus: int, gpus_per_node: int = 8, start: datetime | str | None = None,
                 days: float | None = None, fold: bool = False, repair_s: float = 2 * 3600.0) -> list[Fault]:
    """Titan's GPU failures as simulator faults on a cluster of `gpus` GPUs (`gpus_per_node` per node).

    `start`: the moment that becomes time 0 (default: the earliest insert time in the file); `days`: keep the
    failures of that many days from `start`. Failures on Titan positions beyond the simulated GPUs are dropped
    unless `fold`."""
    failures, first = read_failures(path)
    origin = _time(start) if isinstance(start, str) else start or first
    if origin is None:
        origin = failures[0].at if failures else datetime(1970, 1, 1, tzinfo=UTC)
    horizon = None if days is None else days * 86_400.0
    faults: list[Fault] = []
    for failure in failures:
        offset = (failure.at - origin).total_seconds()
        if offset < 0 or (horizon is not None and offset >= horizon):
            continue
        gpu = failure.gpu % gpus if fold else failure.gpu
        if gpu >= gpus:
            continue
        faults.append(Fault(index=len(faults), at_ns=int(offset * NS), component=f"Titan {failure.event}",
                            signal="device", scope="device", position=gpu // gpus_per_node,
                            device=gpu % gpus_per_node, code=XID[failure.event], repair_ns=int(repair_s * NS)))
    return reindex(faults)


def summarize(faults: Iterable[Fault]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault.component] = counts.get(fault.component, 0) + 1
    return dict(sorted(counts.items()))

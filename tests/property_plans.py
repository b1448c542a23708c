"""The plans the property tests of `tests/test_properties.py` play: jobs, spares and a list of operations, drawn up
front from plain integers by hypothesis or by a seeded `random.Random`. Every operation holds raw numbers that are
read modulo what exists when it runs, so any list is playable and hypothesis can shrink a failure freely."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st

from events.values import Granularity, Tier
from policies.codes import NVIDIA_XID

T = TypeVar("T")
Op = tuple[Any, ...]

XIDS: list[str] = [str(x) for x in sorted(NVIDIA_XID)] + ["9999"]  # plus one unknown XID
TIERS: list[Tier] = [tier for tier in Tier if tier is not Tier.PEER]  # peer is no saved tier (a bad input)
EXIT_CODES: list[int | None] = [0, 1, 2, 126, 127, 134, 137, 139, 143, -9, -15, None]
SIGNALS: list[int | None] = [None, None, 2, 6, 9, 11, 15]
ADVANCE_S: list[float] = [0.5, 3.0, 3.0, 11.0, 11.0, 25.0, 61.0, 130.0, 310.0, 1000.0]  # past watchdog, debounce,
# ack and attempt deadlines, with the long jumps rarer so that some incidents get to recover
GRANULARITIES: list[Granularity] = list(Granularity)
OP_WEIGHTS: dict[str, int] = {
    "train": 6, "checkpoint": 5, "xid": 2, "exit": 2, "started": 1, "hang": 1, "collective": 1, "link_down": 1,
    "link_up": 1, "node": 2, "duplicate": 2, "ack": 6, "ack_stale": 1, "recover": 3, "advance": 4, "operator": 2,
    "lifecycle": 1, "resubmit": 1,
}
OP_KINDS: list[str] = [kind for kind, weight in OP_WEIGHTS.items() for _ in range(weight)]


# -- plans ---------------------------------------------------------------------------------------------
class Picker(Protocol):
    """A source of choices: hypothesis draws or a seeded random generator."""

    def int(self, lo: int, hi: int) -> int: ...


class RandomPicker:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)


class DrawPicker:
    def __init__(self, draw: Callable[[st.SearchStrategy[int]], int]) -> None:
        self._draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))


def choose(pick: Picker, items: Sequence[T]) -> T:
    return items[pick.int(0, len(items) - 1)]


@dataclass(frozen=True)
class JobPlan:
    name: str
    dp: int
    tp: int
    pp: int
    ranks_per_node: int
    elastic: tuple[int, int] | None
    max_restarts: int | None

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def nodes(self) -> list[str]:
        return [f"{self.name}-n{i}" for i in range(self.world // self.ranks_per_node)]


@dataclass(frozen=True)
class Plan:
    jobs: list[JobPlan]
    spares: int
    ops: list[Op]


def build_job(pick: Picker, index: int) -> JobPlan:
    dp, tp, pp = pick.int(1, 4), pick.int(1, 2), pick.int(1, 2)
    world = dp * tp * pp
    # Whole nodes only; half the time a divisor of one replica's ranks, so that any dp fits whole nodes.
    fits = tp * pp if pick.int(0, 1) else world
    rpn = choose(pick, [d for d in range(1, fits + 1) if fits % d == 0])
    elastic = (pick.int(1, dp), pick.int(dp, 4)) if pick.int(0, 1) else None
    max_restarts = choose(pick, [None, None, None, None, 1, 4])
    return JobPlan(f"job{index}", dp, tp, pp, rpn, elastic, max_restarts)


def build_op(pick: Picker) -> Op:
    """One operation as raw numbers; `Driver.play` gives them meaning against the state of the moment."""
    kind = choose(pick, OP_KINDS)
    n = pick.int
    if kind == "train":
        return (kind, n(0, 9), n(1, 3), n(0, 3))  # job, steps, 0: all ranks report; else one rank is silent
    if kind == "checkpoint":
        return (kind, n(0, 9), n(0, 3), n(0, len(TIERS) - 1), n(0, 3), n(0, 99), n(0, 3))
    if kind == "xid":
        return (kind, n(0, 99), n(0, 8), n(0, len(XIDS) - 1))
    if kind == "exit":
        return (kind, n(0, 9), n(0, 99), n(0, len(EXIT_CODES) - 1), n(0, len(SIGNALS) - 1), n(0, 5))
    if kind in ("hang", "started"):
        return (kind, n(0, 9), n(0, 99), n(0, 5))
    if kind == "collective":
        return (kind, n(0, 9), n(1, 2**16 - 1), n(0, 2**16 - 1))
    if kind in ("link_down", "link_up"):
        return (kind, n(0, 99), n(0, 1))
    if kind == "node":
        return (kind, n(0, 99), choose(pick, ["not_ready", "ready", "drained", "joined", "joined_busy"]))
    if kind == "duplicate":
        return (kind, n(0, 10_000), n(0, 1))  # which earlier input; 0: same envelope, 1: same bytes (no Msg-Id)
    if kind == "ack":
        return (kind, n(0, 99), choose(pick, ["done", "done", "done", "failed", "accepted"]), n(0, 3))
    if kind == "ack_stale":
        return (kind, n(0, 10_000), choose(pick, ["done", "failed", "accepted"]))
    if kind == "recover":
        return (kind, n(1, 3))  # executors complete everything outstanding, then this many steps train
    if kind == "advance":
        return (kind, n(0, len(ADVANCE_S) - 1))
    if kind == "operator":
        what = ["pause", "resume", "resume", "scale", "scale", "force", "force", "cancel"]
        return (kind, n(0, 9), choose(pick, what), n(1, 4), n(0, len(GRANULARITIES) - 1))
    if kind == "resubmit":
        return (kind, n(0, 9))
    # lifecycle: the scheduler ends the job, rarely; mostly a started event that comes too late
    return (kind, n(0, 9), choose(pick, ["completed", "cancelled", "started", "started", "started"]))


def build_plan(pick: Picker, max_ops: int) -> Plan:
    jobs = [build_job(pick, i) for i in range(pick.int(1, 2))]
    spares = pick.int(0, 2)
    ops = [build_op(pick) for _ in range(pick.int(1, max_ops))]
    return Plan(jobs, spares, ops)


@st.composite
def plans(draw: st.DrawFn, max_ops: int = 80) -> Plan:
    return build_plan(DrawPicker(draw), max_ops)

"""What a detection policy's watchdog check is shown: each rank's activity, as values or as columns (re-exported by
`policies.base`, the contract's module)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankActivity:
    rank: int
    last_seen: int
    """log time of the rank's last heartbeat, step or start"""
    last_progress: int
    """log time at which the rank's step last advanced"""
    step: int
    compute_steps: int = 0
    """steps whose compute time the rank reported in the job's current generation (0: it reports none)"""
    compute_ns: int = 0
    """their compute time in all, ns: the time from each step's start to its first collective, measured in the
    rank; in synchronous data parallelism the wall step time is every rank's alike, this is where a slow one shows"""


class WatchdogView:
    """What the periodic watchdog check sees: the job's ranks' activity at log time `now`.

    Per rank it is held in columns (`last_seen`, `last_progress`, `steps`, `compute_steps`, `compute_ns`: rank r's
    value at index r), which the engine copies at C speed: a job of 131,072 ranks is checked every few seconds, and one
    object per rank made each check a tenth of a second of the control plane's time. A policy that reads rank by rank
    reads `ranks` (made from the columns on first use); one made of `RankActivity` values (`WatchdogView(now, step,
    ranks, ...)`, as tests do) has its columns made from them. Read-only: a policy never changes what it is shown."""

    __slots__ = ("_ranks", "agents_heard", "compute_ns", "compute_steps", "last_progress", "last_seen", "nodes", "now",
                 "ranks_per_node", "recovering", "sdk", "spoke", "step_time_ns", "steps", "unreachable")

    def __init__(self, now: int, step_time_ns: int | None, ranks: Sequence[RankActivity] = (),
                 nodes: tuple[str, ...] = (), ranks_per_node: int = 1, agents_heard: tuple[int | None, ...] = (),
                 sdk: bool = True, *, columns: RankColumns | None = None, recovering: bool = False,
                 unreachable: frozenset[int] = frozenset()) -> None:
        self.now = now
        self.step_time_ns = step_time_ns
        self.nodes = nodes
        """the job's placement: rank r runs on nodes[r // ranks_per_node] (empty: unknown)"""
        self.ranks_per_node = ranks_per_node
        self.agents_heard = agents_heard
        """per node of `nodes`, log time of its agent's last heartbeat (None: its agent sends none); empty: unknown"""
        self.unreachable = unreachable
        """indices in `nodes` of the nodes whose agent nothing listened for when the daemon asked (`node.unreachable`),
        since no sign of life: gone, to a policy that trusts NATS's word over its own silence bound"""
        self.sdk = sdk
        """the job's script reports through the SDK (some rank sent a heartbeat or a step): its ranks' silence and
        stalls mean something. False: a stock script, which sends neither; only its processes' exits and its agents'
        heartbeats tell of it, and no rank of it is ever silent for lacking heartbeats"""
        self.recovering = recovering
        """the job is recovering: its ranks are being stopped, saved or started, so their silence and stalls mean
        nothing; only an agent's silence does (a host lost during a recovery must still be found). The engine acts on
        node faults only while it is set"""
        if columns is None:
            ranks = tuple(ranks)
            columns = RankColumns(tuple(a.last_seen for a in ranks), tuple(a.last_progress for a in ranks),
                                  tuple(a.step for a in ranks), tuple(a.compute_steps for a in ranks),
                                  tuple(a.compute_ns for a in ranks))
            self._ranks: tuple[RankActivity, ...] | None = ranks
        else:
            self._ranks = None
        self.last_seen = columns.last_seen
        """per rank, log time of its last heartbeat, step or start"""
        self.last_progress = columns.last_progress
        """per rank, log time at which its step last advanced"""
        self.steps = columns.steps
        """per rank, its newest step"""
        self.compute_steps = columns.compute_steps
        """per rank, the steps whose compute time it reported in the job's current generation (0: none)"""
        self.compute_ns = columns.compute_ns
        """per rank, their compute time in all, ns (`RankActivity.compute_ns`)"""
        self.spoke = columns.spoke
        """per rank, 1 once its current process has spoken, 0 while it may still be importing (None: all have)"""

    @property
    def world(self) -> int:
        return len(self.last_seen)

    @property
    def ranks(self) -> tuple[RankActivity, ...]:
        """Each rank's activity as one value, in rank order (made once, on first use)."""
        if self._ranks is None:
            self._ranks = tuple(map(RankActivity, range(len(self.last_seen)), self.last_seen, self.last_progress,
                                    self.steps, self.compute_steps, self.compute_ns))
        return self._ranks

    def __repr__(self) -> str:
        return (f"WatchdogView(now={self.now}, step_time_ns={self.step_time_ns}, world={self.world}, "
                f"nodes={len(self.nodes)}, ranks_per_node={self.ranks_per_node}, sdk={self.sdk}, "
                f"recovering={self.recovering})")


@dataclass(frozen=True, slots=True)
class RankColumns:
    """A job's per-rank activity as columns, rank r at index r (`WatchdogView`)."""

    last_seen: tuple[int, ...]
    last_progress: tuple[int, ...]
    steps: tuple[int, ...]
    compute_steps: tuple[int, ...]
    compute_ns: tuple[int, ...]
    spoke: bytes | None = None
    """per rank, 1 once its current process sent a heartbeat or a step (None: every rank has)"""

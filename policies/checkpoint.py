"""Built-in checkpoint-source policy: the newest step whose every shard is reachable, cheapest tier first."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import compress
from typing import Any, ClassVar

from pydantic import Field

from events.values import TIER_COST, Flag, ResumePlan, Seconds, ShardSource, Tier
from policies.base import (
    NS,
    AwaitDying,
    CheckpointContext,
    CheckpointPlan,
    CheckpointPolicyBase,
    Params,
    Resume,
    SaveDying,
    SaveRequest,
)


class NewestCompleteParams(Params):
    dying: Flag = True
    """use the state of healthy data-parallel replicas when every shard still has one: a dying checkpoint, or
    (with `peer`) a transfer straight from them"""
    peer: Flag = True
    """rather than save a dying checkpoint and load it back, the restarted ranks receive their shard from a live
    replica over the fabric (TorchFT's live recovery, Gemini's peer memory): no save, a load at fabric speed"""
    peer_holders: int = Field(2, ge=1, le=8, strict=True)
    """live replicas named per shard: the executor takes the one on its own node, else the first that answers"""
    tiers: tuple[Tier, ...] = tuple(Tier)
    """tiers this job may resume from"""
    memory_first: Flag = True
    """resume from the newest step whose every shard is in a node's memory or on its disk before a newer one that
    needs storage for some shard: with sharded state (each rank its own shard), a node lost while its shards' copies
    were on their way to another node leaves the step before whole in memory, and storage is read only when no such
    step exists. A dying checkpoint wins only as the newest complete step: the job writes it once, at a fault, and
    never again, so once it has saved a newer checkpoint the dying one is just an older step, thousands behind"""
    shard_savers: Flag = True
    """sharded state with no replica, ranks stopped by SIGTERM writing their shards of a dying checkpoint on the way
    out: ask the live ranks at that step for the other shards meanwhile, so that the step is whole (not only the
    exiting ranks' shards) and the job resumes where it stopped, not at its last in-memory step"""
    dying_wait_s: Seconds = 30.0
    """after ranks were stopped by SIGTERM, hold the restart this long for the dying checkpoint their handlers write
    on the way out (0: never wait); torchrun and ModelArts give a process 30 s between SIGTERM and SIGKILL"""


class NewestCompleteCheckpoint(CheckpointPolicyBase):
    """Resume from the newest complete checkpoint, each rank from the cheapest tier that holds its shard.

    Before that, if every shard still has a live replica outside the restart whose step is newer than the
    newest complete checkpoint, the restarted ranks take their shard straight from such replicas (`peer`); if
    the incident tried that already, ask those replicas to save a dying checkpoint (MindIO TTP's power-off
    checkpoint, ModelArts' save on SIGTERM). Either way the job loses no step at all.
    """

    name: ClassVar[str] = "newest-complete"
    # 2: state from live peers before a dying checkpoint; 3: await a graceful exit's; 4: memory_first passes over a
    # dying checkpoint older than the newest complete step (it preferred one saved hours before to every newer
    # persistent checkpoint); 5: sharded state with no replica, some ranks stopped by SIGTERM: their shards of the
    # dying checkpoint come from them, the others' from live ranks asked meanwhile; 6: an `fsdp` layout (every rank its
    # own shard, whatever `dp`) and a resharded job's older steps, whole in the shards of the world that saved them
    version: ClassVar[str] = "6"

    parameters = NewestCompleteParams
    params: NewestCompleteParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        # Its own model, not `self.parameters`: a subclass may take other parameters and pass these on.
        self.params = NewestCompleteParams.model_validate(dict(params or {}))

    def plan(self, ctx: CheckpointContext) -> CheckpointPlan:
        resume = newest_complete(ctx, self.params.tiers, self.params.memory_first)
        newest = resume.checkpoint_step if resume.checkpoint_step is not None else -1
        if self.params.dying and self.params.peer and ctx.peer_allowed and Tier.PEER in self.params.tiers:
            peers = live_peers(ctx, self.params.peer_holders)
            if peers is not None and peers.checkpoint_step is not None and peers.checkpoint_step > newest:
                return Resume(peers, f"every shard has a live replica at step {peers.checkpoint_step} outside the "
                              f"restart: take it from them (newest complete: {newest})")
        if self.params.dying and ctx.dying_allowed:
            save = dying_savers(ctx)
            if save is not None and save.step > newest:
                return SaveDying(save, f"every shard has a live replica at step {save.step}: save a dying checkpoint "
                                 f"(newest complete: {newest})")
        reason = ("no complete checkpoint: start from step 0" if resume.checkpoint_step is None
                  else f"newest complete checkpoint is step {resume.checkpoint_step}")
        if self.params.dying and self.params.dying_wait_s > 0 and Tier.DYING in self.params.tiers:
            rest = exiting_and_live(ctx) if ctx.dying_allowed and self.params.shard_savers else None
            if rest is not None and rest.step > newest:
                return AwaitDying(rest.step, int(self.params.dying_wait_s * NS), resume,
                                  f"ranks stopped by SIGTERM at step {rest.step} are writing their shards of a dying "
                                  f"checkpoint; rank(s) {_ranks(rest.ranks)}, still running at that step, are asked "
                                  f"for the others: wait up to {self.params.dying_wait_s:g} s for it ({reason})", rest)
            coming = exiting_step(ctx)
            if coming is not None and coming > newest:
                return AwaitDying(coming, int(self.params.dying_wait_s * NS), resume,
                                  f"ranks stopped by SIGTERM at step {coming} are writing a dying checkpoint: wait up "
                                  f"to {self.params.dying_wait_s:g} s for it ({reason})")
        return Resume(resume, reason)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _replicas_at(ctx: CheckpointContext, usable: Sequence[bool]) -> tuple[int, Callable[[int], Iterator[int]]] | None:
    """The newest step every shard has a usable replica (`usable[rank]`) at or past, and a function giving a
    shard's such replicas, lowest rank first, lazily; None when some shard has no usable replica.

    A job of 131,072 ranks is one shard of 131,072 replicas: the steps are read through `compress` and slices, at C
    speed, and a caller that wants the first replica or the first few nodes reads no further."""
    shards = ctx.layout.shards
    steps = ctx.steps
    best = [max(compress(steps[shard::shards], usable[shard::shards]), default=-1) for shard in range(shards)]
    step = min(best)
    if step < 0:
        return None

    def replicas(shard: int) -> Iterator[int]:
        return (rank for rank in compress(range(shard, len(steps), shards), usable[shard::shards])
                if steps[rank] >= step)

    return step, replicas


def _usable(ctx: CheckpointContext, ranks: Sequence[bool], without: frozenset[int] = frozenset()) -> Sequence[bool]:
    """`ranks` less those in `without` and those on unreachable nodes (their memory and disks cannot be read)."""
    if not without and not ctx.unreachable:
        return ranks
    mask = list(ranks)
    for rank in without:
        mask[rank] = False
    if ctx.unreachable:
        unreachable = ctx.unreachable
        mask = [ok and node not in unreachable for ok, node in zip(mask, ctx.placement, strict=True)]
    return mask


def dying_savers(ctx: CheckpointContext) -> SaveRequest | None:
    """One live replica per shard, all at one common step (the newest such step), or None."""
    found = _replicas_at(ctx, _usable(ctx, ctx.alive))
    if found is None:
        return None
    step, replicas = found
    return SaveRequest(step, tuple(next(replicas(shard)) for shard in range(ctx.layout.shards)))


def exiting_step(ctx: CheckpointContext) -> int | None:
    """The newest step every shard has a replica at among the ranks stopped by SIGTERM: what their dying checkpoint
    will hold once each shard's writer has saved it (None when some shard has no such rank)."""
    if not ctx.exiting:
        return None
    exiting = [False] * len(ctx.steps)
    for rank in ctx.exiting:
        exiting[rank] = True
    found = _replicas_at(ctx, _usable(ctx, exiting))
    return None if found is None else found[0]


def exiting_and_live(ctx: CheckpointContext) -> SaveRequest | None:
    """Sharded state with no replica (each rank its own shard: `dp` 1, or `fsdp`), ranks stopped by SIGTERM: the
    step of the ranks whose end was seen and of the others on their nodes (stopped with them, writing their shards on
    the way out), and for every other shard a rank still running at that step on another reachable node, to ask for
    it. A SIGTERM reads as the whole job's preemption, which marks every rank gone, but the platform may have taken
    one node: the other nodes' ranks run on and write nothing unless asked. None when the writers hold every shard or
    some other shard has no such rank."""
    layout = ctx.layout
    if not ctx.exiting or layout.shards != layout.world or layout.shards < 2:
        return None
    taken = {ctx.placement[rank] for rank in sorted(ctx.exiting & ctx.ended)}
    writers = [rank for rank in sorted(ctx.exiting) if ctx.placement[rank] in taken]
    # The ranks of a sharded job move in lockstep: once one has completed step S every other has passed S's last
    # collective and completes S too, and none can go past S without the exited ranks. Their reports of it may not
    # be in yet (an agent sends its ranks' progress once a second): a step they last reported below S is stale.
    step = max((ctx.steps[rank] for rank in writers), default=-1)
    if step < 0:
        return None
    covered = {layout.shard_of(rank) for rank in writers}
    # running: alive, or stopped with the job but not seen to end (the await holds the restart: a rank it will
    # restart still holds its state meanwhile)
    running = _usable(ctx, [(ok or (rank in ctx.exiting and rank not in ctx.ended)) and node not in taken
                            for rank, (ok, node) in enumerate(zip(ctx.alive, ctx.placement, strict=True))])
    savers = [rank for rank in range(layout.world)
              if layout.shard_of(rank) not in covered and running[rank] and 0 <= ctx.steps[rank] <= step]
    if not savers or len(covered) + len({layout.shard_of(rank) for rank in savers}) < layout.shards:
        return None
    return SaveRequest(step, tuple(savers))


def live_peers(ctx: CheckpointContext, per_shard: int) -> ResumePlan | None:
    """The newest step every shard's live replicas outside the restart share, and up to `per_shard` of them
    (on distinct nodes, lowest rank first) per shard; None when some shard has no such replica."""
    found = _replicas_at(ctx, _usable(ctx, ctx.alive, ctx.restarting))
    if found is None:
        return None
    step, replicas = found
    sources = [ShardSource(shard=shard, tier=Tier.PEER,
                           holders=sorted(_first_nodes(ctx, replicas(shard), per_shard)))
               for shard in range(ctx.layout.shards)]
    return ResumePlan(checkpoint_step=step, next_step=step + 1, shards=sources)


def _first_nodes(ctx: CheckpointContext, ranks: Iterable[int], count: int) -> list[str]:
    """The nodes of `ranks`, in their order without repeats, the first `count` of them (read no further)."""
    nodes: dict[str, None] = {}
    for rank in ranks:
        nodes[ctx.placement[rank]] = None
        if len(nodes) >= count:
            break
    return list(nodes)


def newest_complete(ctx: CheckpointContext, tiers: tuple[Tier, ...], memory_first: bool = False) -> ResumePlan:
    """The newest step every shard has in one of `tiers` (each shard from its cheapest); with `memory_first`, when
    that step needs storage for some shard, the newest step every shard has in a node's memory or on its disk, if
    there is one. A dying checkpoint counts as the newest step only: it is written once, at a fault, and stays in
    the catalog while the job trains on and saves newer checkpoints, which supersede it."""
    newest = _newest_in(ctx, tiers)
    if memory_first and any(source.tier is Tier.STORAGE for source in newest.shards):
        found = _newest_in(ctx, tuple(t for t in tiers if t not in (Tier.STORAGE, Tier.DYING)))
        if found.checkpoint_step is not None:
            return found
    return newest


def _newest_in(ctx: CheckpointContext, tiers: tuple[Tier, ...]) -> ResumePlan:
    for step in sorted(ctx.catalog, reverse=True):
        by_tier = ctx.catalog[step]
        shards = ctx.shards_at(step)
        choice: list[tuple[Tier, tuple[str, ...]] | None] = [None] * shards
        for tier in sorted(by_tier, key=TIER_COST.__getitem__):
            if tier not in tiers:
                continue
            for shard, holders in by_tier[tier].items():
                if shard < shards and choice[shard] is None:
                    reachable = tuple(h for h in holders if h not in ctx.unreachable)
                    if reachable:
                        choice[shard] = (tier, reachable)
        if all(c is not None for c in choice):
            sources = [ShardSource(shard=shard, tier=c[0], holders=list(c[1]))  # type: ignore[index]
                       for shard, c in enumerate(choice)]
            return ResumePlan(checkpoint_step=step, next_step=step + 1, shards=sources)
    return ResumePlan(checkpoint_step=None, next_step=0, shards=[])

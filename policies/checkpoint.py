"""Built-in checkpoint-source policy: the newest step whose every shard is reachable, cheapest tier first."""

from __future__ import annotations

from typing import Any, ClassVar

from events.values import TIER_COST, ResumePlan, ShardSource, Tier
from policies.base import CheckpointContext, CheckpointPlan, Params, SaveRequest


class NewestCompleteParams(Params):
    dying: bool = True
    """ask healthy data-parallel replicas for a dying checkpoint when every shard still has one"""
    tiers: tuple[Tier, ...] = tuple(Tier)
    """tiers this job may resume from"""


class NewestCompleteCheckpoint:
    """Resume from the newest complete checkpoint, each rank from the cheapest tier that holds its shard.

    Before that, if the attempt allows it and every shard still has a live replica whose step is newer
    than the newest complete checkpoint, ask those replicas to save a dying checkpoint (MindIO TTP's
    power-off checkpoint, ModelArts' save on SIGTERM): the job then loses no step at all.
    """

    family: ClassVar[str] = "checkpoint"
    name: ClassVar[str] = "newest-complete"
    version: ClassVar[str] = "1"

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self.params = NewestCompleteParams.model_validate(params or {})

    def plan(self, ctx: CheckpointContext) -> CheckpointPlan:
        resume = newest_complete(ctx, self.params.tiers)
        if self.params.dying and ctx.dying_allowed:
            save = dying_savers(ctx)
            newest = resume.checkpoint_step if resume.checkpoint_step is not None else -1
            if save is not None and save.step > newest:
                return CheckpointPlan(resume, save, f"every shard has a live replica at step {save.step}: "
                                                    f"save a dying checkpoint (newest complete: {newest})")
        reason = ("no complete checkpoint: start from step 0" if resume.checkpoint_step is None
                  else f"newest complete checkpoint is step {resume.checkpoint_step}")
        return CheckpointPlan(resume, None, reason)


def dying_savers(ctx: CheckpointContext) -> SaveRequest | None:
    """One live replica per shard, all at one common step (the newest such step), or None."""
    shards = ctx.layout.shards
    best: list[int] = [-1] * shards
    for rank, (alive, step) in enumerate(zip(ctx.alive, ctx.steps, strict=True)):
        if alive and ctx.placement[rank] not in ctx.unreachable:
            shard = rank % shards
            best[shard] = max(best[shard], step)
    step = min(best)
    if step < 0:
        return None
    savers: list[int] = []
    for shard in range(shards):
        for rank in range(shard, len(ctx.alive), shards):  # the replicas of this shard, lowest rank first
            if ctx.alive[rank] and ctx.placement[rank] not in ctx.unreachable and ctx.steps[rank] >= step:
                savers.append(rank)
                break
    return SaveRequest(step, tuple(savers))


def newest_complete(ctx: CheckpointContext, tiers: tuple[Tier, ...]) -> ResumePlan:
    shards = ctx.layout.shards
    for step in sorted(ctx.catalog, reverse=True):
        by_tier = ctx.catalog[step]
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

"""Small value types shared by events, commands and policies."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from events.subjects import Token


class Frozen(BaseModel):
    """Base of every wire model: immutable, and unknown fields are an error rather than silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Tier(StrEnum):
    """Where a checkpoint shard lives. Declaration order is the cost order: cheapest to load first."""

    MEMORY = "memory"  # in host memory of a holder node (MindIO ACP, a healthy replica's state)
    PEER = "peer"  # a live data-parallel replica's state, sent over the fabric (TorchFT's live recovery)
    LOCAL = "local"  # on the holder node's local disk
    DYING = "dying"  # written at the fault from a healthy replica (MindIO TTP, ModelArts on SIGTERM)
    STORAGE = "storage"  # persistent shared storage


TIER_COST = {tier: cost for cost, tier in enumerate(Tier)}
STORAGE_HOLDER = "storage"
"""The holder name of a shard on shared storage: reachable whatever nodes are lost."""


class Granularity(StrEnum):
    """How much of a job a recovery attempt restarts, smallest first."""

    RETRY = "retry"  # re-run the failed step; no process restarts
    IN_PLACE = "in_place"  # restart the faulty processes on their own nodes
    MIGRATE = "migrate"  # move the faulty node's ranks to a spare node (pod level)
    RESTART_JOB = "restart_job"  # stop and restart every rank (job level)
    SCALE_IN = "scale_in"  # drop data-parallel replicas and continue smaller (elastic)
    SCALE_OUT = "scale_out"  # add data-parallel replicas when nodes return (elastic; never a ladder rung)
    DUMP = "dump"  # save what can be saved and stop: the job waits for an operator
    FAIL = "fail"  # give up


class FaultClass(StrEnum):
    DEVICE = "device"
    PROCESS = "process"
    NETWORK = "network"
    NODE = "node"
    HANG = "hang"
    PREEMPTION = "preemption"  # the platform asked the job to stop (SIGTERM, drain): not a failure of it


class Layout(Frozen):
    """Parallel layout. Rank order is tensor-parallel fastest, then pipeline, then data parallel."""

    dp: int = Field(ge=1, description="data-parallel replicas")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shards(self) -> int:
        """Distinct model-state shards: one per (pipeline, tensor) coordinate."""
        return self.tp * self.pp

    def shard_of(self, rank: int) -> int:
        return rank % (self.tp * self.pp)

    def replica_of(self, rank: int) -> int:
        return rank // (self.tp * self.pp)


class Elastic(Frozen):
    min_dp: int = Field(ge=1)
    max_dp: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_dp > self.max_dp:
            raise ValueError(f"elastic min_dp {self.min_dp} is above max_dp {self.max_dp}")
        return self


class PolicyRef(Frozen):
    """A policy chosen by its entry-point name, with its parameters (validated by the policy)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class PolicySelection(Frozen):
    detection: PolicyRef = PolicyRef(name="default")
    rescheduling: PolicyRef = PolicyRef(name="ladder")
    checkpoint: PolicyRef = PolicyRef(name="newest-complete")


class JobSpec(Frozen):
    nodes: list[Token] = Field(min_length=1, description="placement: rank r runs on nodes[r // ranks_per_node]")
    ranks_per_node: int = Field(ge=1)
    layout: Layout
    spares: int = Field(0, ge=0, description="spare nodes this job may take from the pool")
    elastic: Elastic | None = None
    policies: PolicySelection = PolicySelection()
    max_restarts: int | None = Field(None, ge=0, description="restart budget over the job's life, any rung")
    watchdog_interval_s: float = Field(2.0, gt=0, description="how often the engine checks heartbeats")

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        slots = len(self.nodes) * self.ranks_per_node
        if slots != self.layout.world:
            raise ValueError(
                f"layout dp*tp*pp = {self.layout.world} ranks but {len(self.nodes)} nodes x "
                f"{self.ranks_per_node} ranks per node = {slots}"
            )
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("a node appears twice in the placement")
        if self.elastic is not None and not self.elastic.min_dp <= self.layout.dp <= self.elastic.max_dp:
            raise ValueError(f"layout dp {self.layout.dp} is outside elastic [{self.elastic.min_dp}, "
                             f"{self.elastic.max_dp}]")
        return self


class RankSource(Frozen):
    rank: int
    tier: Tier
    holder: str


class ShardSource(Frozen):
    """Where one shard of the model state is read from: a tier and the holders that have it."""

    shard: int
    tier: Tier
    holders: list[str] = Field(min_length=1, description="reachable holders, sorted")


class ResumePlan(Frozen):
    """Where a restarted job resumes: the checkpoint step and, for every shard, where its state comes from.

    Kept per shard, not per rank, so that a plan for 16,384 ranks stays a few kilobytes: every data-parallel
    replica of a shard reads the same source, from the holder on its own node when there is one."""

    checkpoint_step: int | None = Field(description="None: no usable checkpoint, start from the beginning")
    next_step: int
    shards: list[ShardSource] = Field(default_factory=list)

    def source_of(self, rank: int, node: str) -> RankSource | None:
        """The source of `rank`, placed on `node` (rank r holds shard r mod the number of shards)."""
        if not self.shards:
            return None
        shard = self.shards[rank % len(self.shards)]
        holder = node if node in shard.holders else shard.holders[0]
        return RankSource(rank=rank, tier=shard.tier, holder=holder)

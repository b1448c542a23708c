"""An `fsdp` layout: data-parallel ranks that shard the model state among them (FSDP on a 1-D mesh, ZeRO-3), every
rank its own shard and no replica. A scale reshards the state, so the engine keeps, for every checkpoint, the shards
of the world that saved it: an old world's step stays whole in its old shards, and the smaller world's steps in its
own. The policy's plans, the engine's checks of a saved checkpoint and the wire format follow."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from events.values import JobSpec, Layout, Tier
from policies.base import AwaitDying, CheckpointContext, Resume
from policies.checkpoint import NewestCompleteCheckpoint
from recovery.testing.scenario import Scenario


def test_every_rank_of_an_fsdp_layout_holds_its_own_shard_and_a_scale_keeps_it_sharded() -> None:
    layout = Layout(dp=4, fsdp=True)
    assert (layout.shards, layout.per_replica, layout.world) == (4, 1, 4)
    assert [layout.shard_of(r) for r in range(4)] == [0, 1, 2, 3] and {layout.replica_of(r) for r in range(4)} == {0}
    assert layout.scaled(2) == Layout(dp=2, fsdp=True) and layout.scaled(2).shards == 2
    # TP inside FSDP: still one shard per rank
    assert Layout(dp=2, tp=2, fsdp=True).shards == 4
    # HSDP as before: `dp` replica groups of `tp` shards
    assert Layout(dp=2, tp=2).shards == 2 and Layout(dp=2, tp=2).scaled(1).shards == 2


def test_a_layout_without_fsdp_is_written_as_before_the_field_existed() -> None:
    assert Layout(dp=2, tp=2).model_dump() == {"dp": 2, "tp": 2, "pp": 1}
    assert Layout(dp=4, fsdp=True).model_dump() == {"dp": 4, "tp": 1, "pp": 1, "fsdp": True}
    assert Layout.model_validate({"dp": 4, "fsdp": True}).fsdp
    with pytest.raises(ValidationError):
        Layout.model_validate({"dp": 4, "fsdp": "sometimes"})


def test_an_elastic_fsdp_job_is_bounded_by_its_ranks_not_by_its_shards_squared() -> None:
    # max_dp x tp x pp ranks at most: the shards of an fsdp layout grow with dp, and counting them again would
    # refuse a job of 256 ranks as one of 65,536
    spec = JobSpec(nodes=[f"n{i}" for i in range(32)], ranks_per_node=8, layout=Layout(dp=256, fsdp=True),
                   elastic={"min_dp": 128, "max_dp": 256})
    assert spec.layout.shards == 256


def fsdp_ctx(catalog: dict, shard_counts: tuple[tuple[int, int], ...], dp: int = 2) -> CheckpointContext:
    return CheckpointContext(layout=Layout(dp=dp, fsdp=True), catalog=catalog, placement=("a", "a", "b", "b")[:dp],
                             unreachable=frozenset(), alive=(False,) * dp, steps=(14,) * dp, dying_allowed=False,
                             restarting=frozenset(range(dp)), shard_counts=shard_counts)


def test_a_resharded_jobs_steps_are_whole_in_the_shards_of_the_world_that_saved_them() -> None:
    policy = NewestCompleteCheckpoint()
    counts = ((0, 4), (9, 2))  # four ranks trained steps 0-8; two from step 9 on
    both = {12: {Tier.MEMORY: {0: ("a",), 1: ("a",)}}, 8: {Tier.MEMORY: {s: ("a",) for s in range(4)}}}
    plan = policy.plan(fsdp_ctx(both, counts))
    assert isinstance(plan, Resume) and plan.plan.checkpoint_step == 12 and len(plan.plan.shards) == 2
    # the smaller world's newest step lacks a shard: back to the old world's step, in its four shards (resharded by
    # the SDK on load), not "whole" in the first two of them
    half = {12: {Tier.MEMORY: {0: ("a",)}}, 8: {Tier.MEMORY: {s: ("a",) for s in range(4)}},
            6: {Tier.MEMORY: {0: ("a",), 1: ("a",)}}}
    older = policy.plan(fsdp_ctx(half, counts))
    assert isinstance(older, Resume) and older.plan.checkpoint_step == 8
    assert [s.shard for s in older.plan.shards] == [0, 1, 2, 3]
    # without the counts the old world's half step 6 would pass for a whole one of two shards
    naive = policy.plan(fsdp_ctx({6: {Tier.MEMORY: {0: ("a",), 1: ("a",)}}}, ()))
    counted = policy.plan(fsdp_ctx({6: {Tier.MEMORY: {0: ("a",), 1: ("a",)}}}, counts))
    assert isinstance(naive, Resume) and naive.plan.checkpoint_step == 6
    assert isinstance(counted, Resume) and counted.plan.checkpoint_step is None


def test_an_fsdp_jobs_preempted_node_asks_the_running_ranks_for_the_other_shards_as_a_1d_tp_layout_did() -> None:
    catalog = {5: {Tier.MEMORY: {0: ("a",), 1: ("a",), 2: ("b",), 3: ("b",)}}}
    ctx = CheckpointContext(layout=Layout(dp=4, fsdp=True), catalog=catalog, placement=("a", "a", "b", "b"),
                            unreachable=frozenset(), alive=(True, True, False, False), steps=(9,) * 4,
                            dying_allowed=True, exiting=frozenset({2, 3}), ended=frozenset({2, 3}),
                            restarting=frozenset(range(4)))
    plan = NewestCompleteCheckpoint().plan(ctx)
    assert isinstance(plan, AwaitDying) and plan.save is not None and plan.save.ranks == (0, 1) and plan.step == 9


def scaled_in(half_step: bool = False) -> Scenario:
    """An elastic fsdp job of four ranks on f0 and f1 that lost f1 with no spare: two ranks on f0 from step 9. With
    `half_step`, f0 got only its own shards of step 10 before the loss."""
    s = Scenario()
    s.submit("shard", ["f0", "f1"], ranks_per_node=2, dp=4, fsdp=True, elastic={"min_dp": 2, "max_dp": 4},
             spare_pool="shard")
    s.train("shard", 8)
    s.checkpoint("shard", 8, "memory", "f0", shards=[0, 1, 2, 3])
    s.train("shard", 2)
    if half_step:
        s.checkpoint("shard", 10, "memory", "f0", shards=[0, 1])
    s.node_event("f1", "node.not_ready", reason="host down")
    s.idle("shard", 25, ranks=range(2))
    s.ack_all()
    s.advance(2)
    s.train("shard", 4)
    return s


def test_after_a_scale_in_a_shard_past_the_new_world_is_refused_but_an_old_steps_late_copy_is_kept() -> None:
    s = scaled_in()
    job = s.engine.jobs["shard"]
    assert job.layout == Layout(dp=2, fsdp=True) and job.shard_counts == ((0, 4), (9, 2))
    assert job.snapshot()["shard_counts"] == [[0, 4], [9, 2]]  # what replay and recovery-ctl show
    s.checkpoint("shard", 6, "memory", "f0", shards=[3])  # a buddy copy of the old world, late
    assert 3 in job.catalog[6][Tier.MEMORY] and not s.rejections
    s.checkpoint("shard", 12, "memory", "f0", shards=[2])
    [rejected] = s.rejections
    assert rejected.code == "schema_violation" and "step 12 is in 2" in rejected.reason
    s.checkpoint("shard", 12, "memory", "f0", shards=[0, 1])
    assert job.complete_at(12) and not job.complete_at(6)
    assert job.shards_at(8) == 4 and job.shards_at(9) == 2


def test_a_scale_in_drops_the_old_worlds_checkpoints_of_steps_the_new_world_trains_again() -> None:
    s = scaled_in(half_step=True)
    job = s.engine.jobs["shard"]
    [scale] = [c for d in s.decisions for c in d.commands if c.kind == "scale_job"]
    assert scale.plan.checkpoint_step == 8 and scale.kept == [0, 1]
    # step 10's half of the old world would read as a whole step of two shards
    assert 10 not in job.catalog and 8 in job.catalog
    assert not job.complete_at(10)

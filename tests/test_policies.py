"""The policy contract and the built-ins, loaded through entry points like any plugin."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.values import FaultClass, Granularity, Layout, PolicyRef, PolicySelection, Tier
from policies import registry
from policies.base import (
    FAMILY_BASES,
    NS,
    AttemptSummary,
    AwaitDying,
    CheckpointContext,
    Drain,
    Fail,
    RankActivity,
    RankColumns,
    RescheduleContext,
    ReschedulingPolicyBase,
    Resume,
    SaveDying,
    Wait,
    WatchdogView,
)
from policies.checkpoint import NewestCompleteCheckpoint
from policies.detection import DefaultDetection
from policies.rescheduling import LadderRescheduling
from recovery.testing.scenario import Scenario


def test_builtins_come_from_the_entry_point_group() -> None:
    found = registry.available()
    assert {"default", "ladder", "newest-complete"} <= set(found)
    labels = registry.load_set(PolicySelection()).labels
    assert labels == {"detection": "default@11", "rescheduling": "ladder@8", "checkpoint": "newest-complete@6"}


def test_unknown_policy_and_bad_parameters_are_clear_errors() -> None:
    with pytest.raises(registry.PolicyError, match="no detection policy named 'nope'"):
        registry.load(PolicyRef(name="nope"), "detection")
    with pytest.raises(registry.PolicyError, match="invalid parameters"):
        registry.load(PolicyRef(name="ladder", params={"ladderz": {}}), "rescheduling")
    with pytest.raises(registry.PolicyError, match="not detection"):
        registry.load(PolicyRef(name="ladder"), "detection")


def ctx(**kw: object) -> RescheduleContext:
    base: dict[str, object] = dict(fault_class=FaultClass.PROCESS, scope="rank", needs_move=False, any_lost=True,
                                   previous=(), used={}, restarts_used=0, max_restarts=None, nodes_to_replace=0,
                                   nodes_to_migrate=1, spares_available=1, dp=4, scale_in_dp=None)
    base.update(kw)
    return RescheduleContext(**base)  # type: ignore[arg-type]


def test_a_rung_with_two_tries_is_tried_again_before_the_next_one() -> None:
    ladder = LadderRescheduling()  # the shipped device ladder: in_place, migrate (2 tries), restart_job
    G = Granularity
    moved = AttemptSummary(G.MIGRATE, "failed", 1)
    device = {"fault_class": FaultClass.DEVICE, "needs_move": True, "nodes_to_replace": 1}
    assert ladder.decide(ctx(**device)).granularity is G.MIGRATE
    assert ladder.decide(ctx(previous=(moved,), **device)).granularity is G.MIGRATE
    assert ladder.decide(ctx(previous=(moved, moved), **device)).granularity is G.RESTART_JOB
    # a superseded attempt in between starts the count again
    widened = (moved, AttemptSummary(G.MIGRATE, "superseded", 1), moved)
    assert ladder.decide(ctx(previous=widened, **device)).granularity is G.MIGRATE


def test_ladder_escalates_one_rung_per_failed_attempt() -> None:
    ladder = LadderRescheduling({"ladders": {"process": [
        {"granularity": "in_place", "budget": 3, "deadline_s": 60},
        {"granularity": "restart_job", "budget": 1, "deadline_s": 600}]}})
    first = ladder.decide(ctx())
    assert (first.granularity, first.deadline_ns) == (Granularity.IN_PLACE, 60 * NS)
    second = ladder.decide(ctx(previous=(AttemptSummary(Granularity.IN_PLACE, "failed", 0),)))
    assert second.granularity is Granularity.RESTART_JOB
    both = (AttemptSummary(Granularity.IN_PLACE, "failed", 0), AttemptSummary(Granularity.RESTART_JOB, "timed_out", 1))
    spent = {"process/in_place": 1, "process/restart_job": 1}
    third = ladder.decide(ctx(previous=both, used=spent))
    assert isinstance(third, Fail) and "process/restart_job 1 of 1" in third.reason


def test_top_rung_is_tried_again_while_its_budget_lasts() -> None:
    ladder = LadderRescheduling({"ladders": {"process": [{"granularity": "restart_job", "budget": 2}]}})
    failed = (AttemptSummary(Granularity.RESTART_JOB, "failed", 0),)
    again = ladder.decide(ctx(previous=failed, used={"process/restart_job": 1}))
    assert again.granularity is Granularity.RESTART_JOB
    done = ladder.decide(ctx(previous=failed * 2, used={"process/restart_job": 2}))
    assert isinstance(done, Fail)


def test_ladder_budget_per_rung_is_named_when_exhausted() -> None:
    ladder = LadderRescheduling({"ladders": {"process": [{"granularity": "in_place", "budget": 2}]}})
    action = ladder.decide(ctx(used={"process/in_place": 2}))
    assert isinstance(action, Fail) and "process/in_place 2 of 2" in action.reason


def test_ladder_scales_in_or_waits_when_nodes_are_short() -> None:
    ladder = LadderRescheduling()
    short = dict(fault_class=FaultClass.NODE, needs_move=True, nodes_to_replace=1, nodes_to_migrate=1,
                 spares_available=0)
    assert ladder.decide(ctx(**short, scale_in_dp=3)).granularity is Granularity.SCALE_IN
    assert isinstance(ladder.decide(ctx(**short)), Wait)


def test_retry_only_when_every_process_lives() -> None:
    ladder = LadderRescheduling()
    assert ladder.decide(ctx(fault_class=FaultClass.NETWORK, any_lost=False)).granularity is Granularity.RETRY
    assert ladder.decide(ctx(fault_class=FaultClass.NETWORK, any_lost=True)).granularity is Granularity.IN_PLACE


def cctx(alive: tuple[bool, ...], catalog: dict, unreachable: frozenset[str] = frozenset()) -> CheckpointContext:
    layout = Layout(dp=2, tp=2)
    return CheckpointContext(layout=layout, catalog=catalog, placement=("a", "a", "b", "b"), unreachable=unreachable,
                             alive=alive, steps=(9, 9, 9, 9), dying_allowed=True)


def test_dying_checkpoint_when_every_shard_has_a_live_replica() -> None:
    plan = NewestCompleteCheckpoint().plan(cctx((True, False, True, True), {5: {Tier.STORAGE: {0: ("storage",),
                                                                                             1: ("storage",)}}}))
    assert isinstance(plan, SaveDying) and plan.save.step == 9 and plan.save.ranks == (0, 3)


def test_no_dying_checkpoint_without_a_replica_of_every_shard() -> None:
    plan = NewestCompleteCheckpoint().plan(cctx((True, False, True, False), {5: {Tier.STORAGE: {0: ("storage",),
                                                                                              1: ("storage",)}}}))
    assert isinstance(plan, Resume) and plan.plan.checkpoint_step == 5


def fsdp_ctx(alive: tuple[bool, ...], steps: tuple[int, ...], exiting: frozenset[int],
             ended: frozenset[int] = frozenset({2, 3}), dying_allowed: bool = True) -> CheckpointContext:
    """FSDP with no replica: four ranks, four shards, two nodes; memory holds step 5 whole; a job-level restart."""
    catalog = {5: {Tier.MEMORY: {0: ("a",), 1: ("a",), 2: ("b",), 3: ("b",)}}}
    return CheckpointContext(layout=Layout(dp=1, tp=4), catalog=catalog, placement=("a", "a", "b", "b"),
                             unreachable=frozenset(), alive=alive, steps=steps, dying_allowed=dying_allowed,
                             exiting=exiting, ended=ended, restarting=frozenset(range(4)))


def test_sharded_state_preempted_node_writes_its_shards_and_the_live_ranks_are_asked_for_the_rest() -> None:
    """Node b preempted at step 9: its ranks write shards 2 and 3 on the way out, ranks 0 and 1 are asked for
    theirs, and the restart waits for step 9 whole rather than going back to step 5 in memory."""
    plan = NewestCompleteCheckpoint().plan(fsdp_ctx((True, True, False, False), (9, 9, 9, 9), frozenset({2, 3})))
    assert isinstance(plan, AwaitDying) and plan.step == 9, plan
    assert plan.save is not None and plan.save.ranks == (0, 1) and plan.save.step == 9
    assert plan.fallback.checkpoint_step == 5  # should step 9 never be whole
    # as the engine sees it: a SIGTERM reads as the whole job's preemption, every rank "exiting" and none alive;
    # the ranks whose end was seen are b's
    whole_job = NewestCompleteCheckpoint().plan(fsdp_ctx((False,) * 4, (9, 9, 9, 9), frozenset(range(4))))
    assert isinstance(whole_job, AwaitDying) and whole_job.save == plan.save
    # the whole job really stopped, every end seen: the exits write every shard, nobody is asked
    every = NewestCompleteCheckpoint().plan(fsdp_ctx((False,) * 4, (9, 9, 9, 9), frozenset(range(4)),
                                                     ended=frozenset(range(4))))
    assert isinstance(every, AwaitDying) and every.step == 9 and every.save is None
    # with a live replica of every shard (data parallelism), it saves the whole step, as before
    replicated = CheckpointContext(layout=Layout(dp=4, tp=1), catalog={}, placement=("a", "a", "b", "b"),
                                   unreachable=frozenset(), alive=(True, True, False, False), steps=(9, 9, 9, 9),
                                   dying_allowed=True, exiting=frozenset({2, 3}), ended=frozenset({2, 3}))
    classic = NewestCompleteCheckpoint().plan(replicated)
    assert isinstance(classic, SaveDying) and classic.save.ranks == (0,)


def test_sharded_state_no_dying_wait_when_a_shard_has_no_writer_at_the_step() -> None:
    policy = NewestCompleteCheckpoint()
    # lockstep: a rank whose last report is behind the exited ranks' step has not reported it yet, and is asked
    late = policy.plan(fsdp_ctx((True, True, False, False), (6, 8, 9, 9), frozenset({2, 3})))
    assert isinstance(late, AwaitDying) and late.save is not None and late.save.ranks == (0, 1) and late.step == 9
    # ... and a rank that reported no step at all, or one past the exited (which no lockstep job has), is not
    behind = policy.plan(fsdp_ctx((True, True, False, False), (-1, 9, 9, 9), frozenset({2, 3})))
    ahead = policy.plan(fsdp_ctx((True, True, False, False), (10, 9, 9, 9), frozenset({2, 3})))
    crashed = policy.plan(fsdp_ctx((True, False, False, False), (9, 9, 9, 9), frozenset({2, 3}),
                                   ended=frozenset({1, 2, 3})))  # rank 1 died too
    cannot_ask = policy.plan(fsdp_ctx((True, True, False, False), (9, 9, 9, 9), frozenset({2, 3}),
                                      dying_allowed=False))
    for plan in (behind, ahead, crashed, cannot_ask):
        assert isinstance(plan, Resume) and plan.plan.checkpoint_step == 5, plan
    off = NewestCompleteCheckpoint({"dying_wait_s": 0}).plan(
        fsdp_ctx((True, True, False, False), (9, 9, 9, 9), frozenset({2, 3})))
    assert isinstance(off, Resume) and off.plan.checkpoint_step == 5


def test_cheapest_reachable_tier_and_older_step_when_newest_is_incomplete() -> None:
    catalog = {8: {Tier.MEMORY: {0: ("b",)}},  # shard 1 missing at step 8
               6: {Tier.MEMORY: {0: ("a",), 1: ("b",)}, Tier.STORAGE: {0: ("storage",), 1: ("storage",)}}}
    policy = NewestCompleteCheckpoint({"dying": False})
    plan = policy.plan(cctx((True,) * 4, catalog))
    assert isinstance(plan, Resume)
    assert plan.plan.checkpoint_step == 6 and {s.tier for s in plan.plan.shards} == {Tier.MEMORY}
    lost_b = policy.plan(cctx((True,) * 4, catalog, unreachable=frozenset({"b"})))
    assert isinstance(lost_b, Resume)
    assert [(s.shard, s.tier) for s in lost_b.plan.shards] == [(0, Tier.MEMORY), (1, Tier.STORAGE)]
    sources = [lost_b.plan.source_of(rank, node) for rank, node in enumerate(("a", "a", "b", "b"))]
    assert [(s.tier, s.holder) for s in sources if s] == [(Tier.MEMORY, "a"), (Tier.STORAGE, "storage"),
                                                         (Tier.MEMORY, "a"), (Tier.STORAGE, "storage")]


def test_a_step_whole_in_memory_wins_over_a_newer_one_that_needs_storage_for_a_lost_nodes_shard() -> None:
    """FSDP without a replica: node b was lost while its shard of step 12 was on its way to a's memory, but its agent
    had persisted it; step 8 is whole in a's memory. Storage is read only when memory holds no whole step."""
    catalog = {12: {Tier.MEMORY: {0: ("a",)}, Tier.STORAGE: {1: ("storage",)}},
               8: {Tier.MEMORY: {0: ("a",), 1: ("a", "b")}}}
    lost_b = cctx((True, True, False, False), catalog, unreachable=frozenset({"b"}))
    plan = NewestCompleteCheckpoint({"dying": False}).plan(lost_b)
    assert isinstance(plan, Resume) and plan.plan.checkpoint_step == 8
    assert {s.tier for s in plan.plan.shards} == {Tier.MEMORY} and plan.plan.shards[1].holders == ["a"]
    newest = NewestCompleteCheckpoint({"dying": False, "memory_first": False}).plan(lost_b)
    assert isinstance(newest, Resume) and newest.plan.checkpoint_step == 12
    # no step whole in memory: storage it is
    del catalog[8]
    plan = NewestCompleteCheckpoint({"dying": False}).plan(cctx((True, True, False, False), catalog,
                                                                unreachable=frozenset({"b"})))
    assert isinstance(plan, Resume) and plan.plan.checkpoint_step == 12


def test_memory_first_takes_a_dying_checkpoint_only_while_it_is_the_newest_step() -> None:
    """A dying checkpoint holds the step a fault reached: newest, it beats an older step in memory; once the job has
    saved a newer checkpoint it is superseded, and memory first looks only in the nodes' memory and disks."""
    whole = {0: ("storage",), 1: ("storage",)}
    memory = {0: ("a",), 1: ("b",)}
    dead = (False,) * 4

    def step_of(catalog: dict) -> int | None:
        plan = NewestCompleteCheckpoint().plan(cctx(dead, catalog))
        assert isinstance(plan, Resume)
        return plan.plan.checkpoint_step

    assert step_of({20: {Tier.DYING: whole}, 15: {Tier.MEMORY: memory}, 10: {Tier.STORAGE: whole}}) == 20
    assert step_of({2800: {Tier.STORAGE: whole}, 20: {Tier.DYING: whole}}) == 2800
    assert step_of({2800: {Tier.STORAGE: whole}, 25: {Tier.MEMORY: memory}, 20: {Tier.DYING: memory}}) == 25


class NoDecide:
    family = "rescheduling"
    name = "no-decide"
    version = "1"

    def __init__(self, params: object = None) -> None:
        pass


def test_a_broken_plugin_is_named_and_breaks_no_other_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plugins load one at a time: one whose import fails, or whose class lacks its family's method, is reported by
    its entry point when a job selects it, and jobs that do not select it are not touched."""
    real = list(entry_points(group=registry.GROUP))
    fakes = [EntryPoint("ghost-ladder", "recovery_no_such_plugin:Ladder", registry.GROUP),
             EntryPoint("no-decide", f"{__name__}:NoDecide", registry.GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real, *fakes])
    registry._scan.cache_clear()
    registry._instance.cache_clear()
    try:
        assert "ghost-ladder" in registry.broken() and "ModuleNotFoundError" in registry.broken()["ghost-ladder"]
        assert registry.load_set(PolicySelection()).labels["rescheduling"].startswith("ladder@")
        with pytest.raises(registry.PolicyError, match=r"ghost-ladder.*recovery_no_such_plugin:Ladder.*failed to load"):
            registry.load(PolicyRef(name="ghost-ladder"), "rescheduling")
        with pytest.raises(registry.PolicyError, match="lacks decide"):
            registry.load(PolicyRef(name="no-decide"), "rescheduling")
        s = Scenario()
        s.submit("fine", ["f0"], ranks_per_node=1, dp=1)
        effects = s.submit("ghostly", ["g0"], ranks_per_node=1, dp=1, start=False,
                           policies={"rescheduling": {"name": "ghost-ladder"}})
        assert [e.code for e in effects] == ["invalid_policy"]  # type: ignore[union-attr]
        assert "recovery_no_such_plugin" in effects[0].reason  # type: ignore[union-attr]
        assert s.state("fine") == "running"
    finally:
        registry._scan.cache_clear()
        registry._instance.cache_clear()


def test_a_method_left_abstract_is_named_when_a_job_selects_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    class Undecided(ReschedulingPolicyBase):
        name = "undecided"
        version = "1"

    monkeypatch.setattr(registry, "available", lambda: {"undecided": Undecided})
    registry._instance.cache_clear()
    try:
        with pytest.raises(registry.PolicyError, match="lacks decide"):
            registry.load(registry.PolicyRef(name="undecided"), "rescheduling")
    finally:
        registry._instance.cache_clear()


def test_every_built_in_subclasses_its_familys_base() -> None:
    built_in = {name: cls for name, cls in registry.available().items() if cls.__module__.startswith("policies.")}
    assert len(built_in) == 9
    for name, cls in built_in.items():
        assert issubclass(cls, FAMILY_BASES[cls.family]), name


def _computing(per_rank_s: list[float], steps: int = 20) -> WatchdogView:
    """Four nodes of two ranks, all stepping together, each rank with its mean compute time over `steps` steps."""
    now = 100 * NS
    ranks = tuple(RankActivity(r, now, now, 50, steps, round(t * NS) * steps) for r, t in enumerate(per_rank_s))
    return WatchdogView(now, NS, ranks, ("n0", "n1", "n2", "n3"), 2)


def test_a_rank_computing_past_the_ratio_of_its_peers_median_drains_its_node() -> None:
    [drain] = DefaultDetection().check(_computing([0.2, 0.21, 0.2, 0.19, 0.2, 0.45, 0.2, 0.2]))
    assert isinstance(drain, Drain) and drain.node == "n2" and drain.code == "straggler"
    assert dict(drain.evidence) == {"rank": 5, "compute_s": 0.45, "peers_median_s": 0.2, "steps": 20}


def test_no_straggler_below_the_ratio_the_excess_or_the_window() -> None:
    policy = DefaultDetection()
    assert policy.check(_computing([0.2] * 7 + [0.29])) == []  # under 1.5x
    assert policy.check(_computing([0.01] * 7 + [0.04])) == []  # 4x, but 30 ms: noise of a tiny step
    assert policy.check(_computing([0.2] * 7 + [0.5], steps=19)) == []  # not yet the window's 20 steps
    tuned = DefaultDetection({"straggler_window_steps": 10, "straggler_ratio": 1.2, "straggler_min_excess_s": 0})
    assert [d.node for d in tuned.check(_computing([0.2] * 7 + [0.25], steps=10))] == ["n3"]


def _rank_by_rank(policy: DefaultDetection, view: WatchdogView) -> list[object]:
    """The watchdog rule as it reads one rank at a time (as it was written before the columns): the columnar check
    must answer the same, verdict for verdict."""
    p = policy.params
    step_time = view.step_time_ns or 0
    silence = max(int(p.hang_min_silence_s * NS), int(p.hang_silence_factor * step_time))
    stall = (max(int(p.stall_min_s * NS), int(p.stall_factor * step_time)) if view.step_time_ns
             else int(p.first_steps_s * NS))
    ranks = view.ranks
    if any(view.now - a.last_seen > silence for a in ranks):
        return policy.check(view)  # silence takes the same path in both (not what the columns changed)
    newest = max((a.last_progress for a in ranks), default=view.now)
    if view.now - newest > stall:
        return [("job", tuple(a.rank for a in ranks))]
    top = max((a.step for a in ranks), default=0)
    behind = tuple(a.rank for a in ranks if a.step < top and view.now - a.last_progress > stall)
    if behind:
        return [("rank", behind)]
    measured = sorted((a.compute_ns // a.compute_steps, a.rank, a.compute_steps) for a in ranks
                      if a.compute_steps >= p.straggler_window_steps)
    if len(measured) < 2:
        return []
    drains: dict[str, tuple[int, int]] = {}
    for position in reversed(range(len(measured))):
        mean, rank, _ = measured[position]
        others = [m for k, (m, _, _) in enumerate(measured) if k != position]
        half = len(others) // 2
        median = others[half] if len(others) % 2 else (others[half - 1] + others[half]) // 2
        if mean < p.straggler_ratio * median:
            break
        if mean - median < p.straggler_min_excess_s * NS:
            continue
        drains.setdefault(view.nodes[rank // view.ranks_per_node], (rank, mean))
    return [("drain", node, *drains[node]) for node in sorted(drains, key=view.nodes.index)]


def _as_compared(verdicts: list[object]) -> list[object]:
    out: list[object] = []
    for v in verdicts:
        if isinstance(v, Drain):
            evidence = dict(v.evidence)
            out.append(("drain", v.node, evidence["rank"], round(evidence["compute_s"] * NS)))
        elif hasattr(v, "scope") and v.scope in ("job", "rank") and "silent" not in v.reason:
            out.append((v.scope, v.ranks))
        else:
            out.append(v)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 25),
                          st.sampled_from((100, 100, 100, 120, 150, 160, 180, 240)) | st.integers(1, 900)),
                min_size=8, max_size=8).map(tuple),
       st.integers(90, 100))
def test_the_columnar_watchdog_answers_as_the_rank_by_rank_rule(
        activity: tuple[tuple[int, int, int, int], ...], now_s: int) -> None:
    """Stalls, ranks behind, and stragglers (ties, the ratio's edge, one node's two slow ranks) as each rank read
    alone would find them; the straggler's means are whole milliseconds, most at a ratio of 1.2 or 1.5 to 100 ms, so
    that ties and the ratio's edge happen."""
    now = now_s * NS
    ranks = tuple(RankActivity(r, now, now - lag * NS, 50 - behind, steps, ms * 1_000_000 * steps)
                  for r, (behind, lag, steps, ms) in enumerate(activity))
    view = WatchdogView(now, NS, ranks, ("n0", "n1", "n2", "n3"), 2)
    for policy in (DefaultDetection(), DefaultDetection({"straggler_window_steps": 10, "straggler_ratio": 1.2,
                                                         "straggler_min_excess_s": 0})):
        expected = _rank_by_rank(policy, view)
        assert _as_compared(policy.check(view)) == expected
        # the same view given as columns (as the engine gives it) answers the same
        columns = WatchdogView(now, NS, (), view.nodes, 2, columns=RankColumns(
            view.last_seen, view.last_progress, view.steps, view.compute_steps, view.compute_ns))
        assert _as_compared(policy.check(columns)) == expected

"""Golden logs: one per behaviour of the seed systems, committed, replay-verified and asserted on."""

from __future__ import annotations

import io

import pytest

from events.commands import MigrateRanks, RestartJob, RestartRanks, SaveCheckpoint, ScaleJob, StopRanks
from events.outputs import Decision
from events.values import Tier
from recovery.log import iter_file
from recovery.log.recorder import Replay, replay
from recovery.log.verify import first_divergence
from tests.golden.scenarios import SCENARIOS, path


def load(name: str) -> Replay:
    return replay(iter_file(path(name)))


def kinds(result: Replay, kind: str) -> list[Decision]:
    return [d for d in result.decisions if d.kind == kind]


def commands(result: Replay, kind: str) -> list:
    return [c for d in result.decisions for c in d.commands if c.kind == kind]


def closed(result: Replay) -> Decision:
    [decision] = kinds(result, "incident.closed")
    return decision


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_log_replays_to_its_recorded_decisions(name: str) -> None:
    result = load(name)
    assert result.recorded_decisions, "a golden log must carry its recorded decisions"
    assert first_divergence(result) is None
    assert not result.rejections


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_still_writes_the_committed_log(name: str) -> None:
    """A change in engine or policy behaviour shows up here first: regenerate with
    `python -m tests.golden.scenarios` only when the change is intended, and say so in the commit."""
    scenario = SCENARIOS[name]()
    from events.codec import encode_record

    buffer = io.BytesIO()
    for record in scenario.log.records():
        buffer.write(encode_record(record) + b"\n")
    assert buffer.getvalue() == path(name).read_bytes()


def test_graceful_exit_resumes_from_the_sigterm_dying_checkpoint() -> None:
    result = load("graceful_exit")
    [restart] = commands(result, "restart_job")
    assert isinstance(restart, RestartJob)
    assert restart.plan.checkpoint_step == 20 and restart.plan.next_step == 21
    assert {s.tier for s in restart.plan.shards} == {Tier.DYING}
    assert closed(result).detail["lost_steps"] == 0


def test_a_sharded_job_preempted_on_one_node_asks_the_running_ranks_for_the_other_shards() -> None:
    """FSDP, no replica: fs1's ranks write shards 2 and 3 as they exit, the ranks still running are asked for the
    others at the same step, and the job resumes at the step after it, from the dying checkpoint, none lost."""
    result = load("sharded_preemption")
    [awaiting] = kinds(result, "checkpoint.awaiting")
    [save] = commands(result, "save_checkpoint")
    assert isinstance(save, SaveCheckpoint) and save.step == 17 and 0 in save.ranks and 1 in save.ranks
    assert awaiting.detail["savers"] == save.ranks
    [restart] = commands(result, "restart_job")
    assert isinstance(restart, RestartJob)
    assert restart.plan.checkpoint_step == 17 and {s.tier for s in restart.plan.shards} == {Tier.DYING}
    assert closed(result).detail["lost_steps"] == 0


def test_sigterm_storm_waits_for_the_dying_checkpoint_and_loses_no_step() -> None:
    """Exits first, dying checkpoint after: the restart is held for it and carries it, not step 0."""
    result = load("sigterm_storm")
    [awaiting] = kinds(result, "checkpoint.awaiting")
    assert awaiting.detail["step"] == 12 and awaiting.timers
    assert [d.kind for d in result.decisions].index("checkpoint.dying_done") < [
        d.kind for d in result.decisions].index("ranks.rescheduling")
    [restart] = commands(result, "restart_job")
    assert restart.plan.checkpoint_step == 12 and {s.tier for s in restart.plan.shards} == {Tier.DYING}
    assert closed(result).detail["lost_steps"] == 0
    assert not kinds(result, "fault.absorbed"), "the other ranks' expected exits are no news"


def test_sigterm_without_a_dying_checkpoint_waits_only_as_long_as_the_policy_says() -> None:
    result = load("sigterm_no_handler")
    [awaiting] = kinds(result, "checkpoint.awaiting")
    [failed] = kinds(result, "checkpoint.dying_failed")
    assert awaiting.detail["wait_s"] == 5.0
    assert awaiting.timers[0].due - _ts(result, awaiting.cause_seq) == 5 * 10**9
    [restart] = commands(result, "restart_job")
    assert restart.plan.checkpoint_step == 4
    assert failed.cause_seq > awaiting.cause_seq


def test_survivors_of_a_pod_level_move_in_their_own_generation_cause_no_second_incident() -> None:
    result = load("partial_restart_survivors")
    assert len(kinds(result, "fault.confirmed")) == 1 and len(kinds(result, "incident.closed")) == 1
    [move] = commands(result, "migrate_ranks")
    assert move.ranks == [2, 3]
    assert result.engine.jobs["part"].state == "running" and result.engine.jobs["part"].step >= 120


def test_a_pod_level_move_skips_a_spare_whose_device_failed_while_idle() -> None:
    result = load("move_skips_broken_spare")
    [move] = commands(result, "migrate_ranks")
    assert (move.from_node, move.to_node) == ("n1", "s1")
    assert result.engine.cluster.nodes["s0"].bad_devices == {3}
    assert closed(result).detail["granularity"] == "migrate"


def _ts(result: Replay, seq: int) -> int:
    return next(r.ts for r in iter_file(path("sigterm_no_handler")) if r.seq == seq)


def test_watchdog_catches_a_silent_rank_in_seconds() -> None:
    result = load("watchdog_heartbeat")
    [fault] = kinds(result, "fault.confirmed")
    assert fault.detail["fault"]["ranks"] == [5]
    records = list(iter_file(path("watchdog_heartbeat")))
    last_step_of_5 = max(r.ts for r in records if getattr(r, "envelope", None) is not None
                         and r.envelope.type == "progress.step" and r.envelope.data.rank == 5)
    detected = fault.detail["fault"]["ts"] - last_step_of_5
    assert detected <= 15 * 10**9, "silence must be caught within seconds, not HCCL's 30 minutes"
    [restart] = commands(result, "restart_ranks")
    assert restart.ranks == [5]


def test_collective_timeout_blames_the_rank_everyone_waits_for() -> None:
    result = load("watchdog_collective")
    [restart] = commands(result, "restart_ranks")
    assert isinstance(restart, RestartRanks)
    assert restart.ranks == [3]
    assert not commands(result, "restart_job")


def test_pod_level_moves_only_the_faulty_nodes_ranks() -> None:
    result = load("pod_level_reschedule")
    [migrate] = commands(result, "migrate_ranks")
    assert isinstance(migrate, MigrateRanks)
    assert (migrate.from_node, migrate.to_node, migrate.ranks) == ("n2", "spare0", [4, 5])
    [stop] = commands(result, "stop_ranks")
    assert isinstance(stop, StopRanks)
    assert set(stop.ranks) <= {4, 5}
    assert not commands(result, "restart_job") and not commands(result, "restart_ranks")
    assert migrate.plan.checkpoint_step == 15  # the dying checkpoint of the live replicas


def test_recover_in_place_falls_back_to_pod_then_job_level() -> None:
    result = load("recover_in_place_fallback")
    started = [d.detail["granularity"] for d in kinds(result, "attempt.started")]
    assert started == ["in_place", "migrate", "restart_job"]
    assert [d.kind for d in result.decisions if d.kind in ("attempt.failed", "attempt.timed_out")] == [
        "attempt.failed", "attempt.timed_out"]
    assert commands(result, "restart_ranks")[0].ranks == [3]


@pytest.mark.parametrize(("name", "saver"), [("power_off_checkpoint", 0), ("power_off_rank0", 1)])
def test_power_off_checkpoint_from_a_healthy_replica_resumes_at_next_step(name: str, saver: int) -> None:
    result = load(name)
    [save] = commands(result, "save_checkpoint")
    assert isinstance(save, SaveCheckpoint)
    assert save.ranks == [saver] and save.step == 17
    [restart] = commands(result, "restart_ranks")
    assert restart.plan.checkpoint_step == 17 and restart.plan.next_step == 18
    assert closed(result).detail["lost_steps"] == 0


def test_peer_recovery_takes_the_state_from_live_replicas_without_saving() -> None:
    result = load("peer_recovery")
    assert not commands(result, "save_checkpoint")
    [restart] = commands(result, "restart_ranks")
    assert restart.ranks == [2]
    assert restart.plan.checkpoint_step == 17 and restart.plan.next_step == 18
    [shard] = restart.plan.shards
    assert shard.tier is Tier.PEER and "peer-n2" not in shard.holders and len(shard.holders) == 2
    assert closed(result).detail["lost_steps"] == 0


def test_power_off_without_a_replica_of_some_shard_uses_newest_complete() -> None:
    result = load("power_off_no_replica")
    # rank 1 first restarts with its state from rank 3, which dies too: the widened incident restarts both
    first, restart = commands(result, "restart_ranks")
    assert first.ranks == [1] and {s.tier for s in first.plan.shards} == {Tier.PEER}
    assert restart.ranks == [1, 3]
    assert restart.plan.checkpoint_step == 10
    assert {s.tier for s in restart.plan.shards} == {Tier.STORAGE}


def test_memory_checkpoint_preferred_over_storage() -> None:
    result = load("memory_checkpoint")
    [restart] = commands(result, "restart_ranks")
    assert restart.plan.checkpoint_step == 20
    assert {s.tier for s in restart.plan.shards} == {Tier.MEMORY}
    # Each rank reads from its own node's copy.
    for rank, node in enumerate(["m0", "m0", "m1", "m1"]):
        source = restart.plan.source_of(rank, node)
        assert source is not None and source.holder == node


def test_memory_copy_lost_with_its_node_falls_back_to_storage() -> None:
    result = load("memory_checkpoint_lost")
    [migrate] = commands(result, "migrate_ranks")
    assert migrate.plan.checkpoint_step == 10
    assert {s.tier for s in migrate.plan.shards} == {Tier.STORAGE}


def test_elastic_scales_in_then_out_then_by_operator() -> None:
    result = load("elastic_scale")
    scales = commands(result, "scale_job")
    assert all(isinstance(c, ScaleJob) for c in scales)
    assert [c.dp for c in scales] == [3, 4, 2]
    assert "e3" not in scales[0].nodes and "e4" in scales[1].nodes
    assert len(scales[2].nodes) == 2


def test_an_fsdp_job_scales_in_keeping_its_processes_and_reshards_the_old_worlds_step() -> None:
    """Every rank its own shard: the scale-in keeps f0's two processes and plans the step whole in the old world's
    four shards (f0 holds f1's as their buddy); later plans count the new world's two, and the scale back out
    reshards the live two-shard state onto four ranks."""
    result = load("fsdp_scale_in")
    scale_in, scale_out = commands(result, "scale_job")
    assert isinstance(scale_in, ScaleJob) and scale_in.dp == 2 and scale_in.kept == [0, 1]
    assert scale_in.plan.checkpoint_step == 8 and [s.shard for s in scale_in.plan.shards] == [0, 1, 2, 3]
    assert all(s.tier is Tier.MEMORY and s.holders == ["f0"] for s in scale_in.plan.shards)
    [restart] = commands(result, "restart_ranks")
    assert restart.ranks == [1] and restart.plan.checkpoint_step == 12 and len(restart.plan.shards) == 2
    assert scale_out.dp == 4 and scale_out.kept == [0, 1] and scale_out.plan.checkpoint_step == 14
    assert {s.tier for s in scale_out.plan.shards} == {Tier.PEER} and len(scale_out.plan.shards) == 2


def test_elastic_job_at_its_minimum_waits_then_migrates() -> None:
    result = load("elastic_wait")
    assert kinds(result, "attempt.waiting")
    [migrate] = commands(result, "migrate_ranks")
    assert (migrate.from_node, migrate.to_node) == ("b1", "b2")
    assert not commands(result, "scale_job")


def test_transient_network_fault_retries_the_step_without_restarts() -> None:
    result = load("step_retry")
    [retry] = commands(result, "retry_step")
    assert retry.step == 13
    for kind in ("restart_ranks", "restart_job", "migrate_ranks", "stop_ranks", "scale_job"):
        assert not commands(result, kind)
    assert closed(result).detail["lost_steps"] == 0


def test_a_collective_timeout_with_every_rank_alive_is_retried_in_a_new_generation_without_restarts() -> None:
    result = load("retry_new_generation")
    [retry] = commands(result, "retry_step")
    assert (retry.step, retry.attempt) == (11, 1)  # the step again, in generation 1
    for kind in ("restart_ranks", "restart_job", "migrate_ranks", "stop_ranks", "scale_job"):
        assert not commands(result, kind)
    [stale] = kinds(result, "signal.ignored")  # the second rank's report names the group retried since
    assert "generation 1 has replaced" in stale.reason
    job = result.engine.jobs["coll"]
    assert job.generation == 1 and job.rank_gen == [0, 0, 0, 0]  # a new generation, the same processes
    done = closed(result)
    assert (done.detail["granularity"], done.detail["lost_steps"]) == ("retry", 0)


def test_a_retry_whose_collective_fails_again_goes_on_to_a_restart_in_place() -> None:
    result = load("retry_fails_then_in_place")
    assert [d.detail["granularity"] for d in kinds(result, "attempt.started")] == ["retry", "in_place"]
    [failed] = kinds(result, "attempt.failed")
    assert "generation 1" in failed.reason
    [restart] = commands(result, "restart_ranks")
    assert (restart.ranks, restart.attempt, restart.plan.checkpoint_step) == ([0, 1, 2, 3], 2, 10)
    assert closed(result).detail["granularity"] == "in_place"


def test_third_fault_of_a_device_in_the_window_isolates_it() -> None:
    result = load("frequency_isolation")
    assert len(kinds(result, "signal.ignored")) == 2
    [isolate] = commands(result, "isolate_device")
    assert (isolate.node, isolate.device) == ("f1", 2)
    [migrate] = commands(result, "migrate_ranks")
    assert migrate.from_node == "f1"


def test_exhausted_restart_budget_fails_the_job_naming_it() -> None:
    result = load("restart_budget")
    [failed] = kinds(result, "job.failed")
    assert "max_restarts" in failed.reason
    assert result.engine.jobs["flaky"].state == "failed"
    assert len(commands(result, "restart_ranks")) == 2


def test_a_wait_for_nodes_ends_when_the_lost_host_joins_again() -> None:
    result = load("wait_ends_on_rejoin")
    [first, *_] = kinds(result, "attempt.waiting")
    [deadline] = first.timers
    assert deadline.id.startswith("host/wait/") and "at most 14400 s" in first.reason
    [started] = kinds(result, "attempt.started")
    assert deadline.id in started.cancelled_timers  # the rejoin ended the wait before its deadline
    assert not kinds(result, "attempt.wait_expired")
    [restart] = commands(result, "restart_job")
    assert restart.nodes == ["h0", "h1"]
    assert closed(result).detail["granularity"] == "restart_job"


def test_a_wait_that_runs_out_resets_the_device_and_restarts_in_place() -> None:
    result = load("wait_deadline_reset")
    [waiting, *_] = kinds(result, "attempt.waiting")
    [expired] = kinds(result, "attempt.wait_expired")
    assert expired.cause_seq > waiting.cause_seq and "300 s" in expired.reason
    [restart] = commands(result, "restart_ranks")
    assert isinstance(restart, RestartRanks) and restart.ranks == [5] and restart.reset_devices == {"d1": [1]}
    assert not commands(result, "migrate_ranks") and not kinds(result, "job.failed")
    assert closed(result).detail["granularity"] == "in_place"


def test_a_reset_that_fails_counts_the_device_bad_again_and_the_rank_moves() -> None:
    result = load("reset_fails_then_moves")
    [restart] = commands(result, "restart_ranks")
    assert restart.reset_devices == {"d1": [1]}
    [failed] = kinds(result, "attempt.failed")
    assert "resetting GPU 1 failed" in failed.reason
    # not restarted onto the GPU that failed its reset: the job waits for a node instead, and the spare takes d1's
    waiting = kinds(result, "attempt.waiting")[-1]
    assert not commands(result, "restart_job") and (waiting.cause_seq, waiting.index) > (failed.cause_seq, failed.index)
    [move] = commands(result, "migrate_ranks")
    assert (move.from_node, move.to_node) == ("d1", "s0")
    assert closed(result).detail["granularity"] == "migrate" and not kinds(result, "job.failed")
    assert result.engine.cluster.node("d1").bad_devices == {1}


def test_a_lemon_gpu_is_isolated_only_once_a_spare_can_replace_it() -> None:
    result = load("lemon_isolated_with_spare")
    no_spare = [d for d in result.decisions if "not isolated: no spare" in d.reason]
    assert no_spare and all(d.job == "lem" for d in no_spare)  # the third error counts the earlier job's too
    isolations = [c for d in result.decisions for c in d.commands if c.kind == "isolate_device"]
    assert len(isolations) == 1 and (isolations[0].node, isolations[0].device) == ("l1", 2)
    [isolating] = [d for d in result.decisions if any(c.kind == "isolate_device" for c in d.commands)]
    assert "1 spare(s) can replace it" in isolating.reason
    assert [t.id for t in isolating.timers] == [f"lem/release/l1/2/{isolating.cause_seq}"]  # it expires
    assert isolating.cause_seq > no_spare[-1].cause_seq
    [move] = commands(result, "migrate_ranks")
    assert (move.from_node, move.to_node) == ("l1", "s0")


def test_a_straggler_is_drained_to_a_spare_at_the_next_checkpoint_with_its_time_against_the_peers() -> None:
    result = load("straggler_drained")
    [planned] = kinds(result, "node.drain_planned")
    assert planned.detail["node"] == "n2" and planned.detail["code"] == "straggler"
    assert planned.detail["rank"] == 5 and planned.detail["steps"] >= 20
    assert (planned.detail["compute_s"], planned.detail["peers_median_s"]) == (0.5, 0.2)
    assert "2.5x its peers' median" in planned.reason
    [deferred] = kinds(result, "node.drain_deferred")  # no spare free at step 30
    assert deferred.detail == {"nodes": ["n2"], "step": 30}
    [move] = commands(result, "migrate_ranks")
    assert (move.from_node, move.to_node, move.ranks) == ("n2", "s0", [4, 5])
    assert move.plan.checkpoint_step == 40
    assert closed(result).detail["granularity"] == "migrate" and closed(result).detail["lost_steps"] == 0
    assert result.engine.jobs["slow"].closed[-1]["cause"] == "drain"
    job = result.engine.jobs["slow"]
    assert job.nodes == ["n0", "n1", "s0", "n3"] and job.state == "running"
    assert result.engine.cluster.nodes["n2"].drained


def test_a_nan_loss_rolls_every_rank_back_before_the_bad_step_and_skips_its_data() -> None:
    result = load("bad_step_rollback")
    [confirmed] = kinds(result, "fault.confirmed")
    assert confirmed.reason == "loss nan at step 24 on rank 0"  # the consequence, heard first
    [earlier] = kinds(result, "fault.added")
    assert earlier.reason.startswith("loss nan at step 23 on rank 1")  # the bad step itself, heard next
    [attempt] = kinds(result, "attempt.started")  # one roll-back: the later nan reports decide nothing
    assert attempt.detail["granularity"] == "in_place" and attempt.detail["ranks"] == [0, 1]
    [restart] = commands(result, "restart_ranks")
    assert isinstance(restart, RestartRanks) and restart.ranks == [0, 1]
    # The checkpoint at 25 holds the poisoned state; 20 is the newest before the bad step 23.
    assert restart.plan.checkpoint_step == 20 and restart.plan.next_step == 21
    assert restart.plan.skip_data == ["shard-7/batch-22"] and restart.plan.skip_steps == []
    assert closed(result).reason == "progress to step 21 past resume point 20"

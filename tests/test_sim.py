"""The cluster simulator (recovery/sim): determinism, accounting, the baselines' behaviour, replayable logs, the fault
mix, the Titan importer and the demo cluster. Small clusters and short horizons: each run takes well under a
second."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from events.commands import CommandBase
from events.outputs import Decision
from events.values import Tier
from policies.baselines import MindClusterLikeRescheduling
from recovery.cli.replay import main as replay_main
from recovery.log import EPOCH, FileLog, MemoryLog, iter_file
from recovery.log.recorder import Recorder
from recovery.sim import PROFILES, Cluster, Costs, Fault, FaultMix, Result, SimConfig, Simulator, Training, simulate
from recovery.sim.__main__ import main as sim_main
from recovery.sim.config import NS
from recovery.sim.demo import DemoCluster, demo_cluster
from recovery.sim.faults import PACKAGED_MIX, default_mix_path, draw_faults, read_trace, write_trace
from recovery.sim.sim import event
from recovery.sim.titan import import_titan, titan_index

DATA = Path(__file__).parent / "data"
SMALL = Cluster(gpus=64, gpus_per_node=8, tp=8, pp=2, nodes_per_switch=4, spare_nodes=2)
"""8 nodes of 8 GPUs, dp=4 replicas of 16 shards, 2 leaf switches, 2 spares"""
TRAINING = Training(step_time_s=6.0, memory_every_steps=5, storage_every_s=600.0, params=8e9)
RELIABLE = replace(Costs(), fail_probability=0.0, timeout_probability=0.0)


def config(profile: str = "default", days: float = 0.25, **kw: object) -> SimConfig:
    base: dict[str, object] = {"cluster": SMALL, "training": TRAINING, "costs": RELIABLE, "days": days,
                               "profile": PROFILES[profile]}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def fault(signal: str, at_s: float, position: int = 1, device: int = 2, **kw: object) -> Fault:
    scope = {"device": "device", "process": "rank", "hang": "job", "node": "node", "network": "switch",
             "straggler": "node"}[signal]
    base: dict[str, object] = {"index": 0, "at_ns": int(at_s * NS), "component": signal, "signal": signal,
                               "scope": scope, "position": position, "device": device, "repair_ns": 3600 * NS}
    base.update(kw)
    return Fault(**base)  # type: ignore[arg-type]


def run(cfg: SimConfig, faults: list[Fault]) -> tuple[Simulator, Result, list[Decision]]:
    sim = Simulator(cfg, faults=faults)
    result = sim.run()
    decisions = [r.envelope.data for r in sim.log.records()
                 if hasattr(r, "envelope") and r.envelope.type == "decision"]
    return sim, result, decisions


def commands(decisions: list[Decision]) -> list[str]:
    return [c.kind for d in decisions for c in d.commands]


def granularities(decisions: list[Decision]) -> list[str]:
    return [d.detail["granularity"] for d in decisions if d.kind == "attempt.started"]


# -- determinism and replay -------------------------------------------------------------------------------
def test_same_seed_same_log_bytes(tmp_path: Path) -> None:
    cfg = config(days=1.0, seed=7, rate_per_gpu_hour=3e-3, costs=Costs())  # ~4 faults, flaky executors
    paths = []
    for name in ("a", "b"):
        sim = Simulator(cfg)
        sim.run()
        path = tmp_path / f"{name}.jsonl"
        sim.write_log(path)
        paths.append(path)
    assert len(Simulator(cfg).faults) >= 2
    assert paths[0].read_bytes() == paths[1].read_bytes()
    other = Simulator(replace(cfg, seed=8))
    other.run()
    other.write_log(tmp_path / "c.jsonl")
    assert (tmp_path / "c.jsonl").read_bytes() != paths[0].read_bytes()


def test_verify_and_timeline_work_on_a_simulated_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.jsonl"
    result = simulate(config(days=1.0, seed=3, rate_per_gpu_hour=3e-3), log_path=path)
    assert result.faults, "the run should have faults to replay"
    assert replay_main(["verify", str(path)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert replay_main(["timeline", str(path), "--job", "llm"]) == 0
    out = capsys.readouterr().out
    assert "fault.confirmed" in out and "incident.closed" in out
    # the log is in simulated time: records are stamped from the fixed epoch on, never backwards
    stamps = [r.ts for r in iter_file(path)]
    assert stamps[0] == EPOCH and stamps == sorted(stamps)
    # streamed as it goes, the same bytes a run kept in memory writes at its end; without a log, the same result
    sim = Simulator(config(days=1.0, seed=3, rate_per_gpu_hour=3e-3))
    kept = sim.run()
    sim.write_log(tmp_path / "kept.jsonl")
    assert (tmp_path / "kept.jsonl").read_bytes() == path.read_bytes()
    unlogged = simulate(config(days=1.0, seed=3, rate_per_gpu_hour=3e-3))
    timing = ("sim_seconds", "engine_seconds")
    assert {k: v for k, v in unlogged.as_dict().items() if k not in timing} == {
        k: v for k, v in kept.as_dict().items() if k not in timing}
    assert unlogged.records == kept.records == len(stamps)


def test_the_log_does_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    script = ("import sys; from recovery.sim import *; from recovery.sim.sim import Simulator; "
              "s = Simulator(SimConfig(cluster=Cluster(gpus=64, tp=8, pp=2, nodes_per_switch=4, spare_nodes=2), "
              "training=Training(params=8e9, storage_every_s=600), days=1.0, seed=5, rate_per_gpu_hour=3e-3)); "
              "s.run(); s.write_log(sys.argv[1])")
    root = Path(__file__).resolve().parents[1]
    logs = []
    for hash_seed in ("1", "2"):
        path = tmp_path / f"{hash_seed}.jsonl"
        env = {"PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(root), "PATH": ""}
        done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=root, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        logs.append(path.read_bytes())
    assert logs[0] == logs[1]


def test_a_run_can_log_to_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file.jsonl"
    sim = Simulator(config(days=0.5, seed=3, rate_per_gpu_hour=3e-3), log=FileLog(path))
    result = sim.run()
    assert result.records == sum(1 for _ in iter_file(path)) > 100
    assert replay_main(["verify", str(path)]) == 0


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "cli.jsonl"
    assert sim_main(["run", "--gpus", "64", "--tp", "8", "--pp", "2", "--spares", "2", "--days", "0.2", "--seed", "4",
                     "--profile", "torchelastic-like", "--json", "--log", str(log)]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["profile"] == "torchelastic-like" and out["gpus"] == 64 and log.is_file()
    assert sim_main(["run", "--gpus", "64", "--tp", "8", "--pp", "2", "--days", "0.1"]) == 0
    assert "ETTR" in capsys.readouterr().out
    trace = tmp_path / "titan.csv"
    assert sim_main(["titan", str(DATA / "gc_sample.csv"), "--gpus", "1024", "--out", str(trace)]) == 0
    assert len(read_trace(trace)) == 5
    assert sim_main(["run", "--gpus", "64", "--tp", "8", "--pp", "2", "--mix", str(tmp_path / "missing.csv")]) == 2


def test_baselines_are_entry_point_plugins() -> None:
    from policies import registry

    for name in ("torchelastic-like", "mindcluster-like"):
        labels = registry.load_set(PROFILES[name].selection).labels
        assert {family: label.partition("@")[0] for family, label in labels.items()} == {
            family: f"{name}-{family}" for family in ("detection", "rescheduling", "checkpoint")}


# -- accounting -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_productive_plus_lost_is_wall_time(profile: str) -> None:
    result = simulate(config(profile, days=2.0, seed=11, rate_per_gpu_hour=2e-3, costs=Costs()))
    assert len(result.faults) >= 3
    result.check()
    assert result.productive_s + sum(result.lost_s.values()) == pytest.approx(result.wall_s, abs=1e-6)
    assert result.wall_s == 2.0 * 86_400
    assert 0 < result.ettr < 1
    assert result.gpu_hours(result.wall_s) == pytest.approx(64 * 48)
    as_json = result.as_dict()
    assert set(as_json["lost_gpu_hours"]) == set(result.lost_s)
    assert as_json["ettr"] == pytest.approx(result.ettr, abs=1e-6)


@pytest.mark.parametrize(("profile", "memory_stall_s"), [("default", 0.0), ("default-memory", 0.2)])
def test_a_run_without_faults_loses_only_checkpoint_stalls(profile: str, memory_stall_s: float) -> None:
    _sim, r, _ = run(config(profile, days=0.5), [])
    lost = {k: v for k, v in r.lost_s.items() if v}
    assert set(lost) == {"checkpoint"}
    # a 0.2 s memory snapshot every 5 steps of 6 s (if the job writes them), and 1.8 s per persistent save every
    # 600 s of training
    per_step = memory_stall_s / TRAINING.memory_every_steps
    step_s = TRAINING.step_time_s + per_step
    steps = r.steps
    assert steps == pytest.approx(0.5 * 86_400 / step_s, rel=0.01)
    assert lost["checkpoint"] == pytest.approx(steps * per_step + 1.8 * (0.5 * 86_400 // (600 + step_s)),
                                               rel=0.02)


@pytest.mark.parametrize("profile", ["default", "mindcluster-like"])
def test_lost_time_is_booked_by_cause(profile: str) -> None:
    # a GPU off the bus at 1 h: detection is immediate, then (MindIO TTP) a dying checkpoint, a stop, a migration,
    # a load; the default sends the moved ranks their state from live replicas instead of saving it first
    sim, r, decisions = run(config(profile), [fault("device", 3600, code="79")])
    costs = sim.cfg.costs
    rpn = sim.cfg.cluster.gpus_per_node
    assert r.lost_s["detection"] == 0
    assert r.lost_s["stopping"] == pytest.approx(costs.ack_latency_s + costs.stop_kill_s)  # the vacated node: killed
    assert r.lost_s["rescheduling"] == pytest.approx(costs.ack_latency_s + costs.migrate_s)
    assert r.lost_s["recompute"] < TRAINING.step_time_s  # only the step under way at the fault
    if profile == "default":
        assert r.lost_s["saving"] == 0
        assert r.lost_s["loading"] == pytest.approx(costs.load_s(Tier.PEER, rpn, sim.world.shard_bytes))
        assert commands(decisions)[:2] == ["stop_ranks", "migrate_ranks"]
        assert sim.world.stats["state_from_peers"] == 1
    else:
        assert r.lost_s["saving"] == pytest.approx(costs.ack_latency_s + costs.save_s(16, sim.world.shard_bytes))
        assert r.lost_s["loading"] == pytest.approx(costs.load_s(Tier.DYING, rpn, sim.world.shard_bytes))
        assert commands(decisions)[:3] == ["save_checkpoint", "stop_ranks", "migrate_ranks"]
    (outcome,) = r.faults
    assert outcome.ttr_s == pytest.approx(sum(r.lost_s[k] for k in ("saving", "stopping", "rescheduling",
                                                                     "loading")) + 6.04, abs=0.5)


# -- what each profile promises ---------------------------------------------------------------------------
def test_torchelastic_like_restarts_everything_from_storage() -> None:
    faults = [fault("process", 3000, exit_signal=11), fault("device", 6000, code="48", index=1)]
    _sim, r, decisions = run(config("torchelastic-like"), faults)
    assert set(granularities(decisions)) == {"restart_job"}
    assert "save_checkpoint" not in commands(decisions)  # no dying checkpoint
    plans = [c.plan for d in decisions for c in d.commands if c.kind == "restart_job"]
    assert plans and all({s.tier for s in p.shards} == {Tier.STORAGE} for p in plans)
    assert all(d.policy in (None, "torchelastic-like-detection@1", "torchelastic-like-rescheduling@1",
                            "torchelastic-like-checkpoint@2") for d in decisions)
    assert r.lost_s["recompute"] > 60  # work since the last persistent checkpoint is redone
    # the XID 48 node is replaced from the spare pool by the job-level restart
    restart = [c for d in decisions for c in d.commands if c.kind == "restart_job"][-1]
    assert "n00001" not in restart.nodes


def test_torchelastic_like_sees_a_hang_only_at_the_collective_timeout() -> None:
    sim, r, decisions = run(config("torchelastic-like"), [fault("hang", 3000)])
    confirmed = [d for d in decisions if d.kind == "fault.confirmed"]
    assert len(confirmed) == 1 and "NCCL watchdog" in confirmed[0].reason
    (outcome,) = r.faults
    assert outcome.ttr_s is not None and outcome.ttr_s > sim.cfg.agents.collective_timeout_s
    assert r.lost_s["detection"] == pytest.approx(600.0)
    ignored = [d for d in decisions if d.kind == "signal.ignored"]
    assert any("process.hang" in d.reason for d in ignored)


def test_default_finds_a_hang_from_the_agents_watchdog_and_restarts_one_rank() -> None:
    sim, r, decisions = run(config(), [fault("hang", 3000)])
    (outcome,) = r.faults
    assert r.lost_s["detection"] == pytest.approx(sim.cfg.agents.hang_detect_s)
    assert granularities(decisions) == ["in_place"]
    restart = [c for d in decisions for c in d.commands if c.kind == "restart_ranks"]
    assert [c.ranks for c in restart] == [[1 * 8 + 2]]
    assert outcome.ttr_s is not None and outcome.ttr_s < 120


def test_mindcluster_like_uses_the_fixed_strategy_order() -> None:
    # a crashed process: a step retry cannot help, so recover-in-place, with a dying checkpoint first
    _, r, decisions = run(config("mindcluster-like"), [fault("process", 3100, exit_signal=11)])
    assert granularities(decisions) == ["in_place"]
    assert commands(decisions) == ["save_checkpoint", "restart_ranks"]  # the crashed rank needs no stopping
    assert any(d.policy == f"mindcluster-like-rescheduling@{MindClusterLikeRescheduling.version}" for d in decisions)
    (closed,) = [d for d in decisions if d.kind == "incident.closed"]
    assert closed.detail["lost_steps"] == 0  # resumed from the dying checkpoint at the step of the fault
    # a leaf switch that reboots: its nodes can take no rank while their links are down, so the strategies that
    # restart there (retry, recover-in-place) are skipped for recover: the ranks move to spares
    _sim, r, decisions = run(config("mindcluster-like"), [fault("network", 3000, outage_ns=100 * NS)])
    assert granularities(decisions) == ["migrate"]
    assert r.faults[0].ttr_s is not None


def test_default_recovers_a_node_loss_on_a_spare_and_the_node_returns_to_the_pool() -> None:
    sim, r, decisions = run(config(days=0.5), [fault("node", 3000, position=3, repair_ns=2 * 3600 * NS)])
    assert granularities(decisions) == ["migrate"]
    migrate = [c for d in decisions for c in d.commands if c.kind == "migrate_ranks"]
    assert [(c.from_node, c.to_node) for c in migrate] == [("n00003", "n00008")]
    joined = [r for r in sim.log.records() if r.envelope.type == "node.joined" and r.envelope.node == "n00003"]
    assert len(joined) == 2  # at the start as a job node, and after its repair as a spare
    assert r.lost_s["detection"] == pytest.approx(40 + 20)


def test_a_straggler_costs_its_slowdown_until_the_default_drains_it_and_a_baseline_pays_it_until_repaired() -> None:
    # n00002 computes twice as slow from t=3000 s for 4 h; the watchdog ticks every 300 s after the ranks' reports
    straggler = fault("straggler", 3000, position=2, slowdown=2.0, repair_ns=4 * 3600 * NS)
    _, r, decisions = run(config(days=0.5, watch_s=300.0), [straggler])
    assert not r.rejections and r.job_state == "running"
    [planned] = [d for d in decisions if d.kind == "node.drain_planned"]
    assert planned.detail["node"] == "n00002" and planned.detail["code"] == "straggler"
    # the rank's recent steps, those before it turned slow among them, against its peers' 6 s
    assert planned.detail["peers_median_s"] == 6.0 and 9.0 <= planned.detail["compute_s"] <= 12.0
    [move] = [c for d in decisions for c in d.commands if c.kind == "migrate_ranks"]
    assert move.from_node == "n00002" and move.plan.checkpoint_step is not None
    # the job trained at the straggler's pace from its start to the move: at most a watchdog period, the window,
    # the wait for the next persistent checkpoint (600 s of training) and the move, at 2x
    assert 0 < r.lost_s["straggler"] < 300 + 20 * 12 + 2 * 600 + 120
    _, baseline, decisions = run(config("torchelastic-like", days=0.5, watch_s=300.0), [straggler])
    assert not [d for d in decisions if d.kind == "node.drain_planned"]
    assert baseline.lost_s["straggler"] == pytest.approx(4 * 3600 / 2, rel=0.01)  # half of its 4 h at half speed
    assert r.ettr > baseline.ettr


def test_without_stragglers_the_watch_mode_changes_no_recovery() -> None:
    quiet, watched = (run(config(days=0.5, **kw), [fault("node", 3000, position=3)])
                      for kw in ({}, {"watch_s": 300.0}))
    assert granularities(quiet[2]) == granularities(watched[2]) == ["migrate"]
    assert not watched[1].rejections and watched[1].lost_s["straggler"] == 0


def test_executor_failures_escalate() -> None:
    flaky = replace(RELIABLE, fail_probability=1.0)
    sim, _r, decisions = run(config(costs=flaky), [fault("process", 3000, exit_signal=11)])
    assert [d.kind for d in decisions if d.kind.startswith("attempt.")][:2] == ["attempt.started", "attempt.failed"]
    assert sim.engine.jobs["llm"].state == "failed"


# -- faults -----------------------------------------------------------------------------------------------
def test_the_default_mix_is_the_llama3_table_and_its_rate() -> None:
    mix = FaultMix.load()
    assert mix.total == 419
    assert mix.rate_per_gpu_hour == pytest.approx(419 / (16_384 * 54 * 24))
    assert default_mix_path().name == PACKAGED_MIX.name
    assert FaultMix.load(PACKAGED_MIX).rows == mix.rows  # the packaged copy is the shared one


def test_another_mix_gives_its_own_rows_and_rate(tmp_path: Path) -> None:
    path = tmp_path / "mix.csv"
    path.write_text("component,category,count,signal,scope\n"
                    "NIC,Host,3,network,node\nBad code,Software,1,process,rank\n")
    mix = FaultMix.load(path, gpus=1000, days=10)
    assert mix.rate_per_gpu_hour == pytest.approx(4 / (1000 * 10 * 24))
    faults = draw_faults(mix, gpus=1000, positions=125, devices=8, horizon_ns=100 * 86_400 * NS, seed=2)
    assert {f.component for f in faults} == {"NIC", "Bad code"}
    result = simulate(config(days=1.0, mix_path=str(path), rate_per_gpu_hour=2e-3))
    assert {f.component for f in result.faults} <= {"NIC", "Bad code"} and result.faults
    bad = tmp_path / "bad.csv"
    bad.write_text("component,category,count,signal,scope\nX,Y,1,cosmic,rank\n")
    with pytest.raises(ValueError, match="signal must be one of"):
        FaultMix.load(bad)


def test_faults_scale_with_the_cluster_and_repeat_for_a_seed() -> None:
    mix = FaultMix.load()
    horizon = 54 * 86_400 * NS
    big = draw_faults(mix, gpus=16_384, positions=2048, devices=8, horizon_ns=horizon, seed=1)
    again = draw_faults(mix, gpus=16_384, positions=2048, devices=8, horizon_ns=horizon, seed=1)
    small = draw_faults(mix, gpus=1024, positions=128, devices=8, horizon_ns=horizon, seed=1)
    assert big == again
    assert 350 < len(big) < 490 and 10 < len(small) < 50
    signals = {f.signal for f in big}
    assert signals == {"device", "process", "network", "node", "hang"}
    assert all(f.code is not None for f in big if f.signal == "device")


def test_a_fault_arrives_as_the_events_a_cluster_emits() -> None:
    cases = {
        "device": (fault("device", 600, code="48"), ["device.fault", "process.exited", "device.fault"]),
        "process": (fault("process", 600, exit_code=134), ["process.exited"]),
        "hang": (fault("hang", 600), ["process.hang"]),
        "node": (fault("node", 600), ["node.not_ready"]),
        "network": (fault("network", 600, outage_ns=30 * NS), ["network.link_down"] * 4 + ["network.link_up"] * 4),
    }
    for signal, (f, expected) in cases.items():
        sim, _r, _ = run(config(days=0.02), [f])
        kinds = [r.envelope.type for r in sim.log.records() if r.ts >= EPOCH + 600 * NS and r.envelope.type in
                 ("device.fault", "process.exited", "process.hang", "node.not_ready", "network.link_down",
                  "network.link_up")]
        assert kinds[: len(expected)] == expected, signal


def test_trace_files_round_trip(tmp_path: Path) -> None:
    faults = [fault("device", 10, code="79"), fault("node", 20, index=1, position=5)]
    path = tmp_path / "trace.csv"
    assert write_trace(path, faults) == 2
    back = read_trace(path)
    assert [(f.at_ns, f.signal, f.position, f.device, f.code) for f in back] == \
        [(f.at_ns, f.signal, f.position, f.device, f.code) for f in faults]


# -- the Titan importer -----------------------------------------------------------------------------------
def test_titan_locations_map_to_gpu_positions() -> None:
    assert titan_index("c0-0c0s0n0") == 0
    assert titan_index("c0-0c0s0n3") == 3
    assert titan_index("c1-0c0s0n0") == 96  # the next cabinet in the row
    assert titan_index("c24-7c2s7n3") == 19_199
    with pytest.raises(ValueError, match="not a Titan location"):
        titan_index("node17")
    with pytest.raises(ValueError, match="outside"):
        titan_index("c25-0c0s0n0")


def test_titan_failures_become_device_faults(tmp_path: Path) -> None:
    faults = import_titan(DATA / "gc_sample.csv", gpus=1024, gpus_per_node=8, days=60)
    got = [(round(f.at_ns / NS / 3600, 2), f.position, f.device, f.code) for f in faults]
    assert got == [(60.0, 0, 0, "48"), (104.0, 12, 0, "79"), (177.25, 1, 0, "48"), (462.5, 0, 1, "79"),
                   (1080.0, 0, 0, "79")]
    # positions beyond the simulated GPUs are dropped, or folded onto the cluster
    assert len(import_titan(DATA / "gc_sample.csv", gpus=1024, fold=True)) == 7
    # the trace drives a simulated job: every failure strikes it as the XID it maps to
    path = tmp_path / "titan.csv"
    write_trace(path, faults)
    cluster = Cluster(gpus=1024, spare_nodes=4)
    result = simulate(SimConfig(cluster=cluster, costs=RELIABLE, days=50, trace_path=str(path)))
    assert [f.component for f in result.faults] == ["Titan DBE", "Titan OTB", "Titan DBE", "Titan OTB", "Titan OTB"]
    assert all(f.ttr_s is not None for f in result.faults)


# -- the demo cluster -------------------------------------------------------------------------------------
class Daemon(Recorder):
    """The daemon's loop in miniature, for driving the demo: a log on the demo's clock, the engine, its timers
    fired when due before the next event, and the demo as executor."""

    def __init__(self, demo: DemoCluster) -> None:
        self.now = EPOCH
        super().__init__(MemoryLog(clock=lambda: self.now))
        self.demo = demo
        self.fired = 0

    def commanded(self, command: CommandBase, decision: Decision) -> None:
        self.demo.execute(command)

    def advance(self, delay_s: float) -> None:
        self.now += int(delay_s * NS)
        while (due := self.timers.next_at()) is not None and due <= self.now:
            firing = self.timers.take()
            if firing is None:
                continue  # cancelled, or a period already fired
            self.fired += 1
            self.feed(*event("timer.fired", {"timer_id": firing.timer_id, "due": firing.due}, id=f"timer-{self.fired}",
                             job=firing.job))


def test_demo_cluster_yields_events_in_time_order_and_executes_commands() -> None:
    demo = DemoCluster(seconds=200)
    daemon = Daemon(demo)
    delays: list[float] = []
    for delay, subject, envelope in demo.events():
        delays.append(delay)
        daemon.advance(delay)
        daemon.feed(subject, envelope)
    assert daemon.fired > 0
    assert all(d >= 0 for d in delays) and sum(delays) <= 200 + 1e-6  # a float sum of the delays
    decisions = [r.envelope.data for r in daemon.log.records() if r.envelope.type == "decision"]
    closed = [d for d in decisions if d.kind == "incident.closed"]
    # the GPU off the bus (moved to the spare), the crash (in place), the hang (in place), the host (moved)
    assert [d.detail["granularity"] for d in closed] == ["migrate", "in_place", "in_place", "migrate"]
    assert daemon.engine.jobs["demo"].state == "running"
    acks = [r.envelope.data.status for r in daemon.log.records() if r.envelope.type == "command.ack"]
    assert acks.count("accepted") == acks.count("done") > 0


def test_demo_cluster_function_returns_the_generator_and_the_executor() -> None:
    events, execute = demo_cluster(seconds=10)
    first = next(events)
    assert first[0] == 0 and first[2].type == "node.joined"
    assert callable(execute)


def test_policies_bench_prints_json_metrics() -> None:
    bench = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
    done = subprocess.run([sys.executable, str(bench), "policies", "--quick", "--workers", "1", "--profiles",
                           "default", "torchelastic-like"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    rows = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert all(set(row) == {"bench", "metric", "value", "unit"} and row["bench"] == "policies" for row in rows)
    metrics = {row["metric"]: row["value"] for row in rows}
    assert 0.9 < metrics["default.1024gpu.ettr"] <= 1 and 0.9 < metrics["torchelastic-like.1024gpu.ettr"] <= 1
    assert metrics["default.1024gpu.lost_gpu_hours"] > 0 and "sim.1024gpu.7d.seconds" in metrics
    assert "default.1024gpu.lost_vs_torchelastic-like" in metrics


@pytest.mark.parametrize(("args", "flag", "says"), [
    (["--days", "-1"], "--days", "outside"),
    (["--days", "nan"], "--days", "outside"),
    (["--gpus", "0"], "--gpus", "outside 1 .. 131,072"),
    (["--gpus", "1000000000"], "--gpus", "outside"),
    (["--gpus", "many"], "--gpus", "not an integer"),
    (["--fail-p", "2"], "--fail-p", "outside 0 .. 1"),
    (["--gpus", "1000"], "--gpus 1000", "whole number of 8-GPU nodes"),
])
def test_sim_cli_refuses_a_bad_flag_naming_it_without_a_traceback(
        args: list[str], flag: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = sim_main(["run", *args])
    except SystemExit as exc:  # argparse's own error exit
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert flag in err and says in err
    assert "Traceback" not in err


def test_sim_cli_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sim_main(["run", "--help"])
    out = capsys.readouterr().out
    assert "(default: 16384)" in out and "(default: 54.0)" in out


def test_the_summary_says_when_a_policy_raised_and_inputs_were_dead_lettered() -> None:
    from dataclasses import replace as replaced

    from rich.console import Console

    result = Simulator(config(days=0.05, seed=1)).run()
    quiet = Console(record=True, width=200)
    result.render(quiet)
    assert "dead letter" not in quiet.export_text()
    broken = replaced(result, rejections={"policy_error": 597, "schema_violation": 2})
    loud = Console(record=True, width=200)
    broken.render(loud)
    text = loud.export_text()
    assert "599 dead letter(s) (policy_error 597, schema_violation 2)" in text
    assert "a policy raised 597 time(s)" in text


def test_a_job_level_restart_the_executor_refuses_still_moves_the_job_to_the_nodes_it_names() -> None:
    """A job-level reschedule recreates every pod on the nodes it names; one that fails to start fails the command,
    but the job has left its old nodes, as the engine that placed it there expects. Before, the simulated executor
    kept the old placement: when those nodes were repaired it announced them as the job's own (`spare: false`), the
    engine held them in no job, and they were lost to the pool for the rest of the run."""
    from events.commands import RestartJob
    from events.values import ResumePlan

    sim = Simulator(config())
    world = sim.world
    old = list(world.placement)
    target = old[:-1] + list(world.initial_spares[:1])
    world.hw[target[0]].down = True  # the restart cannot start there
    command = RestartJob(id="c1", job=sim.cfg.job, attempt=1, deadline_s=600, nodes=target,
                         plan=ResumePlan(checkpoint_step=None, next_step=0))
    world._complete(command, "ok")
    assert world.stats.get("restart_job:refused") == 1
    assert world.placement == target
    assert world.hw[old[-1]].repairing  # left: back to the pool once cleaned up

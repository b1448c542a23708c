"""Latent bad hardware and the node agents' health checks in the simulator (recovery/sim/health.py): a recovery that
lands on a node with a latent bad device is followed by a second fault; with checks the node is found first and the
recovery goes elsewhere; runs with checks are deterministic and replay to the same decisions; with the new parameters
off a run is what it was."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from recovery.log.recorder import replay
from recovery.sim import Agents, Costs, Durations, Simulator
from recovery.sim.config import NS
from recovery.sim.health import LATENT_INDEX
from tests.test_sim import SMALL, config, fault, run

LATENT_SPARES = replace(SMALL, spare_nodes=4, latent_spares=0.5)
"""4 spares, each latent with probability 1/2: on seed 1, three of them are"""
HOST_LOST = [fault("node", 3600.0, position=1)]
"""a host lost an hour in: its ranks move to a spare"""


def _with(checks: bool, **agents: object) -> Agents:
    return Agents(health_checks=checks, **agents)  # type: ignore[arg-type]


def test_a_move_onto_a_latent_bad_spare_is_followed_by_a_second_fault_without_checks() -> None:
    sim, result, _ = run(config(days=0.25, seed=1, cluster=LATENT_SPARES), HOST_LOST)
    latent = [f for f in result.faults if f.index >= LATENT_INDEX]
    assert latent and latent[0].component == "latent bad device (spare)" and latent[0].fault_class == "device"
    assert result.landed_on_bad >= 1 and result.stats["latent_faults"] == len(latent)
    # the second fault strikes within the latent device's U(30, 600) s of training after the move
    first_recovery = result.faults[0].recovered_s
    assert first_recovery is not None and 30 <= latent[0].at_s - first_recovery <= 600 + 6
    assert not [r for r in sim.log.records() if getattr(r, "envelope", None) and r.envelope.type == "node.checked"]
    result.check()


def test_checks_find_the_latent_spares_so_no_recovery_lands_on_one_and_ettr_is_higher() -> None:
    _, without, _ = run(config(days=0.25, seed=1, cluster=LATENT_SPARES), HOST_LOST)
    sim, checked, _ = run(config(days=0.25, seed=1, cluster=LATENT_SPARES,
                                         agents=_with(True, check_detects=1.0)), HOST_LOST)
    assert checked.landed_on_bad == 0 and "latent_faults" not in checked.stats
    assert checked.stats["latent:spare"] == without.stats["latent:spare"] == 3  # the same latent spares: CRN
    assert checked.stats["checks:join:failed"] == 3
    assert checked.ettr > without.ettr
    assert [f.index for f in checked.faults] == [0]  # the drawn fault only
    checked.check()
    # every node announced its checks when it joined, and logged them
    envelopes = [r.envelope for r in sim.log.records() if getattr(r, "envelope", None) is not None]
    joined = [e for e in envelopes if e.type == "node.joined"]
    assert joined and all(e.data.checks for e in joined)
    checks = [e for e in envelopes if e.type == "node.checked"]
    assert {e.data.when for e in checks} >= {"join", "spare"}
    failed = [e for e in checks if not e.data.ok]
    assert len(failed) == 3 and all(e.data.when == "join" for e in failed)
    assert len({e.node for e in failed}) == 3


def test_a_spare_that_fails_its_check_when_granted_is_refused_and_the_next_one_taken() -> None:
    # each run of the checks finds a latent device with probability 1/2: on seed 3 the join checks miss all three
    # latent spares, and the checks before the move find two of them
    cfg = config(days=0.25, seed=3, cluster=LATENT_SPARES, agents=_with(True, check_detects=0.5))
    sim, result, decisions = run(cfg, HOST_LOST)
    assert result.stats["checks:join:ok"] >= 8 + 4 and "checks:join:failed" not in result.stats
    envelopes = [r.envelope for r in sim.log.records() if getattr(r, "envelope", None) is not None]
    refused = [e.data for e in envelopes if e.type == "command.ack" and e.data.status == "failed"]
    spare_checks = [(e.node, e.data.ok) for e in envelopes if e.type == "node.checked" and e.data.when == "spare"]
    assert [ok for _, ok in spare_checks] == [False, False, True]
    assert [a.reason for a in refused] == [f"health checks failed on {node}" for node, ok in spare_checks if not ok]
    moves = [c for d in decisions for c in d.commands if c.kind == "migrate_ranks"]
    assert [m.to_node for m in moves] == [node for node, _ in spare_checks]
    assert result.landed_on_bad == 0 and "latent_faults" not in result.stats
    assert result.job_state == "running" and result.recoveries == 1
    result.check()


def test_checks_add_only_what_is_left_of_them_after_the_stop() -> None:
    device = [fault("device", 3600.0, position=1, code="79")]  # a pod-level move after a 2 s kill of the node
    base = config(days=0.1, seed=0)
    _, off, _ = run(base, device)
    for check_s, added in ((0.5, 0.0), (10.0, 10.0 - 2.05)):  # the kill: 2 s, acked 0.05 s after it was sent
        _, on, _ = run(replace(base, agents=_with(True), costs=replace(base.costs, check_s=check_s)), device)
        assert on.check_added_s == [pytest.approx(added)]
        assert on.faults[0].ttr_s == pytest.approx(off.faults[0].ttr_s + added)  # type: ignore[operator]
        assert on.lost_s["rescheduling"] == pytest.approx(off.lost_s["rescheduling"] + added)
        on.check()


def test_a_run_with_checks_is_deterministic_and_replays_to_the_same_decisions(tmp_path: Path) -> None:
    cluster = replace(SMALL, latent_after_repair=0.5, latent_spares=0.5)
    cfg = config(days=1.0, seed=5, rate_per_gpu_hour=3e-3, cluster=cluster, agents=_with(True), costs=Costs())
    paths = []
    for name in ("a", "b"):
        sim = Simulator(cfg)
        sim.run()
        paths.append(tmp_path / f"{name}.jsonl")
        sim.write_log(paths[-1])
    assert paths[0].read_bytes() == paths[1].read_bytes()
    again = replay(list(sim.log.records()))
    assert again.decisions == again.recorded_decisions
    assert any(r.envelope.type == "node.checked" for r in sim.log.records() if getattr(r, "envelope", None))


def test_the_new_parameters_change_nothing_while_latent_shares_are_zero_and_checks_off(tmp_path: Path) -> None:
    base = config(days=1.0, seed=7, rate_per_gpu_hour=3e-3, costs=Costs())
    inert = replace(base, agents=Agents(health_checks=False, check_detects=0.3),
                    costs=replace(base.costs, check_s=30.0),
                    durations=replace(base.durations, latent_work_s=(1.0, 2.0)))
    logs = []
    for cfg in (base, inert):
        sim = Simulator(cfg)
        sim.run()
        logs.append(tmp_path / f"{len(logs)}.jsonl")
        sim.write_log(logs[-1])
    assert logs[0].read_bytes() == logs[1].read_bytes()


def test_a_latent_device_faults_only_after_the_job_trained_on_it_long_enough() -> None:
    # a repair that never holds, and a device that needs 600 s of training: the stretch before a checkpoint's stall
    # counts, the stall does not
    cluster = replace(SMALL, spare_nodes=0, latent_after_repair=1.0)
    faults = [fault("node", 600.0, position=1, repair_ns=600 * NS)]
    cfg = config(days=0.1, seed=2, cluster=cluster,
                 durations=replace(Durations(), latent_work_s=(600.0, 600.0)))
    _, result, _ = run(cfg, faults)
    [latent] = [f for f in result.faults if f.index >= LATENT_INDEX]
    first = result.faults[0].recovered_s
    assert first is not None
    # the job resumed on the repaired node (no spare) and trained 600 s there, plus the stalls of the persistent
    # checkpoints (every 600 s of training, 1.8 s each) and the first step before its recovery was closed
    assert 600 - 6 <= latent.at_s - first <= 600 + 2 * 1.8 + 6
    assert result.landed_on_bad == 1

"""Latent bad hardware and the node agents' health checks in the simulator (recovery/sim/health.py): a recovery that
lands on a node with a latent bad device is followed by a second fault; with checks the node is found first and the
recovery goes elsewhere; runs with checks are deterministic and replay to the same decisions; with the new parameters
off a run is what it was."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from recovery.log.recorder import replay
from recovery.sim import Agents, Costs, Durations, Simulator
from recovery.sim.config import NS
from recovery.sim.health import LATENT_INDEX
from recovery.sim.sim import EPOCH
from tests.test_sim import RELIABLE, SMALL, config, fault, run

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
    assert {e.data.when for e in checks} == {"join"}  # the granted spare's pass was fresh: its gate ran nothing
    failed = [e for e in checks if not e.data.ok]
    assert len(failed) == 3 and all(e.data.when == "join" for e in failed)
    assert len({e.node for e in failed}) == 3


def _envelopes(sim: Simulator) -> list[tuple[float, Any]]:
    """(seconds into the run, envelope) of every record the run logged."""
    return [((r.ts - EPOCH) / NS, r.envelope) for r in sim.log.records() if getattr(r, "envelope", None) is not None]


def test_an_idle_spare_the_join_checks_missed_is_found_by_a_refresh_before_it_is_granted() -> None:
    # each run of the checks finds a latent device with probability 1/2: on seed 3 the join checks miss all three
    # latent spares; their agents run the checks again every check_fresh_s / 2 while the spares are idle
    agents = _with(True, check_detects=0.5)
    sim, result, decisions = run(config(days=0.25, seed=3, cluster=LATENT_SPARES, agents=agents), HOST_LOST)
    assert result.stats["checks:join:ok"] >= 8 + 4 and "checks:join:failed" not in result.stats
    envelopes = _envelopes(sim)
    refreshes = [(t, e) for t, e in envelopes if e.type == "node.checked" and e.data.when == "spare"]
    assert len(refreshes) == 3 and not any(e.data.ok for _, e in refreshes)  # only a failing refresh is logged
    assert all((t - 0.5) % 150.0 == 0.0 and t < 3600.0 for t, _ in refreshes)  # every 300 s / 2, 0.5 s each
    assert not [e for _, e in envelopes if e.type == "command.ack" and e.data.status == "failed"]
    [move] = [c for d in decisions for c in d.commands if c.kind == "migrate_ranks"]
    assert move.to_node not in {e.node for _, e in refreshes}
    assert result.landed_on_bad == 0 and "latent_faults" not in result.stats
    assert result.check_added_s == [0.0]  # a grant waits for nothing: the spare's pass was fresh
    result.check()
    # without the refreshes the same seed moves the ranks onto a latent spare the join checks missed
    stale = _with(True, check_detects=0.5, check_fresh_s=1e9)
    _, unrefreshed, _ = run(config(days=0.25, seed=3, cluster=LATENT_SPARES, agents=stale), HOST_LOST)
    assert unrefreshed.landed_on_bad >= 1


def test_a_software_fault_restart_waits_for_no_check() -> None:
    crash = [fault("process", 3600.0, position=1)]
    base = config(days=0.1, seed=0)
    _, off, _ = run(base, crash)
    sim, on, _ = run(replace(base, agents=_with(True), costs=replace(base.costs, check_s=100.0)), crash)
    assert on.check_added_s == [0.0] and on.faults[0].ttr_s == off.faults[0].ttr_s
    assert not [e for _, e in _envelopes(sim) if e.type == "node.checked" and e.data.when != "join"]
    on.check()


def test_a_device_fault_restart_waits_only_for_what_outlasts_detection_stop_and_reset() -> None:
    # an XID 48 with no spare: the engine resets the device and restarts in place; the agent ran its checks at the
    # XID and once more after its follow-up (XID 63, a second later), while the engine detected, waited and stopped
    device = [fault("device", 3600.0, position=1, code="48")]
    base = config(days=0.1, seed=0, cluster=replace(SMALL, spare_nodes=0))
    _, off, _ = run(base, device)
    for check_s in (100.0, 190.0):
        sim, on, _ = run(replace(base, agents=_with(True), costs=replace(base.costs, check_s=check_s)), device)
        envelopes = _envelopes(sim)
        runs = [t for t, e in envelopes if e.type == "node.checked" and e.data.when == "fault" and e.node == "n00001"]
        assert runs == [3600.0 + check_s, 3600.0 + 2 * check_s]
        sent = [t - base.costs.ack_latency_s for t, e in envelopes
                if e.type == "command.ack" and e.data.status == "accepted"]
        gate = sent[-1] + base.costs.ack_latency_s + base.costs.device_reset_s  # the restart's ranks start after
        added = max(0.0, runs[-1] - gate)
        assert on.check_added_s == [pytest.approx(added)] and (added > 0) == (check_s == 190.0)
        assert on.lost_s["rescheduling"] == pytest.approx(off.lost_s["rescheduling"] + added)
        on.check()


def test_a_restart_that_waits_for_checks_that_find_a_latent_device_is_refused() -> None:
    # a repair that did not hold, missed by the join checks; an XID 48 on another device of the node: the engine
    # resets it and restarts in place, and the gate waits for the checks the XID started, which find the bad device
    cluster = replace(SMALL, spare_nodes=0, latent_after_repair=1.0)
    faults = [fault("node", 600.0, position=1, repair_ns=600 * NS), fault("device", 2400.0, position=1, code="48")]
    cfg = config(days=0.1, seed=2, cluster=cluster, agents=_with(True, check_detects=0.5),
                 durations=replace(Durations(), latent_work_s=(3000.0, 3000.0)),
                 costs=replace(RELIABLE, check_s=200.0))
    sim, result, decisions = run(cfg, faults)
    envelopes = _envelopes(sim)
    checks = [(t, e.data.when, e.data.ok) for t, e in envelopes if e.type == "node.checked" and e.node == "n00001"]
    assert checks[1:4] == [(1400.0, "join", True), (2600.0, "fault", True), (2800.0, "fault", False)]
    refusals = [(t, e.data) for t, e in envelopes if e.type == "command.ack" and e.data.status == "failed"]
    [(refused_at, refused)] = refusals
    assert refused.reason == "health checks failed on n00001" and refused_at == 2800.0  # after the run it waited for
    assert [c.kind for d in decisions for c in d.commands][-1] == "restart_ranks"
    assert result.stats["restart_ranks:refused"] == 1
    result.check()


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

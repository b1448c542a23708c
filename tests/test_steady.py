"""The records of the steady state (`recovery.core.steady`: a rank's heartbeat or step, a checkpoint nothing waits for)
are applied in place rather than the general way. Either way must give the same effects and the same engine, record
by record: the logs here are replayed twice, once with the steady way declining every record, and the two engines
compared after each record (their effects) and every few hundred records (their whole pickled state)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path

import pytest

import recovery.core.engine as engine_module
from events.envelope import RawRecord, Record
from recovery.core.engine import Engine
from recovery.core.steady import steady
from recovery.log import iter_file
from recovery.sim import PROFILES, Cluster, SimConfig, Simulator, Training
from tests.golden.scenarios import SCENARIOS, path

STATE_EVERY = 200


def _general(*_: object) -> bool:
    return False


def apply_generally(engine: Engine, record: Record | RawRecord) -> list[object]:
    engine_module.steady = _general  # type: ignore[assignment]
    try:
        return list(engine.apply(record))
    finally:
        engine_module.steady = steady


def assert_same_both_ways(records: Iterable[Record | RawRecord]) -> int:
    """Replay `records` both ways; return how many the steady way took."""
    taken = 0

    def counting(*args: object) -> bool:
        nonlocal taken
        applied = steady(*args)  # type: ignore[arg-type]
        taken += applied
        return applied

    in_place, general = Engine(), Engine()
    for n, record in enumerate(records, 1):
        engine_module.steady = counting  # type: ignore[assignment]
        try:
            effects = list(in_place.apply(record))
        finally:
            engine_module.steady = steady
        assert effects == apply_generally(general, record), f"record {record.seq}"
        if n % STATE_EVERY == 0:
            assert pickle.dumps(in_place) == pickle.dumps(general), f"state after record {record.seq}"
    assert pickle.dumps(in_place) == pickle.dumps(general)
    return taken


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_golden_log_gives_the_same_engine_either_way(name: str) -> None:
    assert_same_both_ways(iter_file(path(name)))


def test_a_simulated_run_with_faults_gives_the_same_engine_either_way(tmp_path: Path) -> None:
    config = SimConfig(cluster=Cluster(gpus=64, tp=8, pp=2, nodes_per_switch=4, spare_nodes=2),
                       training=Training(params=8e9, storage_every_s=600), days=0.5, seed=5, rate_per_gpu_hour=2e-2,
                       profile=PROFILES["default"])
    sim = Simulator(config)
    sim.run()
    log = tmp_path / "sim.jsonl"
    sim.write_log(log)
    taken = assert_same_both_ways(iter_file(log))
    assert taken > 100  # the run's heartbeats, steps and checkpoints did take the steady way

"""When the daemon snapshots: after `snapshot_every_records` inputs or `snapshot_every_s`, or after a tenth of each
(a burst), so that a partition taken over after a fleet's first words does not replay them all."""

from __future__ import annotations

import time

from recovery.core.engine import Engine
from recovery.service.http import Metrics
from recovery.service.snapshots import BURST_SHARE, Snapshotter


async def _no_retry(*_: object) -> None:
    raise AssertionError("nothing is uploaded here")


def due(snapshots: Snapshotter, engine: Engine, records: int, age_s: float) -> bool:
    """Is a snapshot captured after `records` inputs, `age_s` after the last one?"""
    engine.last_seq += records
    snapshots.records_since, snapshots.written = records, time.monotonic() - age_s
    snapshots.maybe(engine, engine.last_seq, 0, active=True)
    if not snapshots._uploading:
        return False
    assert snapshots._receive.receive_nowait().seq == engine.last_seq and snapshots.records_since == 0
    snapshots._uploading, snapshots.seq = False, engine.last_seq
    return True


def test_a_snapshot_is_due_after_the_records_or_the_period_or_a_tenth_of_both() -> None:
    every, every_s = 1000, 60.0
    snapshots = Snapshotter(None, every, every_s, False, Metrics(), _no_retry, time.monotonic())  # type: ignore[arg-type]
    engine = Engine()
    share, period_share = every // BURST_SHARE, every_s / BURST_SHARE
    assert not due(snapshots, engine, every - 1, 1.0)  # neither enough records nor time for the steady rule
    assert due(snapshots, engine, every, 0.0)  # the records
    assert due(snapshots, engine, 1, every_s)  # the period
    assert not due(snapshots, engine, share - 1, every_s - 1)  # a burst is a tenth of the records ...
    assert not due(snapshots, engine, share, period_share - 1)  # ... and a tenth of the period
    assert due(snapshots, engine, share, period_share)
    assert not due(snapshots, engine, 0, every_s)  # nothing new: nothing to save

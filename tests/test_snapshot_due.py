"""When the daemon snapshots: after `snapshot_every_records` inputs, or a tenth of them before its first snapshot,
so that a partition taken over soon after a fleet's first words does not replay them all."""

from __future__ import annotations

import time

from recovery.core.engine import Engine
from recovery.service.http import Metrics
from recovery.service.snapshots import FIRST_SHARE, Snapshotter


async def _no_retry(*_: object) -> None:
    raise AssertionError("nothing is uploaded here")


def test_the_first_snapshot_comes_after_a_tenth_of_the_records_the_next_after_all_of_them() -> None:
    every = 1000
    snapshots = Snapshotter(None, every, 3600.0, False, Metrics(), _no_retry, time.monotonic())  # type: ignore[arg-type]
    engine = Engine()
    engine.last_seq = 500
    snapshots.records_since = every // FIRST_SHARE - 1
    snapshots.maybe(engine, engine.last_seq, 0, active=True)
    assert not snapshots._uploading  # one record short of the first one's share
    snapshots.records_since += 1
    snapshots.maybe(engine, engine.last_seq, 0, active=True)
    assert snapshots._uploading and snapshots.records_since == 0  # captured, handed to the upload
    assert snapshots._receive.receive_nowait().seq == 500
    # once one is written, the next waits for `every` records
    snapshots._uploading = False
    snapshots.seq, snapshots.manifest, snapshots.written = 500, {"seq": 500}, time.monotonic()
    engine.last_seq = 2000
    snapshots.records_since = every - 1
    snapshots.maybe(engine, engine.last_seq, 0, active=True)
    assert not snapshots._uploading
    snapshots.records_since = every
    snapshots.maybe(engine, engine.last_seq, 0, active=True)
    assert snapshots._uploading

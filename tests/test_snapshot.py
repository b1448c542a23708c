"""A snapshot taken mid-log, restored and fed the rest, decides exactly what a full replay decides."""

from __future__ import annotations

import pytest

from recovery.engine import SNAPSHOT_FORMAT, Engine, dump_snapshot, load_snapshot, snapshot_seq
from recovery.log import iter_file
from recovery.recorder import replay
from tests.golden.scenarios import path


@pytest.mark.parametrize("name", ["recover_in_place_fallback", "elastic_scale", "memory_checkpoint_lost"])
def test_restored_snapshot_continues_like_a_full_replay(name: str) -> None:
    records = list(iter_file(path(name)))
    full = replay(records)
    for cut in (len(records) // 3, len(records) // 2, 2 * len(records) // 3):
        head = replay(records[:cut])
        blob = dump_snapshot(head.engine)
        assert snapshot_seq(blob) == head.engine.last_seq
        restored = load_snapshot(blob)
        assert restored is not None
        tail = replay(records[cut:], engine=restored)
        assert head.decisions + tail.decisions == full.decisions
        assert restored.snapshot() == full.engine.snapshot()


def test_snapshot_from_other_code_is_refused() -> None:
    blob = dump_snapshot(Engine())
    head, _, body = blob.partition(b"\n")
    assert load_snapshot(head.replace(f'"format":{SNAPSHOT_FORMAT}'.encode(), b'"format":0') + b"\n" + body) is None
    assert load_snapshot(b"garbage\n") is None


"""A snapshot taken mid-log, restored and fed the rest, decides exactly what a full replay decides."""

from __future__ import annotations

import pytest

from policies.rescheduling import LadderRescheduling
from recovery.core.engine import Engine
from recovery.log import iter_file
from recovery.log.recorder import replay
from recovery.log.snapshot import SNAPSHOT_FORMAT, dump_snapshot, load_snapshot, open_snapshot, snapshot_seq
from tests.golden.scenarios import path


@pytest.mark.parametrize("name", ["recover_in_place_fallback", "elastic_scale", "memory_checkpoint_lost",
                                  "fsdp_scale_in"])
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



def test_a_snapshot_is_not_restored_when_a_jobs_policy_changed_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plugins are not in the code digest: the snapshot names every policy its jobs hold, and a job whose installed
    policy has another version since makes the daemon replay from the log instead."""
    engine = replay(iter_file(path("pod_level_reschedule"))).engine
    blob = dump_snapshot(engine)
    assert b'"policies":["default@' in blob.partition(b"\n")[0]
    assert isinstance(open_snapshot(blob), Engine)
    monkeypatch.setattr(LadderRescheduling, "version", "999")
    refused = open_snapshot(blob)
    assert isinstance(refused, str) and "rescheduling policy ladder@" in refused and "ladder@999" in refused
    assert load_snapshot(blob) is None

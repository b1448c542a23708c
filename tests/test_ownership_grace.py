"""After the lease bucket was away (a server lost), every member's keys lapsed at once: a daemon takes another's
partitions only once that one had a lease TTL to renew its own, so that a server's loss does not move every
partition to whichever daemon balanced first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats.js.errors
import orjson

from recovery.service import config as config_mod
from recovery.service.ownership import Ownership, member_key

P = 4
TTL_S = 5.0


class Bucket:
    """The lease bucket as a balance reads it: this member's key, and no partition's lease (every one lapsed)."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        self.keys[key] = value

    async def create(self, key: str, value: bytes) -> int:
        if key in self.keys:
            raise nats.js.errors.KeyWrongLastSequenceError
        self.keys[key] = value
        return len(self.keys)

    async def get(self, key: str) -> Any:
        if key not in self.keys:
            raise nats.js.errors.KeyNotFoundError
        return SimpleNamespace(value=self.keys[key])

    async def stream_info(self, name: str, subjects_filter: str) -> Any:
        prefix = subjects_filter[:-1]
        return SimpleNamespace(state=SimpleNamespace(subjects={
            f"$KV.RECOVERY_LEASES.{key}": 1 for key in self.keys if f"$KV.RECOVERY_LEASES.{key}".startswith(prefix)}))


def ownership(tmp_path: Path, bucket: Bucket, clock: list[float], taken: list[int]) -> Ownership:
    cfg = config_mod.load(nats_url="nats://127.0.0.1:4222", data_dir=tmp_path, partitions=P, lease_ttl_s=TTL_S)
    owner = Ownership(cfg)
    owner._kv = bucket  # type: ignore[assignment]
    owner._clock = lambda: clock[0]
    owner._start_worker = lambda group, index: taken.append(index)  # type: ignore[method-assign]
    return owner


async def test_free_partitions_wait_a_ttl_after_the_bucket_came_back_and_not_at_a_fresh_start(tmp_path: Path) -> None:
    bucket, clock, taken = Bucket(), [100.0], []
    owner = ownership(tmp_path, bucket, clock, taken)
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == list(range(P))  # a daemon that saw no outage takes what is free at once
    assert orjson.loads(bucket.keys[member_key(owner.instance)])["instance"] == owner.instance

    taken.clear()
    owner._kv_back = None  # a balance failed: the bucket was away
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == []  # back now: the others' keys lapsed with ours, and they get a TTL to renew them
    clock[0] += TTL_S - 0.1
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == []
    clock[0] += 0.1
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == list(range(P))  # nobody renewed them within a TTL: free

"""After the lease bucket was away (a server lost), every member's keys lapsed at once: a daemon takes another's
partitions only once that one had a lease TTL to renew its own, so that a server's loss does not move every
partition to whichever daemon balanced first. A dead member's keys count as gone once they are a TTL old by the
server's clock, before the server removes them, and the balance looks again when the next one lapses."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import nats.js.errors
import orjson
import pytest

from recovery.service import config as config_mod
from recovery.service.ownership import WAKE_AFTER_LAPSE_S, Ownership, member_key, read_stamped
from recovery.testing.nats import NatsServer

P = 4
TTL_S = 5.0


class Bucket:
    """The lease bucket as a balance reads it: its keys, each with its revision and the time the server stored it
    (`server`: the server's clock, the test's clock plus an offset; None: a server that tells no time)."""

    def __init__(self, clock: list[float] | None = None, offset_s: float = 1_000.0) -> None:
        self.keys: dict[str, bytes] = {}
        self.stored: dict[str, tuple[int, float | None]] = {}
        self.clock, self.offset_s, self.revision = clock, offset_s, 0

    def _store(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.keys[key] = value
        self.stored[key] = (self.revision, None if self.clock is None else self.clock[0] + self.offset_s)
        return self.revision

    async def put(self, key: str, value: bytes) -> int:
        return self._store(key, value)

    async def create(self, key: str, value: bytes) -> int:
        if key in self.keys:
            raise nats.js.errors.KeyWrongLastSequenceError
        return self._store(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if key not in self.keys or self.stored[key][0] != last:
            raise nats.js.errors.KeyWrongLastSequenceError
        return self._store(key, value)

    async def get_msg(self, stream: str, subject: str) -> Any:
        key = subject[len("$KV.RECOVERY_LEASES."):]
        if key not in self.keys:
            raise nats.js.errors.NotFoundError
        revision, at = self.stored[key]
        return SimpleNamespace(data=self.keys[key], headers=None, seq=revision,
                               time=None if at is None else datetime.fromtimestamp(at, tz=UTC))

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


async def test_a_dead_members_keys_are_gone_a_ttl_after_their_last_write_by_the_servers_clock(tmp_path: Path) -> None:
    """Another member wrote its key and took every partition; it writes nothing more (dead). Until its keys are a TTL
    old by the server's time (which this member's own fresh key tells: the clocks differ by 1,000 s here) they are
    its, and the next look is due at their lapse; once a TTL old they are taken, by revision, though the server
    has not removed them yet."""
    clock = [100.0]
    bucket = Bucket(clock)
    other = "daemon-dead"
    await bucket.put(member_key(other), orjson.dumps({"instance": other}))
    for k in range(P):
        await bucket.create(f"default-{k}", orjson.dumps({"instance": other, "token": "t"}))
    taken: list[int] = []
    owner = ownership(tmp_path, bucket, clock, taken)
    clock[0] += 1.0
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner.members == sorted([other, owner.instance]) and owner.target == P // 2 and taken == []
    assert abs(owner._next_look() - owner.period_s) < 1e-9  # the lapse is 4 s off: a period
    clock[0] += TTL_S - 1.0 - 0.3  # 0.3 s before the dead member's keys lapse
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == []
    assert owner._next_look() == pytest.approx(0.3 + WAKE_AFTER_LAPSE_S)
    clock[0] += 0.3
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner.members == [owner.instance] and taken == list(range(P))
    assert all(orjson.loads(bucket.keys[f"default-{k}"])["instance"] == owner.instance for k in range(P))


async def test_a_lease_renewed_within_its_ttl_is_not_taken_whatever_its_members_key_says(tmp_path: Path) -> None:
    """A member whose key lapsed (its balance stalled) but whose partitions' daemons still renew their leases:
    its partitions stay its own until their leases lapse too, and the look is due then."""
    clock = [100.0]
    bucket = Bucket(clock)
    other = "daemon-stalled"
    await bucket.put(member_key(other), orjson.dumps({"instance": other}))
    taken: list[int] = []
    owner = ownership(tmp_path, bucket, clock, taken)
    clock[0] += TTL_S + 0.1
    for k in range(P):  # renewed just now
        await bucket.create(f"default-{k}", orjson.dumps({"instance": other, "token": "t"}))
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner.members == [owner.instance] and taken == []
    assert owner._next_look() == pytest.approx(owner.period_s)  # TTL off
    clock[0] += TTL_S - 0.2
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert taken == [] and owner._next_look() == pytest.approx(0.2 + WAKE_AFTER_LAPSE_S)


async def test_keys_read_from_a_real_server_carry_the_time_they_were_stored(nats_server: NatsServer) -> None:
    """What `read_stamped` reads of a live bucket: the value, its revision, the server's time of the write; a
    deleted key or one never written is None."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="RECOVERY_LEASES", history=1, ttl=TTL_S)
        before = time.time()
        revision = await kv.put("members.a", orjson.dumps({"instance": "a"}))
        entry = await read_stamped(js, "RECOVERY_LEASES", "members.a")
        assert entry is not None and entry.value == {"instance": "a"} and entry.revision == revision
        assert entry.stored_s is not None and before - 1.0 < entry.stored_s < time.time() + 1.0
        await kv.delete("members.a")
        assert await read_stamped(js, "RECOVERY_LEASES", "members.a") is None
        assert await read_stamped(js, "RECOVERY_LEASES", "members.b") is None
    finally:
        await nc.close()

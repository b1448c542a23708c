"""A takeover read ahead while the partition's owner is only suspected dead (`recovery.service.prefetch`): each
survivor predicts the same split, reads its own share ahead and leaves the others' to them; the worker that takes
the lease restores from what was read ahead only if the snapshot it opened is still the newest, and ends in the
state an offline replay of the partition's log gives either way. Real nats-server for the restores."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec, Layout
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log import MSG_ID
from recovery.log.partitions import partition_log
from recovery.log.recorder import replay
from recovery.service import config as config_mod
from recovery.service import ownership as ownership_mod
from recovery.service.daemon import Daemon
from recovery.service.demo import DEMO_POLICIES
from recovery.service.ownership import Ownership, fair_share, member_key
from recovery.service.prefetch import Prefetch, predict
from recovery.service.restore import in_own_thread
from recovery.testing.nats import NatsServer
from tests.daemon_support import async_wait_for, connect, read_stream, state_view
from tests.test_ownership_grace import Bucket

TTL_S = 5.0


def share(count: int) -> Any:
    return lambda members, me: fair_share(members, me, count)


def test_every_survivor_predicts_the_same_split_and_its_own_take_exactly() -> None:
    members = ["a", "b", "c", "d"]
    held = [1, 4, 6]  # d's, in index order
    # 12 partitions over a, b, c, d: 3 each; without d, 4 each: each of a, b, c takes one more
    views = {me: predict(members, ["d"], me, held, 3, share(12)) for me in "abc"}
    assert views["a"] == views["b"] == views["c"] == {1: "a", 4: "b", 6: "c"}
    # one that serves less than its share takes on after its stride, in the take's order
    assert predict(members, ["d"], "b", held, 2, share(12)) == {4: "b", 1: "b", 6: "c"}
    # one that wants less leaves the rest of its stride to anyone
    assert predict(members, ["d"], "a", [1, 4, 6, 9], 3, share(12)) == {1: "a", 4: "b", 6: "c"}
    assert predict(members, ["d"], "d", held, 0, share(12)) == {}  # a suspect predicts nothing for itself
    assert predict(members, ["d"], "a", [], 3, share(12)) == {}


class Fetches:
    """`Prefetch` as the ownership makes it, recorded: which partitions were read ahead, which cancelled."""

    def __init__(self) -> None:
        self.begun: list[int] = []
        self.cancelled: list[int] = []

    def __call__(self, nc: Any, js: Any, cfg: Any, index: int, stopping: Any) -> Any:
        self.begun.append(index)
        return SimpleNamespace(index=index, stale=lambda ttl: False, cancel=lambda: self.cancelled.append(index))


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> Fetches:
    made = Fetches()
    monkeypatch.setattr(ownership_mod, "Prefetch", made)
    return made


async def write(bucket: Bucket, member: str, partitions: list[int], key: bool = True) -> None:
    """`member` renews its membership (unless `key` is False) and its partitions' leases now."""
    if key:
        await bucket.put(member_key(member), orjson.dumps({"instance": member}))
    for k in partitions:
        await bucket.put(f"default-{k}", orjson.dumps({"instance": member, "token": member}))


def worker() -> Any:
    """A partition's daemon, active and ready, as a balance sees it."""
    d = SimpleNamespace(stopping=False, role="active", lease=None, readiness=lambda: (True, {}))
    d.request_stop = lambda: setattr(d, "stopping", True)
    return d


def survivor(tmp_path: Path, bucket: Bucket, clock: list[float], serving: list[int],
             taken: list[tuple[int, Any]]) -> Ownership:
    """Member b of a, b, c with 6 partitions, serving `serving`; a take is recorded with what was read ahead."""
    cfg = config_mod.load(nats_url="nats://127.0.0.1:4222", data_dir=tmp_path, partitions=6, lease_ttl_s=TTL_S,
                          instance="b")
    owner = Ownership(cfg)
    owner._kv = bucket  # type: ignore[assignment]
    owner._clock = lambda: clock[0]
    owner.nc = object()  # type: ignore[assignment]
    owner.workers = {k: worker() for k in serving}  # type: ignore[misc]

    def start(group: Any, index: int) -> None:
        taken.append((index, owner._prefetches.pop(index, None)))
        owner.workers[index] = worker()  # type: ignore[assignment]

    owner._start_worker = start  # type: ignore[method-assign]
    return owner


async def test_a_suspects_partitions_are_read_ahead_and_taken_as_predicted_though_their_leases_lapse_apart(
        tmp_path: Path, fetches: Fetches) -> None:
    """c dies holding 4 and 5: its key is written at 100, its lease of 4 at 100 and of 5 at 100.8. b reads 5 ahead
    (its stride of [4, 5]), leaves 4 to a, and takes 5 once it lapses, not 4 which lapsed first."""
    clock = [100.0]
    bucket = Bucket(clock)
    await write(bucket, "a", [0, 1])
    await write(bucket, "c", [4])
    clock[0] = 100.8
    await write(bucket, "c", [5], key=False)
    taken: list[tuple[int, Any]] = []
    owner = survivor(tmp_path, bucket, clock, [2, 3], taken)
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner._suspects == {} and fetches.begun == [] and taken == []
    clock[0] = 103.1  # c's key is 3.1 s old: suspect (0.6 TTL)
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert sorted(owner._suspects) == ["c"] and owner.target == 2 and taken == []
    assert fetches.begun == [5] and owner._theirs[4][0] == "a"
    clock[0] = 105.0  # c's key and its lease of 4 lapse; 5's in 0.8 s
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner.members == ["a", "b"] and owner.target == 3
    assert taken == []  # 4 is free, but a's: a takes it with what it read ahead
    clock[0] = 105.8
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert [(k, ahead.index) for k, ahead in taken] == [(5, 5)]
    assert fetches.cancelled == []  # taken, not thrown away
    # a never took 4 (it died too, or is slow): once the grace after 4's lapse is over, anyone takes it
    owner.workers[2].stopping = True  # handed over: b wants one more
    clock[0] = 105.9
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert [k for k, _ in taken] == [5]
    clock[0] = 106.05
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert [(k, ahead) for k, ahead in taken] == [(5, taken[0][1]), (4, None)]


async def suspected(tmp_path: Path, at: float) -> tuple[Ownership, Bucket, list[float], list[tuple[int, Any]]]:
    """b's balance at `at`, c (holding 4 and 5) silent since 100 and a renewing: (b, the bucket, the clock, b's
    takes)."""
    clock = [100.0]
    bucket = Bucket(clock)
    await write(bucket, "a", [0, 1])
    await write(bucket, "c", [4, 5])
    taken: list[tuple[int, Any]] = []
    owner = survivor(tmp_path, bucket, clock, [2, 3], taken)
    clock[0] = at
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    return owner, bucket, clock, taken


async def test_a_suspect_that_renews_again_has_its_read_ahead_cancelled(tmp_path: Path, fetches: Fetches) -> None:
    owner, bucket, clock, taken = await suspected(tmp_path, 103.2)
    assert fetches.begun == [5]
    clock[0] = 103.7  # c was only slow: it renews everything
    await write(bucket, "a", [0, 1])
    await write(bucket, "c", [4, 5])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner._suspects == {} and fetches.cancelled == [5] and owner._prefetches == {} and taken == []
    registry = owner.metrics.registry
    counted = {outcome: registry.get_sample_value("recovery_takeover_prefetches_total", {"outcome": outcome})
               for outcome in ("begun", "dropped")}
    assert counted == {"begun": 1.0, "dropped": 1.0}  # what `/metrics` tells a platform engineer of false suspicions


# -- restores from a prefetch, on a real server ------------------------------------------------------------------
P = 2


def job_in(partition: int) -> str:
    return next(name for name in (f"job{i}" for i in range(100)) if subjects.partition_of(name, P) == partition)


async def publish(js: Any, job: str, kind: str, data: dict[str, Any], ident: str) -> int:
    envelope = make_envelope(kind, data, id=ident, job=job, source="test")
    return (await js.publish(subjects.job_event(job, kind), encode_envelope(envelope), headers={MSG_ID: ident})).seq


@contextlib.asynccontextmanager
async def partition_daemon(cfg: config_mod.DaemonConfig, prefetched: Prefetch | None = None
                           ) -> AsyncIterator[Daemon]:
    daemon = Daemon(cfg, Partition(0, P))
    daemon.prefetched = prefetched
    async with daemon.running():
        await async_wait_for(lambda: daemon.readiness()[0] or daemon.failed, 60, "the partition to be ready")
        assert not daemon.failed
        yield daemon


async def a_partition_with_a_backlog(url: str, tmp_path: Path) -> tuple[config_mod.DaemonConfig, str, int]:
    """Partition 0's job submitted and started, applied and snapshotted by a daemon that stopped; then a crash of
    one of its ranks in the log, which no daemon applied (the backlog of a takeover). The config, the job, the
    last input's sequence."""
    cfg = config_mod.load(nats_url=url, data_dir=tmp_path / "first", http_port=-1, partitions=P, lease_ttl_s=2.0,
                          snapshot_every_s=3600.0, backlog_reader_at=1)
    job = job_in(0)
    spec = JobSpec.model_validate({"nodes": ["n0", "n1"], "ranks_per_node": 2, "layout": Layout(dp=4, tp=1, pp=1),
                                   "policies": DEMO_POLICIES})
    nc, js = await connect(url)
    try:
        async with partition_daemon(cfg) as first:
            await publish(js, job, "job.submitted", {"spec": spec.model_dump(mode="json")}, "submit")
            seq = await publish(js, job, "job.started", {}, "started")
            assert await first.wait_applied(seq, 30)
        last = await publish(js, job, "process.exited", {"rank": 1, "exit_code": 1}, "crash")
    finally:
        await nc.close()
    return cfg, job, last


async def replayed_state(url: str) -> tuple[dict[str, Any], list[str]]:
    """Partition 0's state as an offline replay of its log gives it, and the ids of the decisions stored."""
    records = await read_stream(url)
    result = replay(partition_log(records, Partition(0, P)), Engine(Partition(0, P)))
    ids = [r.headers.get(MSG_ID) for r in records if r.subject.startswith("recovery.dec.")]
    return state_view(result.engine.snapshot()), ids


async def read_ahead(nc: Any, js: Any, cfg: config_mod.DaemonConfig) -> Prefetch:
    """Partition 0's takeover read ahead, as a survivor does while the owner is suspected, and finished."""
    ahead = Prefetch(nc, js, cfg, 0, lambda: False)
    await asyncio.wait_for(asyncio.shield(ahead._task), 60)
    return ahead


async def test_a_takeover_restores_from_what_was_read_ahead_and_ends_where_a_replay_does(
        nats_server: NatsServer, tmp_path: Path) -> None:
    url = nats_server.url
    cfg, job, last = await a_partition_with_a_backlog(url, tmp_path)
    nc, js = await connect(url)
    try:
        ahead = await read_ahead(nc, js, cfg)
        assert ahead.newest is not None and ahead.newest[0].last_seq < last
        opened = ahead.newest[0]
        async with partition_daemon(cfg.model_copy(update={"data_dir": tmp_path / "second"}), ahead) as second:
            assert second.engine is opened  # the engine read ahead, not one opened again
            assert await second.wait_applied(last, 30)
            assert second.engine.jobs[job].state != "running"  # the crash in the backlog was acted on
            await async_wait_for(lambda: second.stored is None or not second.stored.pending, 30, "the scan to settle")
            state = state_view(second.engine.snapshot())
    finally:
        await nc.close()
    replayed, decisions = await replayed_state(url)
    assert state == replayed
    assert len(decisions) == len(set(decisions)) and len(decisions) >= 3  # accepted, started, and the crash's


async def test_a_read_ahead_of_a_snapshot_no_longer_the_newest_is_not_used(nats_server: NatsServer,
                                                                          tmp_path: Path) -> None:
    url = nats_server.url
    cfg, _, last = await a_partition_with_a_backlog(url, tmp_path)
    nc, js = await connect(url)
    try:
        ahead = await read_ahead(nc, js, cfg)
        assert ahead.newest is not None
        stale = ahead.newest[0]
        async with partition_daemon(cfg.model_copy(update={"data_dir": tmp_path / "between"})) as between:
            assert await between.wait_applied(last, 30)  # its stop writes a newer snapshot
        async with partition_daemon(cfg.model_copy(update={"data_dir": tmp_path / "second"}), ahead) as second:
            assert second.engine is not stale and second.restored_seq >= last
            state = state_view(second.engine.snapshot())
    finally:
        await nc.close()
    replayed, decisions = await replayed_state(url)
    assert state == replayed and len(decisions) == len(set(decisions))


async def test_a_suspects_lease_removed_on_its_lapse_leaves_the_predicted_split_as_it_was(
        tmp_path: Path, fetches: Fetches) -> None:
    """The server removes a lease once it expired, before the suspect's key lapses: the strides still run over every
    partition the suspect was seen holding, so b keeps to 5 (and takes it, its lease gone) and leaves 4 to a."""
    owner, bucket, clock, taken = await suspected(tmp_path, 103.1)
    assert fetches.begun == [5] and owner._theirs[4][0] == "a"
    del bucket.keys["default-5"]  # expired and removed
    clock[0] = 103.6
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert fetches.begun == [5] and fetches.cancelled == [] and owner._theirs[4][0] == "a"
    assert [k for k, _ in taken] == [5]  # its lease gone with the TTL: taken early, with what was read ahead


async def test_a_snapshot_opened_in_its_own_thread_leaves_no_thread_behind() -> None:
    """The open runs beside the loop and its thread is gone when it returns: the daemon forks its snapshots only while
    no other thread runs, and a pool's idle worker would have made every capture pickle in the loop."""
    before = threading.active_count()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    def busy(blob: bytes) -> int:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            pass
        return len(blob)

    ticker = asyncio.ensure_future(tick())
    try:
        assert await in_own_thread(busy, b"abc") == 3
    finally:
        ticker.cancel()
    assert ticks > 1  # the loop went on meanwhile
    assert threading.active_count() == before

    def broken(blob: bytes) -> int:
        raise ValueError(blob.decode())

    with pytest.raises(ValueError, match="damaged"):
        await in_own_thread(broken, b"damaged")
    assert threading.active_count() == before


async def test_a_suspects_lease_that_lapses_before_its_key_is_taken_early_and_counted_once_the_key_lapses(
        tmp_path: Path, fetches: Fetches) -> None:
    """c's leases were renewed at 100 and its key at 101: the leases lapse at 105, the key at 106. b takes its
    predicted 5 at 105, leaves 4 to a, and hands nothing over while c is still a member; were c to renew after all,
    5 would be the surplus b gives back."""
    clock = [100.0]
    bucket = Bucket(clock)
    await write(bucket, "a", [0, 1])
    await write(bucket, "c", [4, 5])
    clock[0] = 101.0
    await write(bucket, "c", [], key=True)
    taken: list[tuple[int, Any]] = []
    owner = survivor(tmp_path, bucket, clock, [2, 3], taken)
    for at in (104.2, 104.7):
        clock[0] = at
        await write(bucket, "a", [0, 1])
        await owner._balance(None, bucket)  # type: ignore[arg-type]
        assert sorted(owner._suspects) == ["c"] and taken == []
    assert fetches.begun == [5] and owner._next_look() == pytest.approx(0.3 + ownership_mod.WAKE_AFTER_LAPSE_S)
    clock[0] = 105.0  # the leases lapse, the key a second later
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert [k for k, _ in taken] == [5] and taken[0][1] is not None and owner.members == ["a", "b", "c"]
    clock[0] = 105.5
    await write(bucket, "a", [0, 1])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert not any(d.stopping for d in owner.workers.values()) and [k for k, _ in taken] == [5]
    clock[0] = 105.9  # c renews after all: 5 is one more than b's share of three
    await write(bucket, "a", [0, 1])
    await write(bucket, "c", [4])
    await owner._balance(None, bucket)  # type: ignore[arg-type]
    assert owner._suspects == {} and [k for k, d in owner.workers.items() if d.stopping] == [5]

"""Several active daemons: jobs spread over partitions by JetStream's `partition()` transform, each partition owned
by one daemon through its lease and fenced against a stale owner, spares granted by exactly one partition. Real
nats-server, real daemon processes.

The last test is the one the design answers to: 3 daemons, 64 jobs, one daemon SIGKILLed while incidents are open,
on a NATS cluster of three servers with every stream and bucket at three replicas (where a stream's leader refuses
a conditional write while another on the same subject is in flight, which a single server never does). Every
decision is made once, every partition's final state is what an offline replay of its log gives, and no spare is
granted by two partitions.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.js.errors
import orjson
import pytest
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from prometheus_client.parser import text_string_to_metric_families

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.outputs import Decision
from events.values import JobSpec, Layout
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log import MSG_ID, to_record
from recovery.log.partitions import partition_log
from recovery.log.pull import Delivery, PullReader
from recovery.log.recorder import replay
from recovery.log.snapshot import load_snapshot
from recovery.service import config as config_mod
from recovery.service.connection import retry
from recovery.service.consumer import BacklogAhead, InputReader, apply_backlog, read_backlog
from recovery.service.demo import DEMO_POLICIES, BuiltinCluster, Bus, DemoSettings
from recovery.service.fence import Fence, Fenced
from recovery.service.lease import Lease
from recovery.service.ownership import Ownership, fair_share
from recovery.service.publisher import Outgoing, Publisher
from recovery.service.snapshots import SnapshotStore
from recovery.service.streams import ensure_streams
from recovery.testing.nats import NatsCluster, NatsServer
from tests.daemon_support import DaemonProcess, async_wait_for, connect, dumps, read_stream, state_view

P = 4
TTL_S = 2.0


def partitioned_config(url: str, tmp_path: Path, **overrides: Any) -> config_mod.DaemonConfig:
    return config_mod.load(nats_url=url, data_dir=tmp_path, **{"partitions": P, "lease_ttl_s": TTL_S, **overrides})


def test_the_partition_hash_is_jetstreams() -> None:
    # JetStream's partition(4, 1) put these job ids into these partitions on a real server (FNV-1a, 32 bits).
    assert {job: subjects.partition_of(job, 4) for job in ("a", "b", "c", "job-7", "train-1")} == {
        "a": 0, "b": 1, "c": 2, "job-7": 0, "train-1": 3}
    assert subjects.unpartitioned("recovery.p.3.ev.job.train-1.process.exited") == \
        "recovery.ev.job.train-1.process.exited"
    assert subjects.unpartitioned("recovery.ev.node.n1.device.fault") == "recovery.ev.node.n1.device.fault"


def test_fair_shares_add_up_and_every_member_computes_the_same() -> None:
    for members in (["a"], ["a", "b"], ["a", "b", "c"], ["c", "a", "b", "d", "e"]):
        for count in (1, 4, 7, 64):
            shares = [fair_share(members, m, count) for m in members]
            assert sum(shares) == count and max(shares) - min(shares) <= 1


def test_each_spare_is_granted_by_exactly_one_partition() -> None:
    engines = [Engine(Partition(k, P)) for k in range(P)]
    spares = [f"spare{i}" for i in range(32)]
    for seq, node in enumerate(spares, start=1):
        envelope = make_envelope("node.joined", {"spare": True, "devices": 4}, id=f"join-{node}", node=node,
                                 source="scheduler")
        record = to_record(seq, seq, subjects.node_event(node, "node.joined"), {},
                           encode_envelope(envelope))
        for engine in engines:
            assert engine.apply(record) == []
    pools = [engine.cluster.free_spares() for engine in engines]
    assert sorted(node for pool in pools for node in pool) == sorted(spares)  # each spare in one pool
    assert all(pools)  # and every partition has some
    for k, pool in enumerate(pools):
        assert all(subjects.partition_of(node, P) == k for node in pool)
    assert Engine().partition is None  # one partition: every spare, as always


async def test_job_events_are_stored_in_their_partition_and_node_events_reach_every_partition(
        nats_server: NatsServer, tmp_path: Path) -> None:
    cfg = partitioned_config(nats_server.url, tmp_path)
    nc, js = await connect(nats_server.url)
    try:
        await ensure_streams(js, cfg, lambda op, what: retry(op, what, lambda: False))
        jobs = [f"job{i}" for i in range(12)]
        for job in jobs:
            await js.publish(subjects.job_event(job, "process.exited"), b"{}")
        await js.publish(subjects.node_event("n1", "device.fault"), b"{}")
    finally:
        await nc.close()
    records = await read_stream(nats_server.url)
    stored = [r.subject for r in records]
    assert stored[:-1] == [f"recovery.p.{subjects.partition_of(job, P)}.ev.job.{job}.process.exited" for job in jobs]
    assert stored[-1] == "recovery.ev.node.n1.device.fault"
    for k in range(P):
        mine = partition_log(records, Partition(k, P))
        assert [r.subject for r in mine] == [subjects.job_event(job, "process.exited") for job in jobs
                                             if subjects.partition_of(job, P) == k] + [stored[-1]]
    # the number of partitions is the log's: another count is refused at start, naming the key
    nc, js = await connect(nats_server.url)
    try:
        other = partitioned_config(nats_server.url, tmp_path, partitions=8)
        with pytest.raises(ValueError, match="partitions = 8"):
            await ensure_streams(js, other, lambda op, what: retry(op, what, lambda: False))
        with pytest.raises(ValueError, match="partitions = 8"):  # refused again: a refusal is never remembered
            await ensure_streams(js, other, lambda op, what: retry(op, what, lambda: False), once=True)
        # a partition taken over later in the same process asks the cluster nothing more of the same streams
        await ensure_streams(js, cfg, lambda op, what: retry(op, what, lambda: False), once=True)
        await js.delete_stream(cfg.command_stream)
        await ensure_streams(js, cfg, lambda op, what: retry(op, what, lambda: False), once=True)
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info(cfg.command_stream)  # not made again: this process had made sure of it
        await ensure_streams(js, cfg, lambda op, what: retry(op, what, lambda: False))  # a start checks, always
        assert (await js.stream_info(cfg.command_stream)).config.name == cfg.command_stream
    finally:
        await nc.close()


async def test_a_stale_owners_publishes_are_refused(nats_server: NatsServer, tmp_path: Path) -> None:
    cfg = partitioned_config(nats_server.url, tmp_path)
    nc, js = await connect(nats_server.url)
    try:
        await ensure_streams(js, cfg, lambda op, what: retry(op, what, lambda: False))
        old, new = Publisher(js), Publisher(js)
        old_fence = Fence(js, "default-0", "daemon-a", cfg.stream, cfg.command_stream)
        await old_fence.claim()
        old.fence = old_fence.headers
        decision = Outgoing(subjects.decision("job0"), b"{}", "d-1", "decision")
        command = Outgoing(subjects.command("n0", "job0", "restart_ranks"), b"{}", "c-1@n0", "command")
        assert len(await old.publish([decision, command])) == 2  # the owner's outputs are stored
        # another daemon takes the partition over (the old one, frozen, never saw its lease go)
        new_fence = Fence(js, "default-0", "daemon-b", cfg.stream, cfg.command_stream)
        await new_fence.claim()
        new.fence = new_fence.headers
        for late in (Outgoing(subjects.decision("job0"), b"{}", "d-2", "decision"),
                     Outgoing(subjects.command("n0", "job0", "restart_ranks"), b"{}", "c-2@n0", "command")):
            with pytest.raises(Fenced):
                await old.publish([late], deadline=time.monotonic() + 10)
        assert len(await new.publish([Outgoing(subjects.decision("job0"), b"{}", "d-2", "decision")])) == 1
        # another partition's fence is its own: its owner is not refused
        other = Fence(js, "default-1", "daemon-a", cfg.stream, cfg.command_stream)
        await other.claim()
        old.fence = other.headers
        assert len(await old.publish([Outgoing(subjects.decision("job1"), b"{}", "d-3", "decision")])) == 1
    finally:
        await nc.close()
    decisions = [r.headers.get(MSG_ID) for r in await read_stream(nats_server.url)
                 if r.subject.startswith("recovery.dec.")]
    assert decisions == ["d-1", "d-2", "d-3"]


async def test_of_two_daemons_reserving_one_free_partition_one_gets_it_and_its_worker_takes_the_lease_at_once(
        nats_server: NatsServer, tmp_path: Path) -> None:
    # Two survivors whose balances both found partition 2 free (its lease lapsed for one, not yet for the other):
    # the reservation decides at once, and the loser takes another one in the same balance.
    owners = [Ownership(partitioned_config(nats_server.url, tmp_path / name, instance=name)) for name in "ab"]
    nc, js = await connect(nats_server.url)
    try:
        for owner in owners:
            lease = Lease(js, owner.cfg.lease_bucket, "", owner.instance, TTL_S)
            await lease.ensure()
            owner._kv, owner._js = lease.kv, js
        a, b = owners
        key = a.cfg.partition_key(2)
        assert await a._reserve(2)
        assert not await b._reserve(2)
        assert await a._reserve(2)  # its own reservation (or its earlier life's lease): still its own
        assert await b._reserve(3)
        workers = {name: Lease(js, a.cfg.lease_bucket, key, name, TTL_S) for name in "ab"}
        for worker in workers.values():
            await worker.ensure()
        assert not await workers["b"].try_acquire()
        assert await workers["a"].try_acquire()  # the reserving daemon's worker: no wait for a TTL
        assert orjson.loads((await a.kv.get(key)).value)["token"] == workers["a"].token
        await workers["a"].release()  # a graceful stop: free again, for whoever reserves it first
        assert await b._reserve(2)
    finally:
        await nc.close()


async def test_a_takeovers_consumer_made_during_its_backlog_reads_on_from_the_backlogs_end(
        nats_server: NatsServer) -> None:
    """The partition's consumer of the whole log is made while the backlog is read, after its end: what arrives
    meanwhile is read after it, once, and the reader says it is caught up only once it reads."""
    subjects_mix = ["recovery.p.0.ev.job.a.progress.report", "recovery.p.1.ev.job.b.progress.report",
                    "recovery.ev.node.n1.node.heartbeat"]
    nc, js = await connect(nats_server.url)
    try:
        await store_a_mix(js, "TAKEOVER", 300, 11, subjects_mix)
        reader = InputReader(nc, js, "TAKEOVER", "takeover-0", 25, 30.0, filter_subject=None)
        applied: list[int] = []

        async def apply(batch: list[Delivery]) -> None:
            assert not reader.caught_up and reader.lag > 0  # nothing read live yet
            if not applied:  # the fleet goes on while the backlog is read
                for i in range(40):
                    await js.publish(subjects_mix[i % 3], b"late")
            applied.extend(d.seq for d in batch)

        ahead = BacklogAhead(nc, js, "TAKEOVER", subjects.partition_inputs(0), 1, 25, 1)
        assert await ahead.measured() == 300  # read ahead from here on, a few batches at most
        done = await apply_backlog(reader, ahead, apply, lambda: False)
        assert done is not None and 0 <= done.pending <= 40 and reader.pull.start_seq == 301
        assert done.read == len(applied) and done.apply_s > 0 and 1 <= done.batches <= len(applied)
        late: list[int] = []
        deadline = time.monotonic() + 60
        while len(late) < 40 and time.monotonic() < deadline:
            late += [d.seq for d in await reader.next_batch(2.0, late[-1] if late else applied[-1])]
        assert late == list(range(301, 341)) and reader.caught_up
        assert applied == sorted(set(applied)) and applied[-1] <= 300 and len(applied) > 150
        await reader.close()
    finally:
        await nc.close()


# -- three daemons, 64 jobs, one SIGKILLed mid-incident ---------------------------------------------------------
def owned(daemon: DaemonProcess) -> list[int]:
    try:
        return [int(k) for k in daemon.status().get("owned", [])]
    except (OSError, AssertionError, ValueError):
        return []


def open_incidents(daemon: DaemonProcess) -> int:
    try:
        parts = daemon.status().get("partition_status", {})
    except (OSError, AssertionError, ValueError):
        return 0
    return sum(int(p.get("open_incidents", 0)) for p in parts.values() if p.get("role") == "active")


def ownership_lines(daemon: DaemonProcess) -> str:
    """What a daemon's log says about its partitions, to explain a failed wait."""
    wanted = {"partition taken", "partition handed over", "partition stopped", "lease acquired: active",
              "partition claimed", "restored", "caught up", "balance failed"}
    return "\n".join(f"{daemon.settings['instance']} {line.get('time')} {line.get('msg')} {line.get('partition')}"
                     for line in daemon.logs() if line.get("msg") in wanted or line.get("level") == "ERROR")


def coverage(daemons: list[DaemonProcess]) -> list[int]:
    return sorted(k for d in daemons if d.running() for k in owned(d))


async def drain_partitions(url: str, daemons: list[DaemonProcess]) -> None:
    """Wait until each partition's owner has applied the last input of that partition, and nothing new came."""
    target: list[int] = []
    while True:
        records = await read_stream(url)
        latest = [max((r.seq for r in partition_log(records, Partition(k, P)) if not subjects.is_output(r.subject)),
                      default=0) for k in range(P)]
        if latest == target:
            return
        target = latest

        def applied(t: list[int] = latest) -> bool:
            seen: dict[int, int] = {}
            for d in daemons:
                if d.running():
                    try:
                        status = d.status()
                    except (OSError, AssertionError):
                        continue  # starting, or handing over: its partitions are counted once it answers
                    for key, part in status.get("partition_status", {}).items():
                        if part.get("role") == "active":
                            seen[int(key)] = int(part.get("published_seq", 0))
            return all(seen.get(k, -1) >= t[k] for k in range(P))

        await async_wait_for(applied, 30, "every partition to drain")


async def test_a_partition_claimed_by_another_owner_stops_publishing_then_its_lease_holder_resumes(
        nats_server: NatsServer, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "a", nats_server.url, instance="daemon-a", partitions=P, lease_ttl_s=TTL_S)
    nc, js = await connect(nats_server.url)
    try:
        daemon.start()
        await async_wait_for(lambda: owned(daemon) == list(range(P)), 30, "the daemon to own every partition")
        # an owner that is not the lease holder claims partition 0 (as a new owner would after a takeover)
        intruder = Fence(js, "default-0", "daemon-x", "RECOVERY", "RECOVERY_CMD")
        await intruder.claim()
        job = "a"  # in partition 0 of 4
        assert subjects.partition_of(job, P) == 0
        spec = JobSpec.model_validate({"nodes": ["n0", "n1"], "ranks_per_node": 4,
                                       "layout": Layout(dp=4, tp=2, pp=1), "policies": DEMO_POLICIES})
        envelope = make_envelope("job.submitted", {"spec": spec.model_dump(mode="json")}, id="submit-a", job=job,
                                 source="scheduler")
        await js.publish(subjects.job_event(job, "job.submitted"), encode_envelope(envelope),
                         headers={MSG_ID: envelope.id})
        # its owner's decision is refused: the partition's engine stops, deposed, and its lease holder (the same
        # daemon, which takes its own lease back) claims the partition again and decides once
        await async_wait_for(lambda: any(line.get("msg") == "partition stopped" for line in daemon.logs()), 30,
                             "the fenced partition to stop")
        stopped = next(line for line in daemon.logs() if line.get("msg") == "partition stopped")
        assert stopped["partition"] == 0 and "another owner claimed the partition" in stopped["reason"]

        async def accepted() -> bool:
            return any(r.subject == subjects.decision(job) for r in await read_stream(nats_server.url))

        await async_wait_for(accepted, 30, "the job's decision, once the holder claimed again")
        assert owned(daemon) == list(range(P))
    finally:
        daemon.close()
        await nc.close()
    records = await read_stream(nats_server.url)
    assert [r.headers.get(MSG_ID) is not None for r in records if r.subject == subjects.decision(job)] == [True]
    owners = [orjson.loads(r.data)["owner"] for r in records if r.subject == subjects.fence("log", "default-0")]
    assert owners == ["daemon-a", "daemon-x", "daemon-a"]


async def test_a_daemon_that_joins_takes_a_fair_share_handed_over_gracefully(nats_server: NatsServer,
                                                                             tmp_path: Path) -> None:
    settings = {"partitions": P, "lease_ttl_s": TTL_S}
    first, second = (DaemonProcess(tmp_path / name, nats_server.url, instance=f"daemon-{name}", **settings)
                     for name in "ab")
    try:
        first.start()
        await async_wait_for(lambda: owned(first) == list(range(P)), 30, "the only daemon to own every partition")
        second.start()
        await async_wait_for(lambda: len(owned(first)) == len(owned(second)) == P // 2
                             and coverage([first, second]) == list(range(P)), 30, "the two to share them")
        handed = [line for line in first.logs() if line.get("msg") == "partition handed over"]
        assert len(handed) == P // 2
        assert [line.get("msg") for line in first.logs()].count("lease released") == P // 2  # not a TTL later
        # one /metrics per process, each partition it serves labelled with its index, as Prometheus parses it
        mine = owned(second)
        code, body = second.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert code == 200 and len(families) == len(set(families))
        active = {s.labels["partition"]: s.value for s in families["recovery_partition_active"].samples}
        assert {k for k, v in active.items() if v == 1} == {str(k) for k in mine}, active
        applied = {s.labels["partition"] for s in families["recovery_last_applied_seq"].samples}
        assert applied >= {str(k) for k in mine}
        assert [s.labels for s in families["recovery_active"].samples] == [{}]  # the process's own, unlabelled
        lag = second.metrics()
        assert all(f'recovery_consumer_lag{{partition="{k}"}}' in lag for k in mine), sorted(lag)[:20]
        # each balance (two a second a daemon) reads the members without a consumer: the server keeps none for it
        nc, js = await connect(nats_server.url)
        try:
            assert (await js.stream_info("KV_RECOVERY_LEASES")).state.consumer_count == 0
        finally:
            await nc.close()
    finally:
        first.close()
        second.close()


async def store_a_mix(js: JetStreamContext, stream: str, count: int, seed: int, choices: list[str]) -> None:
    """A stream over `recovery.>` holding `count` messages, each on a subject drawn from `choices`."""
    await js.add_stream(StreamConfig(name=stream, subjects=["recovery.>"]))
    rng = random.Random(seed)
    for i in range(count):
        await js.publish(rng.choice(choices), str(i).encode())


async def test_a_backlog_read_per_filter_and_merged_is_the_partitions_consumer_order(nats_server: NatsServer
                                                                                         ) -> None:
    """`read_backlog` gives exactly what the partition's own consumer of two filters gives over a range: its jobs'
    events and every node's, in stream order, nothing of another partition, nothing past the end; batches of 7 cut
    the merge at every place."""
    nc, js = await connect(nats_server.url)
    try:
        await store_a_mix(js, "BACKLOG", 400, 5, [
            "recovery.p.0.ev.job.a.progress.report", "recovery.p.1.ev.job.b.progress.report",
            "recovery.ev.node.n1.node.heartbeat", "recovery.ev.node.n2.device.fault", "recovery.dec.a"])
        filters = subjects.partition_inputs(0)
        merged = [d for batch in [b async for b in read_backlog(nc, js, "BACKLOG", filters, 17, 380, 7)]
                  for d in batch]
        own = PullReader(nc, js, "BACKLOG", ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subjects=filters),
                         batch=50, end_seq=380)
        await own.open(17)
        expected = []
        while not own.done:
            expected.extend(await own.next_batch(own.stall_s))
        await own.close()
        assert [(d.seq, d.subject, d.data) for d in merged] == [(d.seq, d.subject, d.data) for d in expected]
        assert merged[0].seq >= 17 and merged[-1].seq <= 380 and len(merged) > 150
        assert {d.subject.split(".")[1] for d in merged} == {"p", "ev"}
    finally:
        await nc.close()


async def test_a_partition_reading_the_whole_log_takes_what_its_two_filters_would(nats_server: NatsServer) -> None:
    """A partition's consumer reads the whole log and passes over what `subjects.partition_reads` says is not its
    own: exactly what JetStream's two filters (`partition_inputs`) select, strays to partition 0 only."""
    nc, js = await connect(nats_server.url)
    try:
        await store_a_mix(js, "WHOLE", 300, 7, [
            "recovery.p.0.ev.job.a.progress.report", "recovery.p.1.ev.job.b.process.exited",
            "recovery.p.10.ev.job.c.progress.report", "recovery.ev.node.n1.node.heartbeat",
            "recovery.ev.node.n2.device.fault", "recovery.ev.job.stray", "recovery.ev.other.x", "recovery.ev.node",
            "recovery.dec.a", "recovery.dlq.bad", "recovery.fence.log.p1"])

        async def read(config: ConsumerConfig) -> list[tuple[int, str]]:
            reader = PullReader(nc, js, "WHOLE", config, batch=100, end_seq=300)
            await reader.open(1)
            got: list[tuple[int, str]] = []
            while not reader.done:
                got.extend((d.seq, d.subject) for d in await reader.next_batch(reader.stall_s))
            await reader.close()
            return got

        whole = await read(ConsumerConfig(ack_policy=AckPolicy.NONE))
        assert len(whole) == 300
        for k in (0, 1):
            inputs = subjects.partition_inputs(k)
            filtered = await read(ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subjects=inputs))
            reads = subjects.partition_reads(k)
            assert [(seq, subject) for seq, subject in whole if reads(subject)] == filtered
            assert any(subject == "recovery.ev.job.stray" for _, subject in filtered) == (k == 0)
    finally:
        await nc.close()


async def test_three_daemons_share_64_jobs_and_survive_a_sigkill_mid_incident(tmp_path: Path) -> None:
    nats_cluster = NatsCluster(tmp_path / "nats", size=3)
    nats_cluster.start()
    try:
        await three_daemons_share_64_jobs(nats_cluster.url, tmp_path)
    finally:
        nats_cluster.stop()


async def three_daemons_share_64_jobs(url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    settings = {"partitions": P, "lease_ttl_s": TTL_S, "snapshot_every_records": 500, "snapshot_every_s": 1.0,
                "ack_wait_s": 5.0, "log_level": "INFO", "replicas": 3, "backlog_reader_at": 1}
    daemons = [DaemonProcess(tmp_path / name, url, instance=f"daemon-{name}", **settings) for name in "abc"]
    nc, js = await connect(url)
    bus = Bus(nc, js)
    cluster = BuiltinCluster(bus, DemoSettings(seed=11, jobs=64, step_s=0.5, fault_every_s=0.15,
                                               ack_delay_s=(0.01, 0.05), restart_s=(0.05, 0.2)), prefix="parts")
    try:
        for daemon in daemons:
            daemon.start()
        await async_wait_for(lambda: coverage(daemons) == list(range(P)) and all(owned(d) for d in daemons), 60,
                             "three daemons to share the partitions")
        await bus.start(cluster)
        await async_wait_for(lambda: cluster.recovered >= 8, 60, "recoveries under three daemons")
        # the daemon with the most partitions, while one of them has an incident open
        victim = max(daemons, key=lambda d: len(owned(d)))
        await async_wait_for(lambda: open_incidents(victim) > 0, 30, "an incident open on the victim")
        lost = owned(victim)
        victim.kill()
        killed_at = time.monotonic()
        survivors = [d for d in daemons if d is not victim]
        try:
            await async_wait_for(lambda: coverage(survivors) == list(range(P)), TTL_S + 20,
                                 f"the survivors to take partitions {lost} over")
        except TimeoutError as exc:
            raise AssertionError("\n".join(ownership_lines(d) for d in survivors)) from exc
        failover_s = time.monotonic() - killed_at
        print(f"partitions {lost} served again {failover_s:.2f}s after the SIGKILL")
        before = cluster.recovered
        await async_wait_for(lambda: cluster.recovered >= before + 6, 60, "recoveries after the kill")
        cluster.calm()
        await async_wait_for(lambda: all(job.progressing or job.failed for job in cluster.jobs.values()), 30,
                             "the last incidents to close")
        cluster.stop()
        await bus.flush()
        for daemon in survivors:
            code, _ = daemon.terminate(20)
            assert code == 0, daemon.log_tail()
        for daemon in survivors:  # drain what is left with nothing new arriving
            daemon.start(RECOVERY_TIMERS_ENABLED="false")
        # every survivor up and serving its share: one that has not started yet answers nothing
        await async_wait_for(lambda: coverage(survivors) == list(range(P)) and all(owned(d) for d in survivors), 60,
                             "the partitions owned again")
        await drain_partitions(url, survivors)
        for daemon in survivors:
            code, _ = daemon.terminate(20)
            assert code == 0, daemon.log_tail()
        # no partition of a survivor failed or was fenced: nobody else claimed one (a clustered stream's refusal of
        # a write while another is in flight is no fence), and none was taken and handed over in a loop
        for daemon in survivors:
            failed = [line for line in daemon.logs() if line.get("msg") in ("partition stopped", "partition failed")]
            assert not failed, ownership_lines(daemon)
        # the partitions taken over read their backlog through one consumer per filter, merged (and the final
        # replay below shows it applied the same inputs in the same order as the log)
        assert any(line.get("msg") == "backlog applied" for d in survivors for line in d.logs()), \
            "\n".join(ownership_lines(d) for d in survivors)
        snapshots = []
        for k in range(P):
            store = SnapshotStore(js, "RECOVERY_SNAPSHOTS", f"default-{k}", 512 * 1024, 3)
            await store.ensure()
            snapshots.append(await store.load())
    finally:
        await bus.close()
        for daemon in daemons:
            daemon.close()
        await nc.close()

    records = await read_stream(url)
    claims = [r for r in records if r.subject.startswith(subjects.FENCES)]
    assert len(claims) >= P + len(lost), "every partition claimed, and those of the killed daemon again"
    ids = [r.headers.get(MSG_ID) for r in records if r not in claims]
    assert len(ids) == len(set(ids)), "a message id is stored twice"
    assert set(bus.sent) <= set(ids), "an event the cluster published is missing from the log"
    commands = await read_stream(url, "RECOVERY_CMD")
    command_ids = [r.headers.get(MSG_ID) for r in commands if r.subject.startswith("recovery.cmd.")]
    assert len(command_ids) == len(set(command_ids)), "a command id was stored twice"
    granted: dict[str, set[int]] = {}
    decided = 0
    for k in range(P):
        partition = Partition(k, P)
        result = replay(partition_log(records, partition), Engine(partition))
        recorded = [dumps(d) for d in result.recorded_decisions]
        assert len(recorded) == len(set(recorded)), f"partition {k}: a decision is recorded twice"
        assert recorded == [dumps(d) for d in result.decisions], f"partition {k}: recorded != replayed"
        assert [dumps(r) for r in result.recorded_rejections] == [dumps(r) for r in result.rejections]
        decided += len(recorded)
        loaded = snapshots[k]
        assert loaded is not None, f"partition {k} has no snapshot"
        engine = load_snapshot(loaded[0])
        assert engine is not None and engine.partition == partition
        assert state_view(engine.snapshot()) == state_view(result.engine.snapshot()), f"partition {k} state"
        for decision in result.recorded_decisions:
            if isinstance(decision, Decision):
                for command in decision.commands:
                    if command.kind == "migrate_ranks":
                        granted.setdefault(command.to_node, set()).add(k)  # type: ignore[union-attr]
    # every decision in the log belongs to exactly one partition's replay
    assert decided == sum(1 for r in records if r.subject.startswith("recovery.dec."))
    assert granted, "no spare was granted: the run did not exercise the pool"
    assert all(len(parts) == 1 for parts in granted.values()), f"a spare granted by two partitions: {granted}"
    assert failover_s < TTL_S + 4, f"partitions {lost} served again after {failover_s:.1f}s"
    # the postmortem tool finds the partitions in the log and verifies each through an engine of its own
    verified = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "verify", "--nats", url, "--json"],
                              capture_output=True, timeout=120, check=False)
    answer = orjson.loads(verified.stdout)
    assert verified.returncode == 0 and answer["ok"] and answer["partitions"] == P, (answer, verified.stderr[-2000:])
    assert [r["partition"] for r in answer["results"]] == list(range(P))
    assert sum(r["recorded"] for r in answer["results"]) == decided
    assert time.monotonic() - started < 120

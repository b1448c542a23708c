"""Two daemons on one partition: one active, one standing by on the lease; the standby takes over when the active
one is killed or stops, and a daemon whose lease changed hands stops. Real nats-server, real processes.

The checks at the end are the crash test's: every event the cluster published is in the log once, every decision
and dead letter is recorded once and as an offline replay derives it, and no command id was stored twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats.js.errors
import orjson
import pytest

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.log import MSG_ID
from recovery.service.demo import BuiltinCluster, Bus, DemoSettings
from recovery.service.lease import Lease, LeaseLost
from recovery.testing.nats import NatsServer
from tests.daemon_support import (
    DaemonProcess,
    async_wait_for,
    check_log,
    command_count,
    connect,
    drain,
    read_stream,
)

FAST = DemoSettings(seed=4, jobs=2, step_s=0.05, fault_every_s=0.5, ack_delay_s=(0.01, 0.05), restart_s=(0.02, 0.1))
TTL_S = 2.0


def pair(tmp_path: Path, url: str) -> tuple[DaemonProcess, DaemonProcess]:
    settings = {"lease_ttl_s": TTL_S, "snapshot_every_records": 50, "snapshot_every_s": 0.5, "ack_wait_s": 5.0}
    return (DaemonProcess(tmp_path / "a", url, instance="daemon-a", **settings),
            DaemonProcess(tmp_path / "b", url, instance="daemon-b", **settings))


def role(daemon: DaemonProcess) -> str:
    try:
        return str(daemon.status().get("role"))
    except (OSError, AssertionError):
        return "unreachable"


async def check_the_log(url: str, sent: list[str]) -> None:
    records = await read_stream(url)
    result = check_log(records)
    inputs = [r for r in records if not subjects.is_output(r.subject)]
    stored = [r.headers.get(MSG_ID) for r in inputs]
    assert len(stored) == len(set(stored))
    assert set(sent) <= set(stored), "an event the cluster published is missing from the log"
    commands = await read_stream(url, "RECOVERY_CMD")
    command_ids = [r.headers.get(MSG_ID, "") for r in commands]
    assert len(command_ids) == len(set(command_ids)), "a command id was stored twice"
    assert sorted({i.rpartition("@")[0] for i in command_ids}) == sorted(command_count(result))  # a copy per node
    assert [d.kind for d in result.recorded_decisions].count("incident.closed") >= 2


async def test_the_standby_takes_over_when_the_active_daemon_is_killed(nats_server: NatsServer,
                                                                       tmp_path: Path) -> None:
    active, standby = pair(tmp_path, nats_server.url)
    nc, js = await connect(nats_server.url)
    bus = Bus(nc, js)
    cluster = BuiltinCluster(bus, FAST, prefix="ha")
    try:
        active.start()
        await asyncio.to_thread(active.wait_ready)
        standby.start()
        await async_wait_for(lambda: role(standby) == "standby", 30, "the second daemon to stand by")
        assert not standby.ready() and role(active) == "active"
        assert standby.metrics()["recovery_active"] == 0.0 and active.metrics()["recovery_active"] == 1.0
        await bus.start(cluster)
        await async_wait_for(lambda: cluster.recovered >= 2, 60, "recoveries under the first daemon")
        # The standby stays one while the active daemon renews, over several lease periods.
        before = cluster.recovered
        await async_wait_for(lambda: cluster.recovered >= before + 2, 60, "more recoveries")
        assert role(standby) == "standby"
        active.kill()
        await asyncio.to_thread(standby.wait_ready, 30.0)
        assert role(standby) == "active"
        after = cluster.recovered
        await async_wait_for(lambda: cluster.recovered >= after + 2, 60, "recoveries under the second daemon")
        cluster.calm()
        await async_wait_for(lambda: all(job.progressing or job.failed for job in cluster.jobs.values()), 30,
                             "the last incidents to close")
        cluster.stop()
        await bus.flush()
        code, _ = standby.terminate()
        assert code == 0, standby.log_tail()
        standby.start(RECOVERY_TIMERS_ENABLED="false")  # drain what is left with nothing new arriving
        await asyncio.to_thread(standby.wait_ready)
        await drain(standby, nats_server.url)
        code, _ = standby.terminate()
        assert code == 0, standby.log_tail()
    finally:
        await bus.close()
        active.close()
        standby.close()
        await nc.close()
    await check_the_log(nats_server.url, bus.sent)
    messages = [line.get("msg") for line in standby.logs()]
    assert "standby: another daemon holds the partition" in messages
    assert messages.count("lease acquired: active") == 2  # after the kill, and again at its own restart


async def test_a_graceful_stop_hands_the_partition_over_at_once(nats_server: NatsServer, tmp_path: Path) -> None:
    active, standby = pair(tmp_path, nats_server.url)
    try:
        active.start()
        await asyncio.to_thread(active.wait_ready)
        standby.start()
        await async_wait_for(lambda: role(standby) == "standby", 30, "the second daemon to stand by")
        code, _ = active.terminate()
        assert code == 0, active.log_tail()
        assert "lease released" in [line.get("msg") for line in active.logs()]
        await asyncio.to_thread(standby.wait_ready, 30.0)
        # and the first one, started again, now stands by in its turn
        active.start()
        await async_wait_for(lambda: role(active) == "standby", 30, "the first daemon to stand by")
    finally:
        active.close()
        standby.close()


async def test_a_daemon_whose_lease_changed_hands_stops(nats_server: NatsServer, tmp_path: Path) -> None:
    active, _ = pair(tmp_path, nats_server.url)
    nc, js = await connect(nats_server.url)
    try:
        active.start()
        await asyncio.to_thread(active.wait_ready)
        kv = await js.key_value("RECOVERY_LEASES")
        entry = await kv.get("default")
        assert orjson.loads(entry.value or b"{}")["instance"] == "daemon-a"
        # another daemon's write (after a partition, say): the next renewal finds a revision it did not write
        await kv.put("default", orjson.dumps({"instance": "daemon-x", "pid": 0, "since": 0}))
        await async_wait_for(lambda: not active.running(), 30, "the deposed daemon to stop")
        assert active.proc is not None and active.proc.returncode != 0
        lost = [line for line in active.logs() if line.get("msg") == "lease lost: stopping"]
        assert lost and "changed hands" in lost[0]["reason"], active.log_tail()
        assert "lease released" not in [line.get("msg") for line in active.logs()]
        assert orjson.loads((await kv.get("default")).value or b"{}")["instance"] == "daemon-x"  # not released
    finally:
        active.close()
        await nc.close()


class Clock:
    """The lease's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _lapsed(kv: Any, key: str) -> bool:
    try:
        await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return True
    return False


async def test_a_refused_renewal_reads_the_key_before_it_gives_the_lease_up(nats_server: NatsServer) -> None:
    """A renewal whose compare-and-set fails is not yet a lost lease: its own write stored after a timeout, or a key
    that expired while nobody could take it (renewed less than two TTLs ago, or nothing written to the bucket since),
    keep it; another's entry, or a key gone for longer with another daemon's write since, lose it."""
    nc, js = await connect(nats_server.url)
    clock = Clock()
    try:
        lease = Lease(js, "LEASES_RECHECK", "p", "me", 1.0, clock=clock)
        await lease.ensure()
        assert await lease.try_acquire()
        kv = lease.kv
        await kv.put("p", lease._value())  # a renewal that timed out here but was stored: a revision not ours yet
        clock.now += 0.3
        await lease.renew()
        assert lease.renewed == clock.now and lease.revision == (await kv.get("p")).revision
        await async_wait_for(lambda: _lapsed(kv, "p"), 15, "the key to expire")  # renewals held up for a TTL
        clock.now += 1.5  # less than two TTLs since the last renewal: nobody else can have held it
        await lease.renew()
        assert orjson.loads((await kv.get("p")).value or b"{}")["token"] == lease.token
        await async_wait_for(lambda: _lapsed(kv, "p"), 15, "the key to expire again")
        clock.now += 2.5  # gone longer than that, but nothing written since: nobody took it (a long NATS outage)
        await lease.renew()
        assert orjson.loads((await kv.get("p")).value or b"{}")["token"] == lease.token
        await async_wait_for(lambda: _lapsed(kv, "p"), 15, "the key to expire a third time")
        await kv.create("p", orjson.dumps({"instance": "other", "pid": 7}))  # another daemon took it meanwhile ...
        await async_wait_for(lambda: _lapsed(kv, "p"), 15, "the other's entry to expire")  # ... and went
        clock.now += 2.5
        with pytest.raises(LeaseLost, match=r"lapsed 2\.5s .* written since"):
            await lease.renew()
        assert await lease.try_acquire()
        await kv.put("p", orjson.dumps({"instance": "other", "pid": 7}))
        with pytest.raises(LeaseLost, match="held by other"):
            await lease.renew()
    finally:
        await nc.close()


async def test_a_slow_consumer_does_not_take_the_only_daemon_down(tmp_path: Path) -> None:
    """A server that holds at most 4 MB for a client (`max_pending`) and inputs of 1 MB: pulls sized from the server's
    `max_payload` are never cut off as a slow consumer, the lease is renewed on a connection of its own, and the only
    daemon reads every input and stays active (with pulls of 8 MiB it was cut off again and again, its lease lapsed,
    and it stopped with 296 inputs of 300 unread)."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_pending: 4MB\n")
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)])
    daemon = DaemonProcess(tmp_path / "d", server.url, timers_enabled=False, lease_ttl_s=TTL_S)
    server.start()
    try:
        daemon.start()
        await asyncio.to_thread(daemon.wait_ready, 60)
        nc, js = await connect(server.url)
        try:
            pad = "x" * 1_000_000
            last = 0
            for i in range(60):
                envelope = orjson.loads(encode_envelope(make_envelope("node.heartbeat", {}, id=f"big-{i}", node="n1",
                                                                      source="test")))
                envelope["pad"] = pad  # 1 MB: a bad input, dead-lettered, but read and applied like any other
                ack = await js.publish(subjects.node_event("n1", "node.heartbeat"), orjson.dumps(envelope),
                                       headers={MSG_ID: f"big-{i}"})
                last = ack.seq
        finally:
            await nc.close()
        await async_wait_for(lambda: daemon.status()["published_seq"] >= last, 120, "the daemon to apply every input",
                             daemon.log_tail)
        assert daemon.running() and role(daemon) == "active"
        assert "Slow Consumer" not in server.log_tail(10_000)
        assert not [e for e in daemon.logs() if e.get("msg") in ("lease lost: stopping", "disconnected from NATS")]
    finally:
        daemon.close()
        server.stop()
async def test_a_renewal_stored_after_its_acknowledgement_was_lost_keeps_the_lease(nats_server: NatsServer) -> None:
    """A renewal sent while NATS was away is stored when it comes back, after the client gave up waiting for its
    acknowledgement: the next renewal finds a revision it did not know of, but one this process wrote."""
    nc, js = await connect(nats_server.url)
    try:
        lease = Lease(js, "RECOVERY_LEASES", "default", "daemon-a", TTL_S)
        await lease.ensure()
        assert await lease.try_acquire()
        await lease.kv.update("default", lease._value(), last=lease.revision)  # the renewal whose ack was lost
        await lease.renew()
        assert lease.revision == (await lease.kv.get("default")).revision
        await lease.kv.put("default", orjson.dumps({"instance": "daemon-a", "pid": 0, "since": 0}))  # a new life
        with pytest.raises(LeaseLost):
            await lease.renew()
    finally:
        await nc.close()


@pytest.mark.parametrize("daemons", [1, 2])
async def test_a_nats_outage_of_several_lease_ttls_leaves_one_daemon_serving(nats_server: NatsServer, tmp_path: Path,
                                                                             daemons: int) -> None:
    """NATS away for more than three lease TTLs: nobody could renew or take the lease. The only daemon takes its lease
    again when NATS returns and serves on (it used to stop: "lease lost ... lapsed"); of two, one serves and the
    other stands by, or stops because the other really holds the lease."""
    members = list(pair(tmp_path, nats_server.url))[:daemons]
    try:
        members[0].start()
        await asyncio.to_thread(members[0].wait_ready)
        for standby in members[1:]:
            standby.start()
            await async_wait_for(lambda s=standby: role(s) == "standby", 30, "the second daemon to stand by")
        nats_server.stop()
        await asyncio.sleep(3.5 * TTL_S)  # the outage itself: how long NATS stays away, not a wait for anything
        nats_server.start()
        nc, js = await connect(nats_server.url)
        try:
            envelope = make_envelope("node.heartbeat", {}, id="after-the-outage", node="n1", source="test")
            ack = await js.publish(subjects.node_event("n1", "node.heartbeat"), encode_envelope(envelope),
                                   headers={MSG_ID: "after-the-outage"})
        finally:
            await nc.close()

        def serving() -> list[DaemonProcess]:
            return [d for d in members if d.running() and role(d) == "active"
                    and d.status().get("published_seq", 0) >= ack.seq]

        await async_wait_for(lambda: len(serving()) == 1, 60, "one daemon to serve the input after the outage",
                             lambda: "\n".join(d.log_tail() for d in members))
        lost = [line for d in members for line in d.logs() if line.get("msg") == "lease lost: stopping"]
        if daemons == 1:
            assert members[0].running() and not lost, members[0].log_tail()
        else:
            other = next(d for d in members if d is not serving()[0])
            # The other may still call itself active until its next renewal finds the lease taken (it reads no input
            # meanwhile: its last renewal is older than half a TTL); then it stands by, or stops as deposed.
            await async_wait_for(lambda: role(other) in ("standby", "deposed", "unreachable"), 30,
                                 "the other daemon to stand by or stop", other.log_tail)
            lost = [line for d in members for line in d.logs() if line.get("msg") == "lease lost: stopping"]
            assert all("held by" in str(line.get("reason", "")) for line in lost), lost
            assert len(serving()) == 1
    finally:
        for member in members:
            member.close()

"""Crash safety: SIGKILL the daemon process at random points during incidents, restart it, and check that every
event took effect exactly once, no command id was stored twice, and the final state is an offline replay's.

The cluster is `recovery.service.demo.BuiltinCluster`, sped up: three jobs, a fault every half second, executors that
answer from the command stream and restarted ranks that report progress. It talks to NATS only, like real
agents, and keeps publishing while the daemon is down. The daemon snapshots often, in batches of a size the
seed picks, with its timer service on; its last run drains the log with the timer service off, so that the
log is quiet when the checks read it.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from events import subjects
from events.envelope import Record
from recovery.log import MSG_ID
from recovery.log.snapshot import load_snapshot
from recovery.service.demo import BuiltinCluster, Bus, DemoSettings
from recovery.service.snapshots import SnapshotStore
from recovery.testing.nats import NatsServer
from tests.daemon_support import (
    DaemonProcess,
    async_wait_for,
    check_log,
    command_count,
    connect,
    drain,
    read_stream,
    state_view,
)

FAST = DemoSettings(seed=0, jobs=3, step_s=0.05, fault_every_s=0.5, ack_delay_s=(0.01, 0.05), restart_s=(0.02, 0.1))


def incident_open(cluster: BuiltinCluster) -> bool:
    return any(not job.progressing and not job.failed for job in cluster.jobs.values())


async def still_open(cluster: BuiltinCluster, url: str) -> str:
    """What the jobs whose incident did not close were doing, for the failure message: the cluster's view and the
    job's last decisions in the log."""
    records = await read_stream(url)
    lines = []
    for job in cluster.jobs.values():
        if job.progressing or job.failed:
            continue
        decisions = [r.envelope.data for r in records if isinstance(r, Record) and r.envelope.type == "decision"
                     and r.envelope.job == job.id]
        last = [f"{d.kind} ({d.state}/{d.phase}): {d.reason}" for d in decisions[-6:]]
        lines.append(f"{job.id}: step {job.step}, alive {sorted(job.alive)}, hung {job.hung}; last decisions: {last}")
    return "incidents still open after the cluster calmed down:\n" + "\n".join(lines)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_sigkill_during_incidents_loses_and_doubles_nothing(seed: int, nats_server: NatsServer,
                                                                  tmp_path: Path) -> None:
    rng = random.Random(seed)
    daemon = DaemonProcess(tmp_path, nats_server.url, batch_size=rng.choice([1, 8, 64, 512]),
                           snapshot_every_records=rng.choice([20, 60, 150]), snapshot_every_s=0.5, ack_wait_s=5.0)
    daemon.start()
    nc, js = await connect(nats_server.url)
    bus = Bus(nc, js)
    cluster = BuiltinCluster(bus, DemoSettings(**{**FAST.__dict__, "seed": seed}), prefix=f"seed{seed}")
    killed_in_incident = 0
    try:
        await asyncio.to_thread(daemon.wait_ready)
        await bus.start(cluster)
        for _ in range(3):
            for _attempt in range(20):  # a random point inside an incident (they last a few hundred ms)
                await async_wait_for(lambda: incident_open(cluster), 30, "an incident in the cluster")
                await asyncio.sleep(rng.random() * 0.05)  # the random point, not a synchronisation
                if incident_open(cluster):
                    break
            killed_in_incident += incident_open(cluster)
            daemon.kill()
            await asyncio.sleep(rng.random() * 0.3)  # downtime: the cluster keeps publishing
            daemon.start()
            await asyncio.to_thread(daemon.wait_ready)
        await async_wait_for(lambda: cluster.recovered >= 4, 60, "a few recoveries")
        cluster.calm()
        try:
            await async_wait_for(lambda: not incident_open(cluster), 30, "the last incidents to close")
        except TimeoutError as exc:
            raise AssertionError(await still_open(cluster, nats_server.url)) from exc
        cluster.stop()
        await bus.flush()
        code, _ = daemon.terminate()
        assert code == 0, daemon.log_tail()
        # drain what is left with the timer service off, so that nothing new arrives while the checks read
        daemon.start(RECOVERY_TIMERS_ENABLED="false")
        await asyncio.to_thread(daemon.wait_ready)
        await drain(daemon, nats_server.url)
        code, seconds = daemon.terminate()
        assert code == 0 and seconds < 5, daemon.log_tail()
        store = SnapshotStore(js, "RECOVERY_SNAPSHOTS", "default", 512 * 1024, 1)
        await store.ensure()
        snapshot = await store.load()
    finally:
        await bus.close()
        daemon.close()
        await nc.close()

    records = await read_stream(nats_server.url)
    result = check_log(records)  # every decision and dead letter recorded once, as an offline replay derives it
    inputs = [r for r in records if not subjects.is_output(r.subject)]
    stored = [r.headers.get(MSG_ID) for r in inputs]
    assert len(stored) == len(set(stored))
    assert set(bus.sent) <= set(stored), "an event the cluster published is missing from the log"
    commands = await read_stream(nats_server.url, "RECOVERY_CMD")
    command_ids = [r.headers.get(MSG_ID, "") for r in commands]
    assert len(command_ids) == len(set(command_ids)), "a command id was stored twice"
    # every command of a decision, once for each node it concerns, on that node's subject
    assert sorted({i.rpartition("@")[0] for i in command_ids}) == sorted(command_count(result))
    assert all(r.subject.startswith(f"recovery.cmd.{r.headers[MSG_ID].rpartition('@')[2]}.") for r in commands)
    assert snapshot is not None
    engine = load_snapshot(snapshot[0])
    assert engine is not None
    assert state_view(engine.snapshot()) == state_view(result.engine.snapshot())
    # the run was the one intended: incidents recovered, kills inside them, restarts from snapshots
    kinds = [d.kind for d in result.recorded_decisions]
    assert kinds.count("incident.closed") >= 2
    assert killed_in_incident >= 2
    # the daemon process runs no thread of its own: its periodic snapshots are pickled in a forked child
    periodic = [line for line in daemon.logs() if line.get("msg") == "snapshot written" and not line["final"]]
    assert periodic and all(line["forked"] for line in periodic)
    restored = [line for line in daemon.logs() if line.get("msg") == "restored"]
    assert len(restored) == 5 and max(line["snapshot_seq"] for line in restored) > 0
    # restarts found effects of the replayed tail already stored, and did not publish them again
    scanned = [line for line in daemon.logs() if line.get("msg") == "published ids read"]
    assert len(scanned) == 5 and max(line["ids"] for line in scanned) > 0
    fired = [r for r in inputs if isinstance(r, Record) and r.envelope.type == "timer.fired"]
    assert fired, "the timer service fired nothing"

"""The control plane's own outage is not the job's fault: NATS stopped for longer than the nodes' silence bound and
started again on its store, under a real daemon, real agents and real (stand-in) ranks, restarts nothing and loses
nothing; the daemon logs the outage before any timer that fell due in it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from events.envelope import Record
from events.names import DecisionKind
from recovery.testing.nats import NatsServer
from tests.daemon_support import check_log, read_stream, running_daemon
from tests.e2e_support import STAND_IN, AgentProcess, connect, kill_leftovers, node_heard, submit, wait_until, watch

SILENCE_S = 3.0
"""the agents' and the ranks' silence bound"""
OUTAGE_S = 6.0
WATCHDOG_S = 4.5
"""a watchdog period shorter than the outage, but longer than the part of it after the tick that falls in it: that
tick's firing is logged less than a period late, so only the daemon's record says that the control plane was away"""
NS = 10**9
NODES = ["n0", "n1"]


def stand_in_job(tmp_path: Path) -> dict[str, Any]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return {"nodes": NODES, "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": WATCHDOG_S,
            "policies": {"detection": {"name": "default", "params": {
                "agent_silence_s": SILENCE_S, "hang_min_silence_s": SILENCE_S}}},
            "entrypoint": {"command": sys.executable, "args": [str(script)], "cwd": str(tmp_path),
                           "rendezvous": "agent", "env": {"MASTER_PORT": "1"}}}


async def test_nats_away_longer_than_the_silence_bound_restarts_nothing(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")  # no job store (MASTER_PORT 1): the ranks start at once
    nc = await connect(nats_server.url)
    w = await watch(nc, "j")
    ready = await node_heard(nc, "recovery.ev.node.*.node.ready")
    agents: list[AgentProcess] = []

    def explain() -> str:
        return "\n".join(f"--- {a.node}\n{a.log_tail()}" for a in agents) + f"\n--- decisions {w.kinds()}"

    try:
        # A lease that outlives the outage: one that expires in it deposes the daemon (its successor starts anew).
        async with running_daemon(nats_server.url, tmp_path / "data", lease_ttl_s=30.0) as daemon:
            agents.extend(AgentProcess(tmp_path, node, nats_server.url, False, "--preempt-linger-s", "0")
                          for node in NODES)
            await wait_until(lambda: len(ready) >= len(NODES), 60, "the agents' node.ready", explain)
            await submit(nc, "j", stand_in_job(tmp_path))
            await wait_until(lambda: "j" in daemon.engine.jobs and all(
                daemon.engine.jobs["j"].steps[r] >= 3 for r in range(4)), 60, "every rank to train", explain)
            job = daemon.engine.jobs["j"]
            # Stop the bus just after a watchdog tick, so that the next one falls due within the outage.
            assert job.watchdog is not None
            due = daemon.engine.timers[job.watchdog][1]
            await wait_until(lambda: daemon.engine.timers[job.watchdog][1] > due, WATCHDOG_S + 10, "a watchdog tick",
                             explain)
            in_outage = daemon.engine.timers[job.watchdog][1]
            nats_server.stop()
            stopped = time.monotonic()
            # The outage itself: how long the bus stays away, not a wait for anything.
            await wait_until(lambda: time.monotonic() - stopped >= OUTAGE_S, OUTAGE_S + 5, "the outage to last")
            nats_server.start()
            steps = list(job.steps)
            # The agents flush what they kept, and every rank reports steps made after the outage.
            await wait_until(lambda: all(job.steps[r] > steps[r] + 20 for r in range(4)), 60,
                             "every rank to report steps made after the outage", explain)
            # The tick that fell due in the outage and the two after it: a silence counted through the outage would
            # be found by the first, one the agents' flush did not end by the others.
            await wait_until(lambda: job.watchdog is None or daemon.engine.timers[job.watchdog][1] >= in_outage + int(
                3 * WATCHDOG_S * NS), 3 * WATCHDOG_S + 30, "three watchdog ticks", explain)
            assert job.state == "running" and job.incident is None, w.kinds()
            assert not any(daemon.engine.cluster.nodes[n].gone for n in NODES)
        records = await read_stream(nats_server.url)
        replayed = check_log(records)  # every decision is what a replay of the log derives
        decided = [d.kind for d in replayed.recorded_decisions if getattr(d, "job", None) == "j"]
        assert DecisionKind.FAULT_CONFIRMED not in decided and DecisionKind.INCIDENT_CLOSED not in decided, decided
        assert all(len(pids) == 1 for pids in w.pids().values()), w.pids()  # no rank restarted
        inputs = [r for r in records if isinstance(r, Record) and r.envelope.job == "j"]
        outage = next(i for i, r in enumerate(inputs) if r.envelope.type == "control.outage")
        assert inputs[outage].envelope.data.away_s >= OUTAGE_S  # type: ignore[union-attr]
        late = [r for r in inputs[:outage] if r.envelope.type == "timer.fired" and r.ts > r.envelope.data.due  # type: ignore[union-attr]
                + 2 * 10**9]
        assert not late, f"a timer that fell due in the outage was logged before its record: {late}"
    finally:
        for agent in agents:
            agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()

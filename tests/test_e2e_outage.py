"""The control plane's own outage is not the job's fault: NATS stopped for longer than the nodes' silence bound and
started again on its store, under a real daemon, real agents and real (stand-in) ranks, restarts nothing and loses
nothing; the daemon logs the outage before any timer that fell due in it. Also when the outage outlives the
daemon's lease: nobody could take it meanwhile, and the lone daemon serves on."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from events.envelope import Record
from events.names import DecisionKind
from recovery.core.engine import Engine
from recovery.testing.nats import NatsServer, free_port
from tests.daemon_support import check_log, read_stream, running_daemon, supervised_daemon
from tests.e2e_support import (
    STAND_IN,
    AgentProcess,
    JobWatch,
    connect,
    kill_leftovers,
    node_heard,
    stop_agents,
    submit,
    wait_until,
    watch,
)

SILENCE_S = 3.0
"""the agents' and the ranks' silence bound"""
OUTAGE_S = 6.0
WATCHDOG_S = 4.5
"""a watchdog period shorter than the outage, but longer than the part of it after the tick that falls in it: that
tick's firing is logged less than a period late, so only the daemon's record says that the control plane was away"""
LEASE_TTL_S = 2.0
"""a lease whose key lapses (gone for more than two TTLs) within `LONG_OUTAGE_S`"""
LONG_OUTAGE_S = 7.0
LONG_WATCHDOG_S = 6.0
"""as `WATCHDOG_S`, for the longer outage"""
NS = 10**9
NODES = ["n0", "n1"]


def stand_in_job(tmp_path: Path, watchdog_s: float) -> dict[str, Any]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return {"nodes": NODES, "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": watchdog_s,
            "policies": {"detection": {"name": "default", "params": {
                "agent_silence_s": SILENCE_S, "hang_min_silence_s": SILENCE_S}}},
            "entrypoint": {"command": sys.executable, "args": [str(script)], "cwd": str(tmp_path),
                           "rendezvous": "agent", "env": {"MASTER_PORT": str(free_port())}}}


class Training:
    """Two agents training a stand-in job under the daemon whose engine `engine()` reads (the one running now),
    and what the test saw of the job."""

    def __init__(self, nats_server: NatsServer, tmp_path: Path, w: JobWatch) -> None:
        self.nats_server = nats_server
        self.tmp_path = tmp_path
        self.w = w
        self.agents: list[AgentProcess] = []
        self.engine: Callable[[], Engine] = Engine

    def explain(self) -> str:
        return "\n".join(f"--- {a.node}\n{a.log_tail()}" for a in self.agents) + f"\n--- decisions {self.w.kinds()}"

    def watchdog_due(self) -> int:
        job = self.engine().jobs.get("j")  # none while a daemon that just started replays the log
        if job is None:
            return 0
        return self.engine().timers[job.watchdog][1] if job.watchdog is not None else 1 << 62

    async def start(self, nc: Any, ready: list[str], watchdog_s: float) -> None:
        self.agents.extend(AgentProcess(self.tmp_path, node, self.nats_server.url, False, "--preempt-linger-s", "0")
                           for node in NODES)
        await wait_until(lambda: len(ready) >= len(NODES), 60, "the agents' node.ready", self.explain)
        await submit(nc, "j", stand_in_job(self.tmp_path, watchdog_s))
        await wait_until(lambda: "j" in self.engine().jobs and all(
            self.engine().jobs["j"].steps[r] >= 3 for r in range(4)), 60, "every rank to train", self.explain)

    async def through_an_outage(self, outage_s: float, watchdog_s: float) -> None:
        """Stop the bus just after a watchdog tick, so that the next one falls due within the outage; start it again
        `outage_s` later; the job trains on, through three more ticks, with no incident."""
        due = self.watchdog_due()
        await wait_until(lambda: self.watchdog_due() > due, watchdog_s + 10, "a watchdog tick", self.explain)
        in_outage = self.watchdog_due()
        self.nats_server.stop()
        stopped = time.monotonic()
        # The outage itself: how long the bus stays away, not a wait for anything.
        await wait_until(lambda: time.monotonic() - stopped >= outage_s, outage_s + 5, "the outage to last")
        self.nats_server.start()
        steps = list(self.engine().jobs["j"].steps)
        # The agents flush what they kept, and every rank reports steps made after the outage (read from whichever
        # daemon runs by then).
        await wait_until(lambda: "j" in self.engine().jobs and all(
            self.engine().jobs["j"].steps[r] > steps[r] + 20 for r in range(4)), 60,
            "every rank to report steps made after the outage", self.explain)
        # The tick that fell due in the outage and the two after it: a silence counted through the outage would be
        # found by the first, one the agents' flush did not end by the others.
        await wait_until(lambda: self.watchdog_due() >= in_outage + int(3 * watchdog_s * NS), 3 * watchdog_s + 30,
                         "three watchdog ticks", self.explain)
        job = self.engine().jobs["j"]
        assert job.state == "running" and job.incident is None, self.w.kinds()
        assert not any(self.engine().cluster.nodes[n].gone for n in NODES)

    async def check_the_log(self, outage_s: float) -> list[Record]:
        """Nothing restarted, the log replays to the decisions recorded, and the outage's record precedes every timer
        that fell due in it; the job's `control.outage` records come back."""
        records = await read_stream(self.nats_server.url)
        replayed = check_log(records)  # every decision is what a replay of the log derives
        decided = [d.kind for d in replayed.recorded_decisions if getattr(d, "job", None) == "j"]
        assert DecisionKind.FAULT_CONFIRMED not in decided and DecisionKind.INCIDENT_CLOSED not in decided, decided
        assert all(len(pids) == 1 for pids in self.w.pids().values()), self.w.pids()  # no rank restarted
        inputs = [r for r in records if isinstance(r, Record) and r.envelope.job == "j"]
        outage = next((i for i, r in enumerate(inputs) if r.envelope.type == "control.outage"), None)
        assert outage is not None, "no control.outage was logged"
        assert inputs[outage].envelope.data.away_s >= outage_s  # type: ignore[union-attr]
        late = [r for r in inputs[:outage] if r.envelope.type == "timer.fired" and r.ts > r.envelope.data.due  # type: ignore[union-attr]
                + 2 * 10**9]
        assert not late, f"a timer that fell due in the outage was logged before its record: {late}"
        return [r for r in inputs if r.envelope.type == "control.outage"]

    def stop(self) -> None:
        stop_agents(self.agents)
        kill_leftovers([pid for pids in self.w.pids().values() for pid in pids])


async def test_nats_away_longer_than_the_silence_bound_restarts_nothing(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")  # the stand-ins use no store: wait little for it
    nc = await connect(nats_server.url)
    training = Training(nats_server, tmp_path, await watch(nc, "j"))
    ready = await node_heard(nc, "recovery.ev.node.*.node.ready")
    try:
        # A lease that outlives the outage: the daemon keeps it, and logs the outage itself.
        async with running_daemon(nats_server.url, tmp_path / "data", lease_ttl_s=30.0) as daemon:
            training.engine = lambda: daemon.engine
            await training.start(nc, ready, WATCHDOG_S)
            await training.through_an_outage(OUTAGE_S, WATCHDOG_S)
        await training.check_the_log(OUTAGE_S)
    finally:
        training.stop()
        await nc.close()


async def test_an_outage_longer_than_the_lease_leaves_the_lone_daemon_serving_and_logging_it(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NATS away for more than two lease TTLs: the daemon's lease key lapses, but nobody could take it meanwhile
    (nothing was written to the lease bucket since its last renewal), so the daemon takes it again when NATS returns
    and serves on, under its supervisor, without a restart; it logs the outage itself before firing any timer that
    fell due in it; nothing restarts. (A daemon whose lease another took meanwhile is deposed, and the one that takes
    the lease logs the outage: `tests/test_outage_recorder.py`.)"""
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")
    nc = await connect(nats_server.url)
    training = Training(nats_server, tmp_path, await watch(nc, "j"))
    ready = await node_heard(nc, "recovery.ev.node.*.node.ready")
    try:
        async with supervised_daemon(nats_server.url, tmp_path / "data", lease_ttl_s=LEASE_TTL_S) as daemons:
            training.engine = lambda: daemons.daemon.engine
            first = daemons.daemon
            await training.start(nc, ready, LONG_WATCHDOG_S)
            await training.through_an_outage(LONG_OUTAGE_S, LONG_WATCHDOG_S)
            assert daemons.daemon is first and not daemons.failures, daemons.failures
            assert first.role == "active"
        await training.check_the_log(LONG_OUTAGE_S)
    finally:
        training.stop()
        await nc.close()

"""Liveness and progress off the log, on real processes: agents with `liveness = "live"` beat on core NATS and, with
`progress = "summary"`, send their periodic reports there too; the log holds their mode, no heartbeat, no periodic
report but the daemon's one summary per job per period, and detection is no slower. A rank's process that dies is
answered at once (its exit is a logged event, as before); a rank that stops (SIGSTOP, the agents' own hang report
off) is found silent from the summaries within its bound; an agent SIGKILLed is declared silent by the daemon's
liveness monitor within its bound, and its ranks move to the spare."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from events.envelope import Record
from recovery.testing.nats import NatsServer
from tests.daemon_support import check_log, read_stream, running_daemon
from tests.e2e_support import AgentProcess, connect, kill_leftovers, node_heard, stop_agents, submit, wait_until, watch
from tests.test_e2e_outage import NODES, SILENCE_S, WATCHDOG_S, stand_in_job

BEAT_S = 0.5
LIVE = ("--liveness", "live", "--node-heartbeat-s", str(BEAT_S), "--preempt-linger-s", "0", "--progress", "summary",
        "--rank-silence-s", "0")
SLACK_S = 6.0
"""what a busy 2-core host may add to a bound: the monitor's look, the publish, the daemon's batch"""


async def test_live_agents_log_no_heartbeat_nor_report_and_dead_stopped_and_silent_are_answered_in_time(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")  # the stand-ins use no store: wait little for it
    nc = await connect(nats_server.url)
    w = await watch(nc, "j")
    ready = await node_heard(nc, "recovery.ev.node.*.node.ready")
    joined = await node_heard(nc, "recovery.ev.node.*.node.joined")
    agents: list[AgentProcess] = []

    def explain() -> str:
        return "\n".join(f"--- {a.node}\n{a.log_tail()}" for a in agents) + f"\n--- decisions {w.kinds()}"

    try:
        async with running_daemon(nats_server.url, tmp_path / "data") as daemon:
            agents.extend(AgentProcess(tmp_path, node, nats_server.url, False, *LIVE) for node in NODES)
            agents.append(AgentProcess(tmp_path, "s0", nats_server.url, True, *LIVE))
            await wait_until(lambda: len(ready) >= len(NODES) and joined, 60, "the agents to be up", explain)
            await submit(nc, "j", stand_in_job(tmp_path, WATCHDOG_S))
            job = None

            def training() -> bool:
                nonlocal job
                job = daemon.engine.jobs.get("j")
                return job is not None and job.state == "running" and all(job.steps[r] >= 3 for r in range(4))

            await wait_until(training, 60, "every rank to train", explain)
            assert job is not None
            # Steady training: the agents' periodic reports go to the daemon, and the log holds its summaries only.
            reports, summaries = len(w.of("progress.report")), len(w.of("progress.summary"))
            await wait_until(lambda: len(w.of("progress.summary")) >= summaries + 3, 30, "three summaries", explain)
            assert len(w.of("progress.report")) == reports, "a periodic report was logged"
            assert job.state == "running" and job.incident is None  # no healthy rank taken for a silent one
            # A dead process: its exit is a logged event, answered at once.
            victim = w.pids()[3][-1]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            await wait_until(lambda: w.decided("fault.confirmed"), SLACK_S, "the exit's fault", explain)
            assert time.monotonic() - killed < SLACK_S
            await wait_until(lambda: job.state == "running" and job.incident is None and all(
                job.steps[r] > 0 for r in range(4)), 60, "the rank restarted and training", explain)
            # A rank that stops: nothing of it reaches the daemon, and the engine finds it silent from the summaries.
            stopped = w.pids()[1][-1]
            os.kill(stopped, signal.SIGSTOP)
            at = time.monotonic()
            await wait_until(lambda: len(w.decided("fault.confirmed")) >= 2, SILENCE_S + WATCHDOG_S + SLACK_S,
                             "the stopped rank's fault", explain)
            stopped_found = time.monotonic() - at
            assert stopped_found < SILENCE_S + WATCHDOG_S + SLACK_S
            assert w.decided("fault.confirmed")[-1]["data"]["reason"].startswith("ranks [1] silent"), w.kinds()
            await wait_until(lambda: job.state == "running" and job.incident is None and stopped not in [
                p for pids in w.pids().values() for p in pids[-1:]], 60, "the stopped rank replaced", explain)
            # A silent node: n0's agent SIGKILLed (its ranks are orphans that can tell nobody anything).
            n0 = agents[0]
            n0.proc.kill()
            n0.proc.wait(timeout=10)
            killed = time.monotonic()
            await wait_until(lambda: len(w.decided("fault.confirmed")) >= 3, SILENCE_S + SLACK_S,
                             "the silent node's fault", explain)
            found = time.monotonic() - killed
            confirmed = w.decided("fault.confirmed")[-1]["data"]
            # The monitor's `node.silent`, or a watchdog tick that finds the node's ranks silent first (on a busy
            # host either can come first): a node fault either way, within the bound.
            assert confirmed["reason"].startswith(("agent of n0 silent", "all ranks on n0 silent")), confirmed
            assert SILENCE_S - BEAT_S <= found < SILENCE_S + SLACK_S, found  # from its last beat, up to a beat before
            await wait_until(lambda: "s0" in job.nodes, 30, "the ranks moved to the spare", explain)
            print(f"a SIGSTOPped rank found silent {stopped_found:.1f} s after the stop (bound {SILENCE_S:g} s, "
                  f"watchdog every {WATCHDOG_S:g} s); a SIGKILLed agent's node {found:.1f} s after the kill")
        records = [r for r in await read_stream(nats_server.url) if isinstance(r, Record)]
        check_log(records)  # every decision is what a replay of the log derives
        heartbeats = [r for r in records if r.envelope.type == "node.heartbeat"]
        assert sorted(r.envelope.node or "" for r in heartbeats) == ["n0", "n1", "s0"], "only the modes are logged"
        assert all(r.envelope.data.live_s for r in heartbeats)  # type: ignore[union-attr]
        silent = [r for r in records if r.envelope.type == "node.silent"]
        assert len(silent) <= 1 and all(r.envelope.node == "n0" and r.envelope.data.silent_s > SILENCE_S  # type: ignore[union-attr]
                                        for r in silent)
        assert [r for r in records if r.envelope.type == "progress.summary"], "the daemon's summaries are logged"
        if confirmed["reason"].startswith("agent of n0 silent"):
            assert silent, "the monitor's fact is what the engine confirmed the node's fault on"
    finally:
        stop_agents(agents)
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()

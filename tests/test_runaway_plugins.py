"""Plugins the policy kit lets through, and what their hosts and the engine do around them.

A `while True:` in `decide` froze the daemon (no `/healthz`, no `recovery-ctl`, SIGTERM ignored): now every host (the
daemon, the simulator, `Scenario`) runs a plugin in a worker process it kills when a call runs past its budget, the
built-in answers, and the log holds the fact (`policy.overran`) that makes every replay answer the same way. A plugin
that restarts the job at every fault kept a job that never got further restarting for ever: the engine keeps the
ladder's no-progress rule around it. And a policy sees which nodes its job's past incidents struck.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from events.values import Granularity, JobSpec
from policies import NS, Reschedule, RescheduleContext, ReschedulingPolicyBase, StartRung, registry
from recovery.cli.ctl import request
from recovery.log import iter_file, write_file
from recovery.log.file import overruns_in_file
from recovery.log.recorder import replay
from recovery.sim import Cluster, SimConfig, simulate
from recovery.sim.__main__ import chosen_profile
from recovery.sim.sim import Simulator
from recovery.testing.nats import NatsServer
from recovery.testing.scenario import Scenario
from tests.daemon_support import ROOT, DaemonProcess, check_log, connect, dumps, read_stream, wait_for
from tests.runaway_plugins import LOOPING, RESTART_EVERY_FAULT, install_runaway_plugins

NO_DYING = {"name": "newest-complete", "params": {"dying": False}}
BUDGET_S = 0.5


@pytest.fixture
def runaway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The runaway plugins found by name through the entry points, as an installed distribution's would be."""
    where = install_runaway_plugins(tmp_path / "plugins")
    monkeypatch.syspath_prepend(str(where))
    registry._scan.cache_clear()
    registry._instance.cache_clear()
    yield where
    registry._scan.cache_clear()  # the next test scans without them
    registry._instance.cache_clear()


def overran_facts(records: list[Any]) -> list[Any]:
    return [r for r in records if isinstance(r, Record) and r.envelope.type == "policy.overran"]


def assert_replays_the_same(records: list[Any]) -> None:
    result = replay(records)
    assert [dumps(d) for d in result.decisions] == [dumps(d) for d in result.recorded_decisions]


def test_a_looping_plugin_in_a_scenario_is_abandoned_and_the_fallback_is_a_fact(runaway: Path,
                                                                                 tmp_path: Path) -> None:
    s = Scenario(policy_budget_s=BUDGET_S)
    s.submit("j", ["a0", "a1"], ranks_per_node=2, dp=4,
             policies={"rescheduling": {"name": LOOPING}, "checkpoint": NO_DYING})
    s.train("j", 10)
    s.checkpoint("j", 10, "storage", "storage")
    s.train("j", 2)
    exit_seq = s.log._count + 1  # the exit's sequence in the scenario's log
    started = time.monotonic()
    s.job_event("j", "process.exited", rank=1, exit_code=1)
    assert time.monotonic() - started < 30  # abandoned after its budget, not waited on for ever
    [failed] = s.find("policy.failed", "j")
    assert f"runaway-looping@1 did not answer within {BUDGET_S:g} s: the call was abandoned" in failed.reason
    assert failed.detail["by"].startswith("ladder@") and failed.cause_seq == exit_seq
    assert s.find("attempt.started", "j")[0].detail["granularity"] == "in_place"  # the ladder's answer
    assert s.policy_workers.workers() == 0  # the looping worker was killed
    records = list(s.log.records())
    [fact] = overran_facts(records)
    assert fact.seq > exit_seq and fact.envelope.data.seq == exit_seq
    assert (fact.envelope.data.family, fact.envelope.data.policy) == ("rescheduling", "runaway-looping@1")
    assert_replays_the_same(records)
    # Any machine, any hash seed: the replay answers the abandoned call by the built-in without making it.
    log = tmp_path / "run.jsonl"
    write_file(log, records)
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": os.pathsep.join([str(runaway), str(ROOT)])}
    verify = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "verify", str(log)], capture_output=True,
                            text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # An export's facts are read off the file first, so that its replay streams the records (never all in memory).
    assert list(overruns_in_file(log).values()) == [fact.envelope.data]
    streamed = replay(iter_file(log), overruns=overruns_in_file(log))
    assert [dumps(d) for d in streamed.decisions] == [dumps(d) for d in streamed.recorded_decisions]
    assert [d.kind for d in streamed.decisions].count("policy.failed") == 1


def test_the_same_looping_plugin_in_the_simulator(runaway: Path) -> None:
    config = SimConfig(cluster=Cluster(gpus=1024), days=7, seed=1,
                       profile=chosen_profile("default", [f"rescheduling={LOOPING}"]))
    sim = Simulator(config, policy_budget_s=BUDGET_S)
    lines: list[str] = []
    sim.progress, sim.progress_every_s = lines.append, 0.0
    try:
        result = sim.run()
    finally:
        sim.policy_workers.close()
    assert result.policy_failures >= 1 and result.job_state.startswith("running")
    records = list(sim.log.records())
    assert overran_facts(records)
    assert_replays_the_same(records)
    assert lines and lines[-1].startswith("sim: day ") and "ETTR" in lines[-1] and "faults" in lines[-1]


def test_a_plugin_that_restarts_at_every_fault_is_stopped_by_the_no_progress_rule(runaway: Path,
                                                                                  tmp_path: Path) -> None:
    """A script that crashes every 5 minutes, before its next checkpoint: each restart from the checkpoint gets it no
    further. The built-in ladder fails such a job; a plugin that restarts it at every fault kept it restarting for
    ever (39 restarts in 3.6 simulated hours here, 435 in 54 days in the report)."""
    trace = tmp_path / "crashes.csv"
    trace.write_text("time_s,signal,position\n" + "".join(f"{300 * i},process,{i % 3}\n" for i in range(1, 40)))
    profile = chosen_profile("default", [f"rescheduling={RESTART_EVERY_FAULT}",
                                         "checkpoint=newest-complete:dying=false,peer=false"])
    log = tmp_path / "run.jsonl"
    result = simulate(SimConfig(cluster=Cluster(gpus=1024), days=0.15, seed=1, trace_path=str(trace),
                                profile=profile), log_path=log)
    assert result.job_state == "failed"
    assert result.restarts["restart_job"]["started"] <= 6
    failed = [orjson.loads(line)["envelope"]["data"] for line in log.read_bytes().splitlines()
              if b'"kind":"job.failed"' in line]
    assert len(failed) == 1 and failed[0]["reason"].startswith("no progress: the job got no further than step")
    assert f"the engine's rule around rescheduling policy {RESTART_EVERY_FAULT}@1" in failed[0]["reason"]


# --- past incidents name their nodes ---------------------------------------------------------------------------
class SeesRecent(ReschedulingPolicyBase):
    name = "sees-recent"
    version = "1"
    seen: list[RescheduleContext] = []

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        self.seen.append(ctx)
        if ctx.needs_move:
            return StartRung(Granularity.MIGRATE, "the node must be left", deadline_ns=300 * NS)
        return StartRung(Granularity.IN_PLACE, "restart where they are", deadline_ns=300 * NS)


def test_past_incidents_name_the_nodes_their_faults_struck() -> None:
    """Two faults on a node, whichever ranks: a crash of rank 3 on a1, then a GPU of a1 off the bus, which moves
    a1's ranks to the spare. The policy sees a1 in both past incidents, where they ran when each struck."""
    SeesRecent.seen.clear()
    s = Scenario()
    s.spare("sp")
    s.submit("j", ["a0", "a1"], ranks_per_node=2, dp=4, policies={"checkpoint": NO_DYING})
    s.engine.policy_calls = None  # in-process: the test reads what the policy saw
    state = s.engine.jobs["j"]
    state.policies = replace(state.policies, rescheduling=SeesRecent(),
                             labels={**state.policies.labels, "rescheduling": "sees-recent@1"})
    s.train("j", 10)
    s.checkpoint("j", 10, "storage", "storage")
    for fault in range(3):
        if fault == 0:
            s.job_event("j", "process.exited", rank=3, exit_code=1)
        elif fault == 1:
            s.node_event("a1", "device.fault", device=0, vendor="nvidia", code="79")
        else:
            s.job_event("j", "process.exited", rank=0, exit_code=1, attempt=s.engine.jobs["j"].generation)
        for _ in range(4):
            s.ack_all()
            s.advance(5)
        s.train("j", 12 + 10 * fault)
        assert s.state("j") == "running", s.kinds("j")
    recent = SeesRecent.seen[-1].recent
    assert [p.nodes for p in recent] == [("a1",), ("a1",)]
    assert s.engine.jobs["j"].nodes == ["a0", "sp"]  # a1 was left: the nodes are where the faults struck


# --- the daemon ------------------------------------------------------------------------------------------------
def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_looping_plugin_in_the_daemon(runaway: Path, nats_server: NatsServer, tmp_path: Path) -> None:
    """The daemon keeps answering `/healthz` and `recovery-ctl` while the plugin loops, the job gets the ladder's
    decision, the log says why (`policy.overran`) and replays to the same decisions, and SIGTERM stops the daemon
    and its workers even while a call loops."""
    url = nats_server.url
    daemon = DaemonProcess(tmp_path / "daemon", url, policy_budget_s=1.5, shutdown_timeout_s=5.0)
    spec = JobSpec.model_validate({"nodes": ["n0", "n1"], "ranks_per_node": 2, "layout": {"dp": 4},
                                   "policies": {"rescheduling": {"name": LOOPING}, "checkpoint": NO_DYING}})
    workers: set[int] = set()
    healthz: list[float] = []
    try:
        daemon.start(PYTHONPATH=os.pathsep.join([str(runaway), str(ROOT)]))
        daemon.wait_ready(60)

        async def submit_and_crash(job: str, nodes: list[str]) -> int:
            body = spec.model_copy(update={"nodes": nodes}).model_dump(mode="json")
            submitted = await request(url, "submit", {"job": job, "spec": body})
            assert submitted["ok"], submitted
            assert (await request(url, "inject", {"type": "job.started", "job": job}))["ok"]
            return await publish_exit(url, job, 1, f"{job}-crash")

        exit_seq = asyncio.run(submit_and_crash("j", ["n0", "n1"]))

        def answered_while_it_loops() -> bool:
            workers.update(children_of(daemon.pid or 0))
            asked = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}/healthz", timeout=30) as answer:
                assert answer.status == 200
            healthz.append(time.monotonic() - asked)  # the daemon's loop waits on a call at most its budget
            return bool(overran_facts(asyncio.run(read_stream(url))))

        try:
            wait_for(answered_while_it_loops, 60, "the looping call to be abandoned")
        except TimeoutError as exc:
            raise AssertionError(daemon.log_tail(40)) from exc
        ctl = subprocess.run([sys.executable, "-m", "recovery.cli.ctl", "--nats", url, "--json", "jobs"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        assert ctl.returncode == 0, ctl.stderr
        assert [row["job"] for row in orjson.loads(ctl.stdout)["jobs"]] == ["j"]

        def decided() -> list[Any]:
            records = asyncio.run(read_stream(url))
            kinds = [r.envelope.data.kind for r in records if isinstance(r, Record) and r.envelope.type == "decision"
                     and r.envelope.data.cause_seq == exit_seq]
            return records if "attempt.started" in kinds else []

        wait_for(lambda: bool(decided()), 60, "the fallback's decisions")
        records = decided()
        [fact] = overran_facts(records)
        assert fact.envelope.data.seq == exit_seq and fact.envelope.data.policy == "runaway-looping@1"
        mine = [r.envelope.data for r in records if isinstance(r, Record) and r.envelope.type == "decision"
                and r.envelope.data.cause_seq == exit_seq]
        failed = next(d for d in mine if d.kind == "policy.failed")
        assert "did not answer within 1.5 s: the call was abandoned" in failed.reason
        assert failed.detail["by"].startswith("ladder@") and "attempt.started" in [d.kind for d in mine]
        check_log(records)  # every recorded decision is what a replay of the inputs derives
        assert workers  # the looping call ran in a worker process
        assert max(healthz) < 1.5 + 5.0, healthz  # the budget, and a busy host's margin
        # Another job's plugin loops: SIGTERM while it does ends the daemon, and its worker with it.
        asyncio.run(submit_and_crash("k", ["n2", "n3"]))
        busy: set[int] = set()
        wait_for(lambda: bool(busy.update(children_of(daemon.pid or 0)) or busy), 30, "a worker to take the call")
        workers.update(busy)
        code, took = daemon.terminate(timeout=30)
        assert code == 0 and took < 1.5 + 5.0 + 5.0, (code, took)
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, "the daemon's workers to end")
    finally:
        daemon.close()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


async def publish_exit(url: str, job: str, rank: int, event_id: str) -> int:
    """A rank of `job` exits, published as its agent would; returns its sequence."""
    nc, js = await connect(url)
    try:
        envelope = make_envelope("process.exited", {"rank": rank, "exit_code": 1}, id=event_id, job=job)
        ack = await js.publish(subjects.job_event(job, "process.exited"), encode_envelope(envelope),
                               headers={"Nats-Msg-Id": event_id})
    finally:
        await nc.close()
    return int(ack.seq)

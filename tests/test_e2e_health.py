"""Health checks on real agents and real processes (the shared cluster of `tests/e2e_cluster.py`, with agents of this
module's own: h0 and h1 run the job, hs0 and hs1 are spares of a pool of its own, so the shared spares stay free).
Every agent runs the platform's own check beside the built-in ones: a command that fails while a marker file names
its node, as a site's NHC script fails on a node it finds bad.

The job (the 4-way data-parallel gloo job of `examples/dp-training`) trains; spare hs0 goes bad while idle (its
refresh fails: it leaves the pool); then h1's link goes down and h1 goes bad: its agent's checks, run at once after the
fault, fail, and the engine moves h1's ranks to hs1, the spare that passes, never to hs0. The run ends as the
fault-free one. Then h1, repaired but not yet good, joins again as a spare and stays out; fixed, its agent's checks
pass and it takes its place in the pool."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import orjson
import torch

from tests.e2e_cluster import Cluster, assert_bitwise_equal
from tests.e2e_support import ROOT, TRAIN, AgentProcess, connect, environment, submit, wait_until, watch

JOB = "health"
POOL = "health-e2e"
STEPS = 40
STEP_TIME_S = 0.1
FAULT_AT_STEP = 10


def spec(out: str, store_port: int) -> dict[str, Any]:
    return {
        "nodes": ["h0", "h1"], "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": 1.0,
        "spare_pool": POOL,
        "policies": {"detection": {"name": "default", "params": {"hang_min_silence_s": 5.0, "agent_silence_s": 3.0}}},
        "entrypoint": {"command": sys.executable,
                       "args": [str(TRAIN), "--steps", str(STEPS), "--step-time", str(STEP_TIME_S), "--out", out],
                       "cwd": str(ROOT), "rendezvous": "external",
                       "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": environment()["PYTHONPATH"]}},
    }


def agent(cluster: Cluster, node: str, spare: bool, sysfs: Path, *extra: str) -> AgentProcess:
    marker = cluster.workdir / f"{node}.bad"
    checks = [{"name": "site", "command": f"test ! -e {marker} || {{ echo '{node}: DIMM errors'; exit 1; }}",
               "budget_s": 10}]
    flags = ["--checks", json.dumps(checks), "--links", "ib0", "--sysfs-net", str(sysfs), "--link-poll-s", "0.1",
             *(("--pool", POOL) if spare else ()), *extra]
    started = AgentProcess(cluster.workdir, node, cluster.nats.url, spare, *flags)
    cluster.extra.append(started)
    return started


class Checks:
    """Every node's `node.checked` records as they arrive, by node."""

    def __init__(self) -> None:
        self.by_node: dict[str, list[dict[str, Any]]] = {}

    async def on_checked(self, msg: Any) -> None:
        node = msg.subject.split(".")[3]  # recovery.ev.node.<node>.node.checked
        self.by_node.setdefault(node, []).append(orjson.loads(msg.data)["data"])

    def __call__(self, node: str) -> list[dict[str, Any]]:
        return self.by_node.get(node, [])


async def test_a_bad_node_fails_its_checks_its_ranks_go_to_the_spare_that_passes_and_it_stays_out_until_fixed(
        shared_cluster: Cluster, shared_fault_free: dict[str, Any]) -> None:
    cluster = shared_cluster
    out = cluster.workdir / f"{JOB}.pt"
    sysfs = cluster.workdir / "health-net"
    for node in ("h0", "h1", "hs0", "hs1"):
        (sysfs / node / "ib0").mkdir(parents=True, exist_ok=True)
        (sysfs / node / "ib0" / "operstate").write_text("up\n")
    agents: dict[str, AgentProcess] = {}
    nc = await connect(cluster.nats.url)
    try:
        checked = Checks()
        await nc.subscribe("recovery.ev.node.*.node.checked", cb=checked.on_checked)
        w = await watch(nc, JOB)
        agents.update({"h0": agent(cluster, "h0", False, sysfs / "h0"), "h1": agent(cluster, "h1", False, sysfs / "h1"),
                       # hs0 refreshes its checks every half second while idle: it goes bad before it is needed
                       "hs0": agent(cluster, "hs0", True, sysfs / "hs0", "--check-fresh-s", "1"),
                       "hs1": agent(cluster, "hs1", True, sysfs / "hs1")})

        def explain() -> str:
            decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
            checks = {n: [(c["when"], [r["ok"] for r in c["results"]]) for c in checked(n)] for n in agents}
            return f"--- decisions of {JOB}: {decisions}\n--- checks: {checks}\n{cluster.explain(JOB)}"

        await wait_until(lambda: all(checked(n) for n in agents), 60, "every node's checks at its start",
                         explain)
        assert all(c[0]["when"] == "join" and all(r["ok"] for r in c[0]["results"]) and
                   {r["check"] for r in c[0]["results"]} >= {"memory", "site"}
                   for c in (checked(n) for n in agents)), explain()

        await submit(nc, JOB, spec(str(out), cluster.store.port))
        await wait_until(lambda: all(w.step(r) >= FAULT_AT_STEP for r in range(4)), 120,
                         f"{JOB} to train {FAULT_AT_STEP} steps", explain)
        (cluster.workdir / "hs0.bad").touch()  # the idle spare goes bad: its next refresh fails
        await wait_until(lambda: any(not c["results"][-1]["ok"] for c in checked("hs0")), 30,
                         "hs0's refresh to fail", explain)
        moved = len(w.pids()[2])
        (cluster.workdir / "h1.bad").touch()
        (sysfs / "h1" / "ib0" / "operstate").write_text("down\n")  # a fault h1's agent reports: it checks at once
        await wait_until(lambda: "job.completed" in w.kinds() and out.exists(), 180, f"{JOB} to complete", explain)

        [failed] = [c for c in checked("h1") if c["when"] == "fault"]
        assert [r for r in failed["results"] if not r["ok"]] == [
            {"check": "site", "ok": False, "saw": "exit 1: h1: DIMM errors", "took_s": failed["results"][-1]["took_s"]}]
        confirmed = [d["data"]["reason"] for d in w.decided("fault.confirmed")]
        assert any("h1 failed its health checks: site: exit 1: h1: DIMM errors" in r for r in confirmed), explain()
        migrations = [c for d in w.decided("ranks.rescheduling") for c in d["data"]["commands"]
                      if c["kind"] == "migrate_ranks"]
        assert [(c["from_node"], c["to_node"]) for c in migrations] == [("h1", "hs1")], explain()
        started_on = {e["source"] for e in w.of("process.started") if e["data"]["attempt"] > 0}
        assert started_on == {"agent@hs1"}, explain()  # nothing ever started on hs0 nor again on h1
        assert len(w.pids()[2]) == moved + 1 and len(w.pids()[0]) == 1, w.pids()
        assert_bitwise_equal(torch.load(out), shared_fault_free)

        # h1, repaired but still bad, joins the pool again: its checks fail and it stays out; fixed, it passes
        agents["h1"].stop()
        (sysfs / "h1" / "ib0" / "operstate").write_text("up\n")
        before = len(checked("h1"))
        agents["h1"] = agent(cluster, "h1", True, sysfs / "h1")
        await wait_until(lambda: len(checked("h1")) > before, 60, "h1's checks as it joins again", explain)
        assert checked("h1")[-1]["when"] == "join" and not checked("h1")[-1]["results"][-1]["ok"]
        agents["h1"].stop()
        (cluster.workdir / "h1.bad").unlink()
        before = len(checked("h1"))
        agents["h1"] = agent(cluster, "h1", True, sysfs / "h1")
        await wait_until(lambda: len(checked("h1")) > before, 60, "h1's checks once fixed", explain)
        assert all(r["ok"] for r in checked("h1")[-1]["results"]), explain()
    finally:
        await nc.close()
        for name in ("hs0.bad", "h1.bad"):
            (cluster.workdir / name).unlink(missing_ok=True)
        for started in agents.values():
            started.stop()

"""Sharded state without a replica, on real processes: FSDP2 on a 1-D mesh of four ranks (examples/fsdp/train.py
`--replicas 1`, `recovery.client.fsdp` with `save_every`), on two agents of two ranks, a nats-server, a
`recovery-daemon`, a job store off the nodes and spares. Every few steps each rank's shards go to its node's memory
and, in the background, to its buddy node's. A node is lost (its agent, its ranks and its memory gone at once): its
ranks move to a spare, the other node's ranks keep their processes, and every rank resumes from the newest step
whose shards are all in memory on a live node: the survivors' from their own, the lost node's from their buddies'.
Nothing is read from storage, the engine's resume plan names the memory tier on the surviving node, and the run
ends bit for bit as the same script's run without faults. The node does not come back: the module has its own
cluster.

An elastic HSDP job that loses a node and finds no spare drops the replica group: the survivors keep their processes
and their shards (renumbered, each on the shards it holds), and each takes twice the share of the global batch. An
elastic FSDP job (`fsdp` layout) in the same case reshards: the survivors keep their processes and fill their new,
larger shards from the newest step whole in their node's memory, the lost node's shards from the copies it held.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery.agent.memory import memory_root
from tests.e2e_cluster import Cluster, start_cluster, through_a_fault
from tests.e2e_support import AgentProcess, JobWatch, connect, environment, kill_leftovers, wait_until, watch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fsdp" / "train.py"
EPOCHS = 3
SAMPLES = 1024  # 4 ranks x batch 16: 16 steps an epoch
STEP_TIME_S = 0.05
SAVE_EVERY = 4
FAULT_AT_STEP = 20
RUN_TIMEOUT_S = 180


WARM_POOL = "warm"
"""the pool of one more spare, the only agent here with standbys on: a job that takes its spares from it finds one
warm interpreter for each rank a node of it runs"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("sharded")) as state:
        state.agents.append(AgentProcess(state.workdir, "warm0", state.nats.url, True, "--pool", WARM_POOL,
                                         env={"RECOVERY_AGENT_STANDBY": "1", "RECOVERY_AGENT_STANDBY_DELAY_S": "0"}))
        yield state


def standby_pids(cluster: Cluster, node: str, job: str) -> set[int]:
    """The standbys the node's agent reported ready for the job."""
    log = (cluster.workdir / node / "agent.log").read_text(errors="replace")
    return {int(pid) for pid in re.findall(rf"standby of {re.escape(job)} ready \(pid (\d+)", log)}


def spec(cluster: Cluster, job: str, out: Path, storage: Path, nodes: list[str], replicas: int,
         extra: dict[str, Any] | None = None, save_every: int = SAVE_EVERY) -> dict[str, Any]:
    return {
        # The engine's `tp` counts the ranks of distinct state in one replica: FSDP's 4 shards, HSDP's 2 (a spec may
        # name FSDP's as `{dp: 4, fsdp: true}` instead, which a scale reshards)
        "nodes": nodes, "ranks_per_node": 2, "layout": {"dp": replicas, "tp": 4 // replicas},
        **(extra or {}),
        "watchdog_interval_s": 1.0,
        "policies": {"detection": {"name": "default", "params": {"hang_min_silence_s": 5.0,
                                                                 "agent_silence_s": 3.0}}},
        "entrypoint": {"command": sys.executable,
                       "args": [str(SCRIPT), "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--step-time",
                                str(STEP_TIME_S), "--recovery", "--replicas", str(replicas), "--shards",
                                str(4 // replicas), "--save-async-every", str(save_every), "--storage", str(storage),
                                "--out", str(out)],
                       "cwd": str(cluster.workdir), "rendezvous": "external",
                       "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cluster.store.port),
                               "PYTHONPATH": environment()["PYTHONPATH"], "OMP_NUM_THREADS": "1"}},
    }


Fault = Callable[[JobWatch, Callable[[], str]], Any]


async def run_job(cluster: Cluster, job: str, nodes: list[str], fault: Fault | None = None,
                  replicas: int = 1, extra: dict[str, Any] | None = None,
                  save_every: int = SAVE_EVERY) -> tuple[JobWatch, dict[str, Any], Path]:
    """Submit the job, let `fault` strike once every rank passed FAULT_AT_STEP, wait for the job to complete;
    returns what was seen, the final parameters and the job's storage directory."""
    import torch

    out, storage = cluster.workdir / f"{job}.pt", cluster.workdir / f"{job}-storage"
    nc = await connect(cluster.nats.url)
    w = await watch(nc, job)

    def explain() -> str:
        decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
        return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n{cluster.explain(job)}"

    try:
        await through_a_fault(cluster, nc, w, job, spec(cluster, job, out, storage, nodes, replicas, extra,
                                                         save_every), out, fault, explain, FAULT_AT_STEP, RUN_TIMEOUT_S)
    finally:
        await nc.close()
    return w, torch.load(out), storage


def resumes(cluster: Cluster, job: str) -> dict[int, str]:
    """Each rank's last "resumed at step S, its shards from X" line, by rank."""
    found: dict[int, str] = {}
    for log in sorted(cluster.workdir.glob(f"*/{job}.rank*.gen*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if " resumed at step " in line:
                found[int(line.split("rank ", 1)[1].split()[0])] = line.split("rank ", 1)[1]
    return found


def reference(cluster: Cluster, job: str, replicas: int) -> dict[str, Any]:
    """The final parameters of the script's run without faults (on n2 and n3, before the HSDP scale-in takes n2)."""
    import asyncio

    w, params, _ = asyncio.run(run_job(cluster, job, ["n2", "n3"], replicas=replicas))
    assert all(len(pids) == 1 for pids in w.pids().values()), w.pids()
    return params


@pytest.fixture(scope="module")
def fault_free(cluster: Cluster) -> dict[str, Any]:
    return reference(cluster, "fsdp-ref", 1)


@pytest.fixture(scope="module")
def hsdp_fault_free(cluster: Cluster) -> dict[str, Any]:
    return reference(cluster, "hsdp-ref", 2)


def assert_bitwise_equal(params: dict[str, Any], reference: dict[str, Any]) -> None:
    import torch

    assert params.keys() == reference.keys()
    for name in params:
        assert torch.equal(params[name], reference[name]), f"{name} differs from the run without faults"


async def test_a_lost_nodes_shards_come_back_from_its_buddys_memory_and_the_run_ends_as_the_fault_free_one(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    job = "fsdp-node-loss"
    lost_memory = memory_root(Path("/dev/shm"), "n0", cluster.workdir / "n0") / job
    measured: dict[str, float] = {}

    async def node_loss(w: JobWatch, explain: Callable[[], str]) -> None:
        def copied() -> list[int]:
            """Steps whose every shard's memory copy is on n1 (the buddy copies of n0's ranks among them)."""
            shards: dict[int, set[int]] = {}
            for e in w.of("checkpoint.saved"):
                if e["data"]["tier"] == "memory" and e["data"]["holder"] == "n1":
                    shards.setdefault(e["data"]["step"], set()).update(e["data"]["shards"])
            return sorted(step for step, have in shards.items() if have >= {0, 1, 2, 3})

        await wait_until(lambda: bool(copied()), 60, "every shard's copy in n1's memory", explain)
        # the spare of the job's pool keeps a warm interpreter for each rank a node of the job runs
        await wait_until(lambda: len(standby_pids(cluster, "warm0", job)) == 2, 120, "the spare's two standbys",
                         explain)
        ranks = [w.pids()[r][-1] for r in (0, 1)]
        step = max(w.step(r) for r in range(4))
        killed = time.monotonic()
        cluster.agent("n0").proc.kill()  # the host is gone: its agent, its ranks and its memory
        kill_leftovers(ranks)
        shutil.rmtree(lost_memory, ignore_errors=True)

        def recovered() -> bool:
            return all(any(e["data"]["rank"] == r and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                           and e["_seen"] > killed for e in w.of("progress.step")) for r in (0, 1))

        await wait_until(recovered, 120, "n0's ranks to train past the lost step on a spare", explain)
        measured["recovered_s"] = time.monotonic() - killed

    w, params, storage = await run_job(cluster, job, ["n0", "n1"], node_loss, extra={"spare_pool": WARM_POOL})
    pids = w.pids()
    seen = f"pids {pids}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert all(len(pids[r]) == 1 for r in (2, 3)), seen  # the surviving node's processes were kept
    assert all(len(pids[r]) == 2 for r in (0, 1)), seen
    # found when a survivor lost its peers' connections: the daemon asked n0's agent, and nothing listened for it
    faults = [d["data"].get("reason", "") for d in w.decided("fault.confirmed")]
    assert any(reason.startswith("agent of n0 unreachable") for reason in faults), faults
    moved = {e["source"].removeprefix("agent@") for e in w.of("process.started") if e["data"]["attempt"] >= 1}
    assert moved == {"warm0"}, moved
    # both moved ranks were handed to the spare's standbys, warm: no interpreter started for them
    assert {pids[r][1] for r in (0, 1)} <= standby_pids(cluster, "warm0", job), (pids, standby_pids(cluster, "warm0",
                                                                                                    job))
    assert "migrate" in [d["data"].get("detail", {}).get("granularity") for d in w.decided("attempt.started")], seen
    # every rank went back to one step, the lost ranks' shards sent from the buddy node's memory, none from storage
    lines = resumes(cluster, job)
    assert sorted(lines) == [0, 1, 2, 3], lines
    steps = {line.split(" resumed at step ")[1].split(",")[0] for line in lines.values()}
    assert len(steps) == 1, lines
    assert all("peer memory (n1)" in lines[r] for r in (0, 1)), lines
    assert all(lines[r].endswith("from memory") for r in (2, 3)), lines
    assert not any("storage" in line for line in lines.values()), lines
    # the engine's plan said the same: the memory tier, held on n1
    plans = [c["plan"] for d in w.decided("ranks.rescheduling") for c in d["data"].get("commands", [])
             if c.get("plan")]
    assert plans and plans[-1]["checkpoint_step"] == int(steps.pop()), plans
    assert {s["tier"] for s in plans[-1]["shards"]} == {"memory"}, plans
    assert all(s["holders"] == ["n1"] for s in plans[-1]["shards"]), plans
    assert storage.is_dir() and any(storage.glob("step*.mem")), "the agents persisted nothing to storage"
    assert_bitwise_equal(params, fault_free)
    print(f"FSDP node loss: first step past it {measured['recovered_s']:.2f}s later; {lines}")


async def test_a_preempted_nodes_ranks_and_the_running_ones_write_a_dying_dcp_checkpoint_and_no_step_is_lost(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """SIGTERM to n1's agent, as a platform preempting the node sends it: its ranks write their shards of a dying
    checkpoint at their step on the way out; a SIGTERM reads as the whole job's stop, but n3's ranks run on, and the
    engine asks them for the other shards of that step. The pieces make one DCP checkpoint that `dcp.load` reads
    into an unsharded model; the job restarts and every rank resumes at that step, none lost, and the run ends as
    the one without faults."""
    import signal

    import torch
    import torch.distributed.checkpoint as dcp

    from recovery.client import dcp_pieces

    job = "fsdp-preempted"

    async def preempt(w: JobWatch, explain: Callable[[], str]) -> None:
        cluster.agent("n1").proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: w.kinds().count("incident.closed") == 1, 120, "the job to resume", explain)

    # no copy in memory past the first steps: a step whole in memory at the preemption would make a dying checkpoint
    # unneeded (the engine asks for one only where it is newer than every whole step)
    # n1's ranks go to a spare of the shared pool once its agent has left (the warm pool's one served a test before)
    w, params, storage = await run_job(cluster, job, ["n3", "n1"], preempt, save_every=1000)
    seen = f"decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    [awaiting] = w.decided("checkpoint.awaiting")
    step = awaiting["data"]["detail"]["step"]
    assert awaiting["data"]["detail"]["savers"] == [0, 1], seen  # n3's ranks, asked: they got no SIGTERM
    saved = [e["data"] for e in w.of("checkpoint.saved") if e["data"]["tier"] == "dying" and e["data"]["step"] == step]
    assert {shard for s in saved for shard in s["shards"]} == {0, 1, 2, 3}, saved
    assert {s["holder"] for s in saved} == {"storage"}, saved  # on storage every node reads: it outlives n1
    exited = [e["data"] for e in w.of("process.exited") if e["data"]["rank"] in (2, 3)]
    assert exited and all(e.get("signal") == signal.SIGTERM for e in exited[:2]), exited
    plans = [d["data"]["detail"] for d in w.decisions if d["data"]["kind"] == "checkpoint.plan"]
    assert plans[-1]["checkpoint_step"] == step and plans[-1]["tiers"] == {"dying": 4}, plans
    lines = resumes(cluster, job)
    assert sorted(lines) == [0, 1, 2, 3] and all(f"resumed at step {step}," in line for line in lines.values()), lines
    assert all(line.endswith("from storage (a DCP dying checkpoint)") for line in lines.values()), lines
    assert w.decided("incident.closed")[0]["data"]["detail"]["lost_steps"] == 0, seen
    # the dying checkpoint is a DCP checkpoint like any other: an unsharded model and optimizer load it
    checkpoint = storage / dcp_pieces.name(step)
    assert (checkpoint / dcp_pieces.METADATA).exists(), sorted(p.name for p in checkpoint.iterdir())
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    model_keys = sorted(k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model."))
    assert model_keys == sorted(fault_free), model_keys
    whole = {name: torch.empty(tuple(metadata.state_dict_metadata[f"model.{name}"].size))  # type: ignore[union-attr]
             for name in model_keys}
    dcp.load({"model": whole}, checkpoint_id=str(checkpoint), no_dist=True)
    assert all(torch.isfinite(t).all() for t in whole.values())
    assert_bitwise_equal(params, fault_free)
    print(f"FSDP preemption: dying checkpoint at step {step}; {lines}")


async def test_an_hsdp_job_that_lost_both_replicas_of_a_shard_resumes_from_memory_with_every_process_kept_but_those(
        cluster: Cluster, hsdp_fault_free: dict[str, Any]) -> None:
    """On a 2 x 2 mesh ranks 1 and 3 hold shard 1: both SIGKILLed at once leave no live replica of it. They restart
    in place, and every rank goes back to the newest step whose shards are in memory (each on its own node)."""
    job = "hsdp-both-replicas"

    async def kill_both(w: JobWatch, explain: Callable[[], str]) -> None:
        await wait_until(lambda: any(e["data"]["tier"] == "memory" for e in w.of("checkpoint.saved")), 60,
                         "a memory checkpoint", explain)
        step = max(w.step(r) for r in range(4))
        kill_leftovers([w.pids()[1][-1], w.pids()[3][-1]])

        def recovered() -> bool:
            return all(any(e["data"]["rank"] == r and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                           for e in w.of("progress.step")) for r in (1, 3))

        await wait_until(recovered, 120, "ranks 1 and 3 to train past the lost step", explain)

    w, params, _ = await run_job(cluster, job, ["n2", "n3"], kill_both, replicas=2)
    pids = w.pids()
    seen = f"pids {pids}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert all(len(pids[r]) == 1 for r in (0, 2)) and all(len(pids[r]) >= 2 for r in (1, 3)), seen
    assert not any(d["data"].get("detail", {}).get("granularity") == "restart_job"
                   for d in w.decided("attempt.started")), seen
    lines = resumes(cluster, job)
    assert sorted(lines) == [0, 1, 2, 3] and all(line.endswith("from memory") for line in lines.values()), lines
    assert_bitwise_equal(params, hsdp_fault_free)


async def test_an_elastic_hsdp_job_without_a_spare_drops_a_replica_group_and_keeps_the_global_batch(
        cluster: Cluster, hsdp_fault_free: dict[str, Any], fault_free: dict[str, Any]) -> None:
    """n2 (ranks 0 and 1: replica group 0) is lost and the job's pool has no spare: the job scales in to one replica
    group on n3, whose ranks 2 and 3 become 0 and 1, keep their processes and their shards (no shard moves: a scale
    changes the replica groups, never the shards of one), and take 32 samples a step each instead of 16: the global
    batch of 64 stays. The same samples make each step as without the fault, summed in another order: the result is
    the fault-free one to float rounding, not bit for bit. n2 does not come back: the FSDP reference the test after
    compares with is run first, on n2 and n3 (`fault_free`, taken here for that alone)."""
    import torch

    job = "hsdp-scale-in"
    survivors: dict[int, int] = {}

    async def node_loss(w: JobWatch, explain: Callable[[], str]) -> None:
        survivors.update({r: w.pids()[r][-1] for r in (2, 3)})
        lost = [w.pids()[r][-1] for r in (0, 1)]
        cluster.agent("n2").proc.kill()
        kill_leftovers(lost)
        await wait_until(lambda: any(d["data"].get("detail", {}).get("granularity") == "scale_in"
                                     for d in w.decided("incident.closed")), 120, "the job to scale in", explain)

    w, params, _ = await run_job(cluster, job, ["n2", "n3"], node_loss, replicas=2,
                                 extra={"elastic": {"min_dp": 1, "max_dp": 2}, "spare_pool": "no-such-pool"})
    seen = f"pids {w.pids()}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert not [e for e in w.of("process.started") if e["data"]["attempt"] >= 1], seen  # nothing restarted
    assert all(w.pids()[r] == [pid] for r, pid in survivors.items()), seen
    scales = [c for d in w.decided("ranks.rescheduling") for c in d["data"].get("commands", [])
              if c["kind"] == "scale_job"]
    assert [(c["dp"], c["nodes"]) for c in scales] == [(1, ["n3"])], scales
    # no rank went back to a checkpoint: the survivors' shards were live
    assert not resumes(cluster, job), resumes(cluster, job)
    assert params.keys() == hsdp_fault_free.keys()
    for name in params:
        assert torch.allclose(params[name], hsdp_fault_free[name], rtol=1e-4, atol=1e-6), name


async def test_an_elastic_fsdp_job_without_a_spare_reshards_onto_the_survivors_from_node_memory(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """FSDP on a 1-D mesh of four ranks, declared `{dp: 4, fsdp: true}`, elastic: spare3 (ranks 2 and 3) is lost and
    the job's pool has no spare. It scales in to n3's two ranks, which keep their processes, build the model on a
    mesh of two and fill each new shard (half the state, where each held a quarter) from the newest step whose four
    old shards are in n3's memory: their own and spare3's, which n3 held as their buddy. Nothing is read from storage
    and no process starts; each rank takes twice the share of the global batch. Last in the module: spare3 does not
    come back (n2 went in the test before)."""
    import torch

    job = "fsdp-scale-in"
    survivors: dict[int, int] = {}

    async def node_loss(w: JobWatch, explain: Callable[[], str]) -> None:
        def copied() -> bool:
            shards: dict[int, set[int]] = {}
            for e in w.of("checkpoint.saved"):
                if e["data"]["tier"] == "memory" and e["data"]["holder"] == "n3":
                    shards.setdefault(e["data"]["step"], set()).update(e["data"]["shards"])
            return any(have >= {0, 1, 2, 3} for have in shards.values())

        await wait_until(copied, 60, "every shard's copy in n3's memory", explain)
        survivors.update({r: w.pids()[r][-1] for r in (0, 1)})
        lost = [w.pids()[r][-1] for r in (2, 3)]
        cluster.agent("spare3").proc.kill()
        kill_leftovers(lost)
        await wait_until(lambda: any(d["data"].get("detail", {}).get("granularity") == "scale_in"
                                     for d in w.decided("incident.closed")), 120, "the job to scale in", explain)

    w, params, _ = await run_job(cluster, job, ["n3", "spare3"], node_loss,
                                 extra={"layout": {"dp": 4, "fsdp": True}, "elastic": {"min_dp": 2, "max_dp": 4},
                                        "spare_pool": "no-such-pool"})
    seen = f"pids {w.pids()}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert not [e for e in w.of("process.started") if e["data"]["attempt"] >= 1], seen  # nothing restarted
    assert all(w.pids()[r] == [pid] for r, pid in survivors.items()), seen
    scales = [c for d in w.decided("ranks.rescheduling") for c in d["data"].get("commands", [])
              if c["kind"] == "scale_job"]
    assert [(c["dp"], c["nodes"], c["kept"]) for c in scales] == [(2, ["n3"], [0, 1])], scales
    plan = scales[0]["plan"]
    assert [s["shard"] for s in plan["shards"]] == [0, 1, 2, 3], plan  # the old world's four shards, to reshard
    assert {s["tier"] for s in plan["shards"]} == {"memory"} and all(s["holders"] == ["n3"] for s in plan["shards"])
    lines = resumes(cluster, job)
    assert sorted(lines) == [0, 1], lines
    assert all(f"resumed at step {plan['checkpoint_step']}," in line for line in lines.values()), (lines, plan)
    assert all(line.endswith("from memory (resharded from 4 shards)") for line in lines.values()), lines
    # the same samples make each step as without the fault, summed in another order: float rounding apart
    assert params.keys() == fault_free.keys()
    for name in params:
        assert torch.allclose(params[name], fault_free[name], rtol=1e-4, atol=1e-6), name

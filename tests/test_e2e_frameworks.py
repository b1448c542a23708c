"""Training frameworks and sharded state on real processes, with the real packages: a Lightning `Trainer` script
whose strategy is `RecoveryDDPStrategy` (examples/lightning/train.py), an Accelerate script using
`recovery.client.accelerate` (examples/accelerate/train.py) and an HSDP script using `recovery.client.fsdp`
(examples/fsdp/train.py, FSDP2 on a 2 x 2 mesh), each on a nats-server, a `recovery-daemon`, two agents of two
ranks each and a job store off the nodes. A SIGKILLed rank is restarted alone, the three others keep their
processes, and the run ends with the parameters of the same script's run without faults, bit for bit: the
survivors ran the failed step again, and the restarted rank took the live state (Lightning's whole checkpoint,
built in memory; Accelerate's model, optimizer and scheduler; HSDP's shards of its replica) and resumed at the
survivors' batch. They run on the session's shared cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_cluster import Cluster, through_a_fault
from tests.e2e_support import JobWatch, connect, environment, wait_until, watch

ROOT = Path(__file__).resolve().parents[1]
LIGHTNING = ROOT / "examples" / "lightning" / "train.py"
ACCELERATE = ROOT / "examples" / "accelerate" / "train.py"
HSDP = ROOT / "examples" / "fsdp" / "train.py"
EPOCHS = 3
SAMPLES = 1024  # 4 ranks x batch 16: 16 steps an epoch
STEP_TIME_S = 0.05
FAULT_AT_STEP = 20  # in the second epoch: the restarted rank resumes mid-epoch
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's cluster (tests/e2e_cluster.py): these jobs run on n0 and n1, two ranks each, and leave the
    nodes as they found them."""
    return shared_cluster


def script_args(script: Path, job: str, out: Path, workdir: Path) -> list[str]:
    args = [str(script), "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--step-time", str(STEP_TIME_S),
            "--out", str(out)]
    if script == LIGHTNING:  # each job its own checkpoints: `fit(ckpt_path="last")` must not find another's
        return [*args, "--strategy", "recovery", "--checkpoints", str(workdir / f"{job}-checkpoints")]
    return [*args, "--recovery"]  # Accelerate's and HSDP's scripts: the SDK's integration


def spec(cluster: Cluster, job: str, out: Path, script: Path) -> dict[str, Any]:
    return {
        "nodes": ["n0", "n1"], "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": 1.0,
        "policies": {"detection": {"name": "default", "params": {"hang_min_silence_s": 5.0,
                                                                 "agent_silence_s": 3.0}}},
        "entrypoint": {"command": sys.executable, "args": script_args(script, job, out, cluster.workdir),
                       "cwd": str(cluster.workdir), "rendezvous": "external",
                       "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cluster.store.port),
                               "PYTHONPATH": environment()["PYTHONPATH"], "OMP_NUM_THREADS": "1"}},
    }


Fault = Callable[[JobWatch, Callable[[], str]], Any]


async def run_job(cluster: Cluster, job: str, script: Path,
                  fault: Fault | None = None) -> tuple[JobWatch, dict[str, Any]]:
    """Submit the job, let `fault(watch, explain)` strike once every rank passed FAULT_AT_STEP, wait for the job
    to complete; returns what was seen and the final parameters."""
    import torch

    out = cluster.workdir / f"{job}.pt"
    nc = await connect(cluster.nats.url)
    w = await watch(nc, job)

    def explain() -> str:
        decisions = [(d["data"]["kind"], d["data"].get("reason", "")) for d in w.decisions]
        logs = "\n".join(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted(cluster.workdir.glob(f"n*/{job}.rank*.log")))
        return f"--- decisions of {job}: {decisions}\n--- pids: {w.pids()}\n{logs}\n{cluster.explain(job)}"

    try:
        await through_a_fault(cluster, nc, w, job, spec(cluster, job, out, script), out, fault, explain, FAULT_AT_STEP,
                              RUN_TIMEOUT_S)
    finally:
        await nc.close()
    loaded: dict[str, Any] = torch.load(out)
    return w, loaded


def sigkill(victim: int, measured: dict[str, float]) -> Fault:
    """SIGKILL `victim`; `measured['recovered_s']`: from the kill to its replacement's first step past the step
    the job was on."""

    async def strike(w: JobWatch, explain: Callable[[], str]) -> None:
        step = max(w.step(r) for r in range(4))
        killed = time.monotonic()
        os.kill(w.pids()[victim][-1], signal.SIGKILL)

        def recovered() -> bool:
            return any(e["data"]["rank"] == victim and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                       and e["_seen"] > killed for e in w.of("progress.step"))

        await wait_until(recovered, 120, f"rank {victim} to be recovered", explain)
        measured["recovered_s"] = time.monotonic() - killed

    return strike


def assert_bitwise_equal(found: dict[str, Any], reference: dict[str, Any]) -> None:
    import torch

    assert found.keys() == reference.keys()
    for name in found:
        assert torch.equal(found[name], reference[name]), f"{name} differs from the run without faults"


def assert_restarted_alone(w: JobWatch, victim: int) -> None:
    pids = w.pids()
    seen = f"pids {pids}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert all(len(pids[r]) == 1 for r in range(4) if r != victim), seen  # the survivors kept their processes
    assert len(pids[victim]) == 2, seen
    granularities = [d["data"]["detail"].get("granularity") for d in w.decided("attempt.started")]
    assert granularities == ["in_place"], seen


def fault_free(cluster: Cluster, job: str, script: Path) -> dict[str, Any]:
    """The final parameters of `script`'s run without faults: the reference of its recovered runs."""
    w, params = asyncio.run(run_job(cluster, job, script))
    seen = f"pids {w.pids()}; decisions {[(d['data']['kind'], d['data'].get('reason', '')) for d in w.decisions]}"
    assert all(len(pids) == 1 for pids in w.pids().values()), seen
    return params


@pytest.fixture(scope="module")
def lightning_fault_free(cluster: Cluster) -> dict[str, Any]:
    return fault_free(cluster, "lightning-ref", LIGHTNING)


@pytest.fixture(scope="module")
def accelerate_fault_free(cluster: Cluster) -> dict[str, Any]:
    return fault_free(cluster, "accelerate-ref", ACCELERATE)


async def test_a_lightning_rank_killed_is_restarted_alone_and_the_trainer_ends_as_the_fault_free_run(
        cluster: Cluster, lightning_fault_free: dict[str, Any]) -> None:
    measured: dict[str, float] = {}
    w, params = await run_job(cluster, "lightning-kill", LIGHTNING, sigkill(1, measured))
    assert_restarted_alone(w, 1)
    assert_bitwise_equal(params, lightning_fault_free)
    # the strategy reports steps and Lightning's checkpoints: the capabilities say so, no guess
    announced = {cap for e in w.of("process.capabilities") for cap in e["data"]["caps"]}
    assert {"reform", "steps", "checkpoints"} <= announced and "save" not in announced, announced
    print(f"Lightning, SIGKILL of rank 1: first step past it {measured['recovered_s']:.2f}s later; pids {w.pids()}")


async def test_an_accelerate_rank_killed_is_restarted_alone_and_the_script_ends_as_the_fault_free_run(
        cluster: Cluster, accelerate_fault_free: dict[str, Any]) -> None:
    measured: dict[str, float] = {}
    w, params = await run_job(cluster, "accelerate-kill", ACCELERATE, sigkill(2, measured))
    assert_restarted_alone(w, 2)
    assert_bitwise_equal(params, accelerate_fault_free)
    print(f"Accelerate, SIGKILL of rank 2: first step past it {measured['recovered_s']:.2f}s later; pids {w.pids()}")


@pytest.fixture(scope="module")
def hsdp_fault_free(cluster: Cluster) -> dict[str, Any]:
    return fault_free(cluster, "hsdp-ref", HSDP)


async def test_an_hsdp_rank_killed_takes_its_shards_from_its_replica_and_the_run_ends_as_the_fault_free_one(
        cluster: Cluster, hsdp_fault_free: dict[str, Any]) -> None:
    """A (replicate 2, shard 2) mesh, a replica group per node: rank 1 (replica 0, shard 1) is killed; rank 3 holds
    the same shards on the other node. The survivors keep their processes and build the mesh and the model again;
    the restarted rank takes its parameters' and optimizer's shards from rank 3."""
    measured: dict[str, float] = {}
    w, params = await run_job(cluster, "hsdp-kill", HSDP, sigkill(1, measured))
    assert_restarted_alone(w, 1)
    assert_bitwise_equal(params, hsdp_fault_free)
    print(f"HSDP 2x2, SIGKILL of rank 1: first step past it {measured['recovered_s']:.2f}s later; pids {w.pids()}")

"""Sharded state without a replica: FSDP2 on a 1-D mesh (examples/fsdp/train.py `--replicas 1`), part of
`python tools/bench.py e2e --only fsdp` (after the HSDP script of `tools/bench_frameworks.py`), or on its own:

    python tools/bench_sharded.py --repeat 3

- `fsdp_node_loss_ratio_to_torchrun`: a node of two is lost (its agent and its two ranks SIGKILLed, its shared
  memory removed: the host is gone) once the job printed step `fault_at` and the spare's standbys are ready (an idle
  spare on a cluster has them seconds after the job's acceptance; here it shares two cores with four training ranks
  and takes half a minute), under `recovery-run --nnodes 2 --spares 1` with `recovery.client.fsdp` (`save_every`:
  shards in node memory, copied to the buddy node): the time from the loss to the first step printed past the last
  one printed before it. Against the stock script under torchrun on one host, the same two ranks SIGKILLed at the
  same step: torchrun restarts every rank from the last epoch's DCP checkpoint. That is a lower bound on torchrun's
  node loss (no node to replace, no rendezvous to wait out), against ours with the loss found by the daemon's probe
  (a survivor lost its peers' connections; nothing listens for the lost agent) and the ranks moved to the spare's
  standbys. Median of the per-repeat ratios; goal at most 0.3.
- `fsdp_node_loss_read_storage`: 1 when any rank of the recovered runs resumed from storage, else 0 (goal 0).
- `fsdp_node_loss_equal_to_fault_free`: 1 when every recovered run ended bit for bit as the fault-free one.
- `fsdp_save_async_stall_ratio_to_dcp_save`: the training stall of `save_async` (the copy into node memory; the
  buddy copy runs in the background) against `torch.distributed.checkpoint.save` of the same state (37 MB a rank),
  in the same two processes, alternating (`tools/fsdp_stall_probe.py`). Goal at most 0.2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import ROOT, Emit, sigterm_unwinds
from bench_harness_launch import HSDP, Run, kill_once, rank_pid, script_args, standbys_ready

from recovery.agent.memory import memory_root

PROBE = ROOT / "tools" / "fsdp_stall_probe.py"
SAVE_EVERY = 4


def agent_pid(data: Path, node: str) -> int | None:
    """The `recovery-agent` of `node` that `recovery-run` started with its data in `data`."""
    wanted = [b"--node", node.encode(), str(data / "agents" / node).encode()]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                words = (entry / "cmdline").read_bytes().split(b"\0")
                if all(word in words for word in wanted):
                    return int(entry.name)
    return None


def ours_args(workdir: Path, tag: str, out: Path) -> list[str]:
    return [*script_args(HSDP, workdir, tag), "--recovery", "--replicas", "1", "--save-async-every",
            str(SAVE_EVERY), "--storage", str(workdir / f"{tag}-storage"), "--out", str(out)]


def spare_standbys_ready(data: Path) -> int:
    return standbys_ready(data, "agents/spare0/*.standby*.log")


def node_loss_once(workdir: Path, tag: str, fault_at: int) -> tuple[float, Path, int]:
    """Seconds from node0's loss to a step printed past the last one before it, the run's data directory, and the
    step it was lost at (past `fault_at` once the spare's standbys are ready)."""
    out = workdir / f"{tag}.pt"
    run = Run("recovery-run", ours_args(workdir, tag, out), workdir, tag, "--nnodes", "2", "--spares", "1",
              "--shards", "4", nproc=2)
    try:
        run.wait_for(lambda: any(step >= fault_at for _, step in run.steps()), f"step {fault_at}")
        # The spare's standbys, one for each rank of a node: on a cluster an idle spare has them ready seconds after
        # the job's acceptance; here it shares two cores with the four training ranks, and takes half a minute.
        run.wait_for(lambda: spare_standbys_ready(run.data) >= 2, "the spare's standbys")
        agent = agent_pid(run.data, "node0")
        ranks = [rank_pid(tag, r, run.data) for r in (0, 1)]
        assert agent is not None and None not in ranks, f"node0's agent {agent} or ranks {ranks} not found"
        seen = max(step for _, step in run.steps())
        lost = time.monotonic()
        for pid in [agent, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
        shutil.rmtree(memory_root(Path("/dev/shm"), "node0", run.data / "agents" / "node0"), ignore_errors=True)
        prefix = b"[rank0."  # the moved rank's lines carry its generation
        run.wait_for(lambda: any(step > seen for _, step in run.steps(lost, prefix)), f"a step past {seen}")
        regained = min(t for t, step in run.steps(lost, prefix) if step > seen) - lost
        run.wait_for(lambda: run.proc.poll() is not None, "the run's end", timeout=600)
        return regained, run.data, seen
    finally:
        run.stop()


def resumed_from(data: Path) -> list[str]:
    """The sources the ranks' "resumed at step" lines name."""
    return [line.split("its shards from ", 1)[1] for log in data.glob("agents/*/*.rank*.gen*.log")
            for line in log.read_text(errors="replace").splitlines() if "its shards from " in line]


def measure(repeat: int, workdir: Path, emit: Emit, quick: bool = False) -> None:
    import torch

    fault_at = 12 if quick else 20
    reference = workdir / "fsdp-reference.pt"
    run = Run("recovery-run", ours_args(workdir, "fsdp-reference", reference), workdir, "fsdp-reference",
              "--nnodes", "2", "--shards", "4", nproc=2)
    try:
        run.wait_for(lambda: run.proc.poll() is not None, "the fault-free run's end", timeout=600)
    finally:
        run.stop()
    ours: list[float] = []
    theirs: list[float] = []
    storage_read = 0
    equal: list[int] = []
    for index in range(repeat):
        tag = f"fsdp-{index}"
        seconds, data, lost_at = node_loss_once(workdir, tag, fault_at)
        ours.append(seconds)
        sources = resumed_from(data)
        storage_read = max(storage_read, int(not sources or any("storage" in s for s in sources)))
        full, fault_free = torch.load(workdir / f"{tag}.pt"), torch.load(reference)
        equal.append(int(full.keys() == fault_free.keys() and all(torch.equal(full[k], fault_free[k]) for k in full)))
        tag = f"fsdp_torchrun-{index}"
        theirs.append(kill_once("torchrun", [*script_args(HSDP, workdir, tag), "--replicas", "1"], workdir, tag,
                                lost_at, victims=(0, 1))[0])  # the same step: as many redone since its checkpoint
        print(f"fsdp node loss {index}: {ours[-1]:.2f}s (from {sorted(set(sources))}, equal {equal[-1]}), torchrun "
              f"{theirs[-1]:.2f}s", file=sys.stderr, flush=True)
    emit("e2e", "fsdp_node_loss_regained_s", round(statistics.median(ours), 3), "s from the node's loss to a step "
         "past it")
    emit("e2e", "fsdp_torchrun_regained_s", round(statistics.median(theirs), 3), "s, the stock script under torchrun "
         "(its two ranks killed)")
    emit("e2e", "fsdp_node_loss_ratio_to_torchrun",
         round(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)), 3), "x (goal at most 0.3)")
    emit("e2e", "fsdp_node_loss_read_storage", storage_read, "(0: no shard was read from storage)")
    emit("e2e", "fsdp_node_loss_equal_to_fault_free", min(equal), "(1: every run ended bit for bit as the fault-free "
         "one)")
    stalls = [stall_once(workdir, f"stall-{index}") for index in range(repeat)]
    emit("e2e", "fsdp_save_async_stall_s", round(statistics.median(s["save_async_s"] for s in stalls), 4),
         f"s a save, {stalls[0]['state_bytes'] / 1e6:.0f} MB a rank")
    emit("e2e", "fsdp_dcp_save_stall_s", round(statistics.median(s["dcp_save_s"] for s in stalls), 4), "s a save")
    emit("e2e", "fsdp_save_async_stall_ratio_to_dcp_save",
         round(statistics.median(s["save_async_s"] / s["dcp_save_s"] for s in stalls), 3), "x (goal at most 0.2)")


def stall_once(workdir: Path, tag: str) -> dict[str, float]:
    out = workdir / f"{tag}.json"
    run = Run("recovery-run", [str(PROBE), "--out", str(out)], workdir, tag, "--nnodes", "2", "--shards", "2",
              nproc=1)
    try:
        run.wait_for(lambda: run.proc.poll() is not None, "the stall probe's end", timeout=600)
    finally:
        run.stop()
    result: dict[str, float] = json.loads(out.read_text())
    if result.get("buddy_copies", 0) < 1:
        raise RuntimeError(f"{tag}: no copy reached the buddy node: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    def emit(bench: str, metric: str, value: float, unit: str) -> None:
        print(f"{bench}.{metric} = {value} {unit}", flush=True)

    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="bench-sharded-") as workdir:
        measure(args.repeat, Path(workdir), emit, quick=args.quick)


if __name__ == "__main__":
    main()

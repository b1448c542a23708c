"""The `collective` health check, in processes of their own (the agent never imports torch): two local processes
form a process group with the job's backend (nccl on a GPU node, one GPU each; gloo on a CPU node) through a file
store and all-reduce a few MiB. Standard library and torch only: it runs in the interpreter `check_python` names.

    python -m recovery.agent.checks.collective --backend nccl

Exit status 0 when the sum is right on every process; the last line of its output says what it saw. A node with one
GPU forms a group of one on nccl (two processes on one GPU is not a group NCCL forms).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

ELEMENTS = 1 << 20  # 4 MiB of float32


def member(backend: str, rank: int, world: int, store: str) -> int:
    """One process of the group: all-reduce `rank + 1` everywhere, and check the sum."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        tensor = torch.full((ELEMENTS,), float(rank + 1), device=device)
        started = time.monotonic()
        dist.all_reduce(tensor)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        took = time.monotonic() - started
        expected = world * (world + 1) / 2
        wrong = int((tensor != expected).sum())
    finally:
        dist.destroy_process_group()
    if wrong:
        print(f"rank {rank}: {wrong} of {ELEMENTS} elements wrong after all_reduce on {backend}")
        return 1
    print(f"all_reduce of {ELEMENTS * 4 >> 20} MiB over {world} process(es) on {backend}: {took * 1000:.1f} ms")
    return 0


def gpus() -> int:
    """The GPUs this node shows its processes, without importing torch here (the members do)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a member's own
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return member(args.backend, args.rank, args.world, args.store)
    world = min(2, max(1, gpus())) if args.backend == "nccl" else 2
    with tempfile.TemporaryDirectory(prefix="recovery-collective-") as folder:
        store = os.path.join(folder, "store")
        members = [subprocess.Popen([sys.executable, "-m", "recovery.agent.checks.collective", "--backend",
                                     args.backend, "--rank", str(rank), "--world", str(world), "--store", store],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for rank in range(world)]
        said = [member.communicate()[0] for member in members]
    for rank, (process, output) in enumerate(zip(members, said, strict=True)):
        lines = [line for line in output.splitlines() if line.strip()]
        if process.returncode != 0:
            print(f"rank {rank} exited {process.returncode}: {lines[-1] if lines else 'no output'}")
            return 1
    lines = [line for line in said[0].splitlines() if line.strip()]
    print(lines[-1] if lines else "all_reduce done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

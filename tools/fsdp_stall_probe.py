"""The training stall of `recovery.client.fsdp`'s `save_async` (the copy into node memory; the copy to the buddy
node runs in the background, overlapping the steps between saves) against `torch.distributed.checkpoint.save` of
the same sharded state, in the same processes, alternating. Run by `tools/bench_sharded.py` under `recovery-run`
(the agents give the memory tier), two nodes of one rank each:

    recovery-run --standalone --nnodes 2 --nproc-per-node 1 tools/fsdp_stall_probe.py --out stall.json

Rank 0 writes the medians of both stalls (seconds) as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--width", type=int, default=1024, help="the model's layers are width x width")
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--saves", type=int, default=7)
parser.add_argument("--steps-between", type=int, default=3, help="training steps between two saves")
parser.add_argument("--out", required=True)
args = parser.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import recovery.client.fsdp as resilient  # noqa: E402  # first: it connects to the node's agent


def build(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    # saves are called below, between steps, not at the step boundaries of `batches`: a period never reached
    training = resilient.init_process_group(mesh_shape=(world,), timeout_s=120, save_every=10**9)
    model, optimizer = training.build(build)
    inputs = torch.randn(8, args.width)
    directory = Path(tempfile.mkdtemp(prefix="dcp-stall-")) if dist.get_rank() == 0 else None
    shared = [str(directory) if directory else ""]
    dist.broadcast_object_list(shared, src=0)
    ours: list[float] = []
    theirs: list[float] = []
    step = 0
    try:
        for save in range(args.saves):
            for _ in range(args.steps_between):
                optimizer.zero_grad()
                model(inputs).square().mean().backward()
                optimizer.step()
                step += 1
            dist.barrier()
            began = time.perf_counter()
            training.save_async(step)
            ours.append(time.perf_counter() - began)
            dist.barrier()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            began = time.perf_counter()
            dcp.save(state, checkpoint_id=f"{shared[0]}/step{save}")
            theirs.append(time.perf_counter() - began)
        assert training._copies is not None
        training._copies.wait()
        copied = training._copies.copied
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    if dist.get_rank() == 0:
        # the first save of each allocates (memory pages, files): the steady stall is the median of the rest
        result = {"save_async_s": statistics.median(ours[1:]), "dcp_save_s": statistics.median(theirs[1:]),
                  "buddy_copies": copied, "state_bytes": sum(p.numel() * p.element_size() * 3
                                                             for p in model.parameters()) // world}
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

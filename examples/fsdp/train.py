"""An FSDP2 training loop (`fully_shard`) on an HSDP mesh (replica groups x shards) or, with `--replicas 1`, a 1-D
one: the shape torchtitan and PyTorch's FSDP2 example use, on synthetic data. `--recovery` uses
`recovery.client.fsdp` (the lines marked `# recovery:`): the survivors of a fault keep their processes; a killed
HSDP rank takes its shards from its replica, and without a replica (`--replicas 1`, `--save-async-every N`) every
rank resumes from the newest step whose shards are all in node memory, a lost node's from its buddy node. Without
it, the script is a stock one: torchrun restarts every rank, which resume from the last epoch's checkpoint
(`torch.distributed.checkpoint`).

    recovery-run --standalone --nproc-per-node 4 examples/fsdp/train.py --recovery --out final.pt
    recovery-run --standalone --nproc-per-node 4 examples/fsdp/train.py --recovery --replicas 1 \
        --save-async-every 4 --out final.pt
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--recovery", action="store_true")
parser.add_argument("--replicas", type=int, default=2,
                    help="the mesh's replica groups (its first dimension); 1: FSDP on a 1-D mesh, no replica")
parser.add_argument("--save-async-every", type=int, default=0,
                    help="with --recovery: every that many steps, the shards go to node memory and a buddy node's")
parser.add_argument("--storage", default="", help="with --recovery: where the agents persist the memory copies")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=1024)
parser.add_argument("--shards", type=int, default=0,
                    help="HSDP: the shards of one replica group (default: the world over --replicas); an elastic "
                         "job's scale changes the replica groups, never this")
parser.add_argument("--global-batch", type=int, default=64,
                    help="samples a step over every rank: each rank takes its share of the world it trains in")
parser.add_argument("--step-time", type=float, default=0.0)
parser.add_argument("--checkpoints", default="", help="the stock script's DCP checkpoint directory")
parser.add_argument("--out", default="")
args = parser.parse_args()

if args.recovery:
    import recovery.client.fsdp as resilient  # recovery: first, it connects to the node's agent

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def build(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank the same initial weights, as FSDP expects
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    shards = args.shards or world // args.replicas
    shape = (world,) if args.replicas == 1 else (world // shards, shards)
    names = ("shard",) if args.replicas == 1 else ("replicate", "shard")
    if args.recovery:
        training = resilient.init_process_group(  # recovery: was init_process_group
            mesh_shape=shape, timeout_s=60, save_every=args.save_async_every, storage=args.storage or None)
        training.build(build)  # recovery: was model, optimizer = build(init_device_mesh(...))
        epochs, batches = resilient.epochs, resilient.batches
    else:
        dist.init_process_group("gloo")
        model, optimizer = build(init_device_mesh("cpu", shape, mesh_dim_names=names))

        def epochs(start: int, stop: int) -> range:
            return range(start, stop)

        def batches(loader: DataLoader, epoch: int) -> object:
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            return enumerate(loader)

    generator = torch.Generator().manual_seed(1234)
    source = torch.randn(args.samples, 32, generator=generator)
    data = TensorDataset(source, source.sum(dim=1, keepdim=True) * 0.1)

    def loader_now() -> DataLoader:
        # Each rank its share of the global batch in the world it trains in now: an elastic job's scale changes it
        world_now, rank_now = dist.get_world_size(), dist.get_rank()
        return DataLoader(data, batch_size=args.global_batch // world_now,
                          sampler=DistributedSampler(data, world_now, rank_now, seed=7))

    first = 0
    if not args.recovery and args.checkpoints and (Path(args.checkpoints) / "epoch").exists():
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=args.checkpoints)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = int((Path(args.checkpoints) / "epoch").read_text()) + 1

    def train() -> None:
        if args.recovery:
            model, optimizer = training.model, training.optimizer  # recovery: built again after a fault
        else:
            model, optimizer = globals()["model"], globals()["optimizer"]
        loader = loader_now()
        for epoch in epochs(first, args.epochs):  # recovery: from the epoch a recovery resumes in
            for index, (inputs, targets) in batches(loader, epoch):  # recovery: skips the batches done
                optimizer.zero_grad()
                F.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                if args.step_time:
                    time.sleep(args.step_time)
                print(f"[rank {dist.get_rank()}] trained step {epoch * len(loader) + index + 1}", flush=True)
            if not args.recovery and args.checkpoints:
                dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                         checkpoint_id=args.checkpoints)
                if dist.get_rank() == 0:
                    (Path(args.checkpoints) / "epoch").write_text(str(epoch))

    if args.recovery:
        resilient.run(train)  # recovery: recovers from a failed step and trains on
        model = training.model
    else:
        globals().update(model=model, optimizer=optimizer)
        train()
    full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}  # a collective: every rank
    if dist.get_rank() == 0 and args.out:
        torch.save(full, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

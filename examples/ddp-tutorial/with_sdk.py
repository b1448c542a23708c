"""A DistributedDataParallel training script as the PyTorch tutorials write it, twice: `original.py` as it is, for
torchrun, and `with_sdk.py`, the same script converted to recovery's SDK (`recovery.client.ddp`), whose survivors
recover in-process when a rank dies: the dead rank alone is restarted, the others keep their processes, re-form
the process group, hand it their state and go on at the interrupted step. docs/ml-engineer.md shows the diff.

    torchrun --standalone --nproc-per-node 2 original.py --epochs 6 --snapshot snapshot.pt --out final.pt
    recovery-run --standalone --nproc-per-node 2 with_sdk.py --epochs 6 --snapshot snapshot.pt --out final.pt

The tutorial's shape: `init_process_group("gloo")` from torchrun's environment (env://), a DistributedSampler over
a dataset, an epoch loop, rank 0 saving a snapshot (model, optimizer, epochs run) at the end of every epoch, and
every rank resuming from that snapshot when it starts. Made deterministic for tests (a synthetic dataset from a
fixed seed, the same initial model on every rank, no dropout); `--step-time` stands in for a bigger model. `--out`:
where rank 0 writes the final parameters.
"""

from __future__ import annotations

import argparse
import os
import time

import recovery.client.ddp as resilient  # first: it connects to the agent, heartbeats flow while torch imports
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 20, generator=generator)
    y = x.sin().sum(dim=1, keepdim=True)
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer,
                 snapshot_path: str, step_time: float) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.data = data
        self.optimizer = optimizer
        self.snapshot_path = snapshot_path
        self.step_time = step_time
        self.epochs_run = 0
        if snapshot_path and os.path.exists(snapshot_path):
            print(f"[rank {self.rank}] Loading snapshot")
            self._load_snapshot()
        self.model = resilient.wrap(self.model, self.optimizer)  # DDP, wrapped again on every new group

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.rank}] Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch + 1}
        partial = f"{self.snapshot_path}.partial"
        torch.save(snapshot, partial)
        os.replace(partial, self.snapshot_path)  # whole or not at all: a rank killed mid-save leaves the last one
        print(f"[rank {self.rank}] Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.step_time)

    def _run_epoch(self, epoch: int) -> None:
        steps = len(self.data)
        print(f"[rank {self.rank}] Epoch {epoch} | Batchsize: {self.data.batch_size} | Steps: {steps}", flush=True)
        for index, (source, targets) in resilient.batches(self.data, epoch):  # skips the batches done, set_epoch
            self._run_batch(source, targets)
            print(f"[rank {self.rank}] step {epoch * steps + index + 1}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in resilient.epochs(self.epochs_run, max_epochs):  # from the epoch a recovery resumes in
            self._run_epoch(epoch)
            if self.rank == 0 and self.snapshot_path:
                self._save_snapshot(epoch)


def main() -> None:
    parser = argparse.ArgumentParser(description="distributed training job")
    parser.add_argument("--epochs", type=int, default=6, help="total epochs to train the model")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size on each device")
    parser.add_argument("--samples", type=int, default=256, help="size of the dataset")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where rank 0 saves the snapshot every epoch")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a bigger model)")
    parser.add_argument("--out", default="", help="where rank 0 writes the final parameters")
    args = parser.parse_args()

    resilient.init_process_group(timeout_s=60)  # the job store's generations; a dead peer frees us at once
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    data = DataLoader(dataset(args.samples), batch_size=args.batch_size, shuffle=False,
                      sampler=DistributedSampler(dataset(args.samples)))
    trainer = Trainer(model, data, optimizer, args.snapshot, args.step_time)
    resilient.run(trainer.train, args.epochs)  # recovers from a failed step and trains on
    if int(os.environ["RANK"]) == 0 and args.out:
        torch.save(trainer.model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A Lightning 2 script as users write them: a LightningModule, a DataModule of synthetic data (made here, offline),
`Trainer(strategy="ddp")` with a checkpoint every few steps and `fit(ckpt_path="last")`. `--strategy recovery`
swaps in `RecoveryDDPStrategy`, the one line the integration asks for; `--strategy ddp` is the stock script.

    recovery-run --standalone --nproc-per-node 4 examples/lightning/train.py --strategy recovery --out final.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "recovery" in sys.argv:  # `--strategy recovery`: the integration first, before Lightning (see its docstring)
    from recovery.client.lightning import RecoveryDDPStrategy

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, step_time_s: float = 0.0, lr: float = 0.05, digest: bool = False) -> None:
        super().__init__()
        self.digest = digest
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.step_time_s = step_time_s
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        source, target = batch
        loss = F.mse_loss(self.net(source), target)
        if self.step_time_s:
            time.sleep(self.step_time_s)  # a step's compute, long enough for a fault to land mid-run
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        line = f"[rank {self.global_rank}] trained step {self.trainer.global_step}"
        if self.digest:  # the parameters' sum and the batch's, to compare runs step by step
            params = sum(float(p.double().sum()) for p in self.parameters())
            line += f" params {params:.17g} batch {float(batch[0].double().sum()):.17g}"
        print(line, flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StepReports(pl.Callback):
    """The SDK's step reports alone, as a Callback (`--report-steps`): progress and true times, nothing else."""

    def __init__(self) -> None:
        import recovery.client as recovery

        self.client = recovery.connect()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.client.report_step(trainer.global_step)


class Synthetic(pl.LightningDataModule):
    def __init__(self, samples: int, batch_size: int) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1234)
        source = torch.randn(self.samples, 32, generator=generator)
        target = source.sum(dim=1, keepdim=True) * 0.1
        return DataLoader(TensorDataset(source, target), batch_size=self.batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", choices=["ddp", "recovery"], default="ddp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--checkpoints", default="checkpoints")
    parser.add_argument("--out", default="")
    parser.add_argument("--report-steps", action="store_true", help="the stock script plus the SDK's step reports")
    parser.add_argument("--digest", action="store_true", help="print the parameters' sum after every step")
    args = parser.parse_args()

    torch.manual_seed(0)
    strategy: object = "ddp"
    if args.strategy == "recovery":
        strategy = RecoveryDDPStrategy(timeout_s=60)
    reports = [StepReports()] if args.report_steps else []
    checkpoints = ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=4, save_last=True, save_top_k=0)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's (and recovery-run's) environment
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // per_node
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=strategy,
                         max_epochs=args.epochs,
                         callbacks=[checkpoints, OnExceptionCheckpoint(args.checkpoints), *reports],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         num_sanity_val_steps=0, deterministic=True)
    model = Regression(args.step_time, digest=args.digest)
    trainer.fit(model, Synthetic(args.samples, args.batch_size), ckpt_path="last")
    if trainer.is_global_zero and args.out:
        torch.save({name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, Path(args.out))


if __name__ == "__main__":
    main()

"""A minimal data-parallel PyTorch training loop that a `recovery-agent` supervises (gloo, CPU).

    python train.py --steps 80 --out final.pt
    python train.py --steps 80 --checkpoint-every 20 --checkpoint-dir ckpt   # also periodic checkpoints

Each rank trains the same small MLP on its own batches, seeded by (seed, step, rank) so that the data order does
not depend on which process computes a step; gradients are averaged with one all_reduce per parameter. When a peer
dies, the survivors keep their process: they re-form the process group in the agent's next generation and the
restarted rank receives the model and optimizer state from a live replica. The final parameters equal those of a
run without faults, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import recovery.client as recovery

client = recovery.connect()  # first, so that heartbeats flow while torch is imported

import torch  # noqa: E402  # after connect: importing torch takes seconds
import torch.distributed as dist  # noqa: E402

from recovery.client.torch import ProcessGroupRecovery  # noqa: E402


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, 32, generator=generator)
    return x, x.sin().sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a bigger model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="where rank 0 writes the final parameters")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="rank 0 saves the state every N steps to --checkpoint-dir; a process started without a "
                             "resume plan resumes from the newest one there (how a job restarted whole, as torchrun "
                             "restarts it, loses only the steps since)")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    group = ProcessGroupRecovery(client)
    group.form()
    world = dist.get_world_size()

    def get_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def set_state(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save(step: int) -> dict[str, Any]:
        path = f"{args.out or 'checkpoint'}.step{step}.rank{group.rank}"
        torch.save(get_state(), path)
        return {"tier": "dying", "shards": [0], "location": path}

    def save_periodic(step: int) -> None:
        directory = Path(args.checkpoint_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"step{step:09d}.pt"
        torch.save({"step": step, **get_state()}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a checkpoint is either whole or absent
        client.checkpoint_saved(step, "storage", [0], str(path))

    client.on_save(save)
    plan = client.resume_plan()
    start = 0
    if plan is None and args.checkpoint_every:
        saved = sorted(Path(args.checkpoint_dir).glob("step*.pt"))
        if saved:
            checkpoint = torch.load(saved[-1], weights_only=False)
            set_state(checkpoint)
            start = checkpoint["step"]
    # A restarted rank takes its state, and the step, from a live replica (the plan's `peer` tier).
    step = group.synchronize(start, get_state, set_state, live=plan is None)
    while step < args.steps:
        failed = False
        try:
            x, y = batch(args.seed, step, group.rank, 64)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
            optimizer.step()
        except RuntimeError:
            failed = True  # a peer died: recover outside this block, which holds the old process group
        if failed:
            group.recover()
            step = group.synchronize(step, get_state, set_state)
            continue
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0 and group.rank == 0:
            save_periodic(step)
        if args.step_time:
            time.sleep(args.step_time)  # stands in for the compute of a larger model
        client.report_step(step)
    if group.rank == 0 and args.out:
        torch.save({name: p.detach().clone() for name, p in model.state_dict().items()}, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    group.close()
    client.close()


if __name__ == "__main__":
    main()

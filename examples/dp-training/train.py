"""A minimal data-parallel PyTorch training loop that a `recovery-agent` supervises (gloo, CPU).

    python train.py --steps 80 --out final.pt
    python train.py --steps 80 --checkpoint-every 20 --checkpoint-dir ckpt   # also periodic checkpoints
    python train.py --steps 80 --save-async-every 10 --checkpoint-dir ckpt   # in-memory checkpoints, persisted
    python train.py --steps 80 --checkpoint-every 5 --nan-at-step 23 --nan-rank 1   # a bad step, rolled back

Each rank trains the same small MLP on its own batches, seeded by (seed, step, rank) so that the data order does
not depend on which process computes a step; gradients are averaged with one all_reduce per parameter. When a peer
dies, the survivors keep their process: they re-form the process group in the agent's next generation and the
restarted rank receives the model and optimizer state from a live replica. The final parameters equal those of a
run without faults, bit for bit.

Each step reports its loss: a NaN (`--nan-at-step`) makes it a bad step, and the job rolls back to the newest
checkpoint before it, every rank restarted from it; the resume plan names the step, whose batch the script then
passes over (`client.skips`). Its final parameters equal those of a run without the NaN that skips the same step
(`--skip-steps`).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
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
    parser.add_argument("--save-async-every", type=int, default=0,
                        help="every rank copies the state into its node's shared memory every N steps "
                             "(`client.save_async`: the stall is the copy), which rank 0's agent persists to "
                             "--checkpoint-dir in the background; a restarted rank whose plan names the memory tier "
                             "loads it from its node's memory")
    parser.add_argument("--stall-rank", type=int, default=-1,
                        help="a fault to inject: this rank's data loader never returns at --stall-at-step, in the "
                             "job's first generation (the others then wait for it in their all_reduce)")
    parser.add_argument("--stall-at-step", type=int, default=-1)
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="a straggler to inject: this rank computes --slow-s seconds longer every step, in the "
                             "job's first generation (a slow GPU: moving the rank to another node ends it)")
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--nan-at-step", type=int, default=-1,
                        help="a fault to inject: the loss of --nan-rank at this step is NaN, in the job's first "
                             "generation (its gradients, all-reduced, poison every replica: a bad step)")
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--skip-steps", default="",
                        help="comma-separated steps whose data is skipped, as a roll-back's plan skips them (a "
                             "reference run)")
    parser.add_argument("--group-timeout-s", type=float, default=30.0, help="the process group's collective timeout")
    parser.add_argument("--collective-timeout-at-step", type=int, default=-1,
                        help="a fault to inject: the others' collectives of this step time out for real, every "
                             "process alive: --collective-timeout-rank enters its all_reduce --group-timeout-s plus "
                             "2 s late, in the job's first generation (a peer stalled past the group's timeout)")
    parser.add_argument("--collective-timeout-rank", type=int, default=3)
    args = parser.parse_args()
    skip_steps = {int(s) for s in args.skip_steps.split(",") if s}

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    group = ProcessGroupRecovery(client, timeout_s=args.group_timeout_s)
    group.form()
    world = dist.get_world_size()

    def get_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def set_state(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def checkpoint_path(step: int) -> str:
        # One shard (pure data parallelism), on storage every node reads: any replica's save is the checkpoint.
        return f"{args.out or 'checkpoint'}.ckpt{step}"

    def save(step: int) -> dict[str, Any]:
        path = checkpoint_path(step)
        torch.save(get_state(), f"{path}.rank{group.rank}.tmp")
        os.replace(f"{path}.rank{group.rank}.tmp", path)  # whole or not at all, whichever replica writes last
        return {"tier": "dying", "shards": [0], "location": path}

    def save_periodic(step: int) -> None:
        directory = Path(args.checkpoint_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"step{step:09d}.pt"
        torch.save({"step": step, **get_state()}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a checkpoint is either whole or absent
        client.checkpoint_saved(step, "storage", [0], str(path))

    def saved_checkpoint(step: int) -> str | None:
        """The file of the checkpoint of `step`: a dying one, or a periodic one."""
        for path in (checkpoint_path(step), str(Path(args.checkpoint_dir) / f"step{step:09d}.pt")):
            if os.path.exists(path):
                return path
        return None

    def load_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (step, group.rank, client.generation) == (args.stall_at_step, args.stall_rank, 0):
            threading.Event().wait()  # the injected stall: a loader blocked on a lost file server, say
        return batch(args.seed, step, group.rank, 64)

    client.on_save(save)
    plan = client.resume_plan()
    source = plan.source_of(group.rank) if plan is not None else None
    step, live = 0, source is None or source.tier != "peer"  # a plan with no checkpoint starts over from step 0
    restored = client.restore(args.checkpoint_dir) if args.save_async_every else None
    if restored is not None:
        # The plan names a checkpoint `save_async` wrote: this node's memory copy (an in-place restart), else the
        # copy the agent persisted.
        set_state(restored.state)
        step, live = restored.step, True
        print(f"resumed from the {restored.tier} checkpoint of step {step}: {restored.path}", flush=True)
    elif plan is not None and plan.checkpoint_step is not None and source is not None and source.tier != "peer":
        # The plan names a saved checkpoint (a dying one, or a periodic one on storage): load it, resume after it.
        path = saved_checkpoint(plan.checkpoint_step)
        if path is None:
            raise SystemExit(f"the resume plan names the {source.tier} checkpoint of step {plan.checkpoint_step}, "
                             "which is nowhere on storage")
        set_state(torch.load(path, weights_only=False))
        step, live = plan.checkpoint_step, True
        print(f"resumed from the {source.tier} checkpoint of step {step}: {path}", flush=True)
    elif plan is None and args.checkpoint_every:
        # Started without a plan (as torchrun restarts every process): resume from the newest periodic checkpoint.
        periodic = sorted(Path(args.checkpoint_dir).glob("step*.pt"))
        if periodic:
            checkpoint = torch.load(periodic[-1], weights_only=False)
            set_state(checkpoint)
            step = checkpoint["step"]
    # A restarted rank whose plan names the `peer` tier takes its state, and the step, from a live replica.
    step = group.synchronize(step, get_state, set_state, live=live)
    late = (args.collective_timeout_at_step, args.collective_timeout_rank, 0)
    while step < args.steps:
        if step + 1 in skip_steps or client.skips(step + 1):
            # The data of a bad step rolled back (or named on the command line): pass it over, no update.
            step += 1
            client.report_step(step)
            continue
        failed: str | None = None
        try:
            group.check()  # a newer generation announced: peers were replaced while this group still works
            started = time.perf_counter()
            x, y = load_batch(step)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if (step + 1, group.rank, client.generation) == (args.nan_at_step, args.nan_rank, 0):
                loss = loss * float("nan")  # the injected bad step: a corrupted batch, say
            loss.backward()
            if (group.rank, client.generation) == (args.slow_rank, 0) and args.slow_s:
                time.sleep(args.slow_s)  # the injected straggler: its compute, not the math, takes longer
            # The rank's own share of the step: after this it waits for the slowest peer in the all_reduce.
            compute_s = time.perf_counter() - started
            if (step, group.rank, client.generation) == late:
                time.sleep(args.group_timeout_s + 2.0)  # the injected late peer: the others' all_reduce times out
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
            optimizer.step()
        except RuntimeError as exc:
            failed = str(exc)  # a peer died or timed out: recover outside this block, which holds the old group
        if failed is not None:
            group.recover(failed)  # a timeout is reported: the engine's retry is a new generation, no restart
            step = group.synchronize(step, get_state, set_state)
            continue
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0 and group.rank == 0:
            save_periodic(step)
        if args.save_async_every and step % args.save_async_every == 0:
            client.save_async(get_state(), step, storage=args.checkpoint_dir if group.rank == 0 else None)
        if args.step_time:
            time.sleep(args.step_time)  # stands in for the compute of a larger model
        client.report_step(step, compute_s=compute_s, loss=loss.item())  # a NaN or a spike here rolls the job back
    if group.rank == 0 and args.out:
        torch.save({name: p.detach().clone() for name, p in model.state_dict().items()}, args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    group.close()
    client.close(keep_heartbeats=True)  # alive to the agent until the process has ended


if __name__ == "__main__":
    main()
    # Everything is saved: skip the interpreter's teardown of torch, which takes 1-3 s alone and 10-20 s with four
    # ranks on two busy cores, all that time a finished rank that the agent cannot tell from a hung one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

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

An elastic job's world changes size (a node lost with no spare, a node that joins): the script keeps its global batch
of --global-batch micro-batches (the 4 of a 4-rank run), each rank accumulating its share, rank r the micro-batches
r, r + world, ... (the one of its own rank in a 4-rank world), so that every step sees the same data whatever the
world. With --ordered-reduction the gradients are summed in rank order (an all_gather) instead of by all_reduce's
ring, so that the parameters are a function of the schedule of world sizes that one process reproduces:

    python train.py --steps 40 --ordered-reduction --reference-schedule 4@1,2@15,4@26 --out reference.pt

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


def micro_batches(rank: int, world: int, global_batch: int) -> range:
    """The micro-batches of the global batch that `rank` of `world` computes (its accumulation steps)."""
    return range(rank, global_batch, world)


def combine(parts: list[torch.Tensor], global_batch: int) -> torch.Tensor:
    """The step's gradient from every rank's accumulated one, summed in rank order: the same float operations in any
    world size and in the reference."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total / global_batch


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """`4@1,2@15`: world 4 from step 1, 2 from step 15 (a step is numbered as the script reports it)."""
    return sorted((int(first), int(world)) for world, first in (part.split("@") for part in text.split(",")))


def reference(args: argparse.Namespace) -> None:
    """What a job whose world followed --reference-schedule computes, in this one process and without a process
    group: every step, each rank's accumulation in turn, then the ordered sum (--ordered-reduction's math)."""
    schedule = parse_schedule(args.reference_schedule)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        world = [w for first, w in schedule if first <= step + 1][-1]
        by_rank: list[list[torch.Tensor]] = []
        for rank in range(world):
            optimizer.zero_grad()
            for micro in micro_batches(rank, world, args.global_batch):
                x, y = batch(args.seed, step, micro, 64)
                torch.nn.functional.mse_loss(model(x), y).backward()
            by_rank.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
        for index, parameter in enumerate(model.parameters()):
            parameter.grad = combine([grads[index] for grads in by_rank], args.global_batch)
        optimizer.step()
    torch.save({name: p.detach().clone() for name, p in model.state_dict().items()}, args.out + ".tmp")
    os.replace(args.out + ".tmp", args.out)


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
    parser.add_argument("--global-batch", type=int, default=4,
                        help="micro-batches per step, whatever the world size: a rank of a smaller world accumulates "
                             "several (the default of an elastic job: the optimizer sees the same batch)")
    parser.add_argument("--ordered-reduction", action="store_true",
                        help="sum the gradients in rank order (all_gather) rather than by all_reduce, so that "
                             "--reference-schedule reproduces the parameters bit for bit")
    parser.add_argument("--reference-schedule", default="",
                        help="compute in this one process what a job whose world sizes followed this schedule "
                             "computes with --ordered-reduction: `4@1,2@15,4@26` (world 4 from step 1, ...)")
    args = parser.parse_args()
    if args.reference_schedule:
        reference(args)
        return
    skip_steps = {int(s) for s in args.skip_steps.split(",") if s}

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    group = ProcessGroupRecovery(client, timeout_s=args.group_timeout_s)
    group.form()

    def on_world_change(world: int, rank: int) -> None:
        # The global batch stays: this rank's share of its micro-batches in the new world (read every step).
        shares = list(micro_batches(rank, world, args.global_batch))
        print(f"generation {client.generation}: rank {rank} of {world}, micro-batches {shares}", flush=True)

    client.on_world_change(on_world_change)

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

    def load_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (step, group.rank, client.generation) == (args.stall_at_step, args.stall_rank, 0):
            threading.Event().wait()  # the injected stall: a loader blocked on a lost file server, say
        return batch(args.seed, step, micro, 64)

    def reduce_gradients(world: int) -> None:
        for parameter in model.parameters():
            grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            if args.ordered_reduction:
                parts = [torch.empty_like(grad) for _ in range(world)]
                dist.all_gather(parts, grad)
                parameter.grad = combine(parts, args.global_batch)
            else:
                dist.all_reduce(grad)
                parameter.grad = grad / args.global_batch

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
            optimizer.zero_grad()
            losses = []
            for micro in micro_batches(group.rank, group.world_size, args.global_batch):
                x, y = load_batch(step, micro)
                loss = torch.nn.functional.mse_loss(model(x), y)
                if (step + 1, group.rank, client.generation) == (args.nan_at_step, args.nan_rank, 0):
                    loss = loss * float("nan")  # the injected bad step: a corrupted batch, say
                loss.backward()
                losses.append(loss.item())
            if (group.rank, client.generation) == (args.slow_rank, 0) and args.slow_s:
                time.sleep(args.slow_s)  # the injected straggler: its compute, not the math, takes longer
            # The rank's own share of the step: after this it waits for the slowest peer in the reduction.
            compute_s = time.perf_counter() - started
            if (step, group.rank, client.generation) == late:
                time.sleep(args.group_timeout_s + 2.0)  # the injected late peer: the others' all_reduce times out
            reduce_gradients(group.world_size)
            optimizer.step()
        except RuntimeError as exc:
            failed = str(exc)  # a peer died or timed out: recover outside this block, which holds the old group
        if failed is not None:
            print(f"step {step + 1} failed in generation {client.generation}: {failed[:300]}", flush=True)
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
        # the rank's loss (its micro-batches' mean): a NaN or a spike here rolls the job back
        client.report_step(step, compute_s=compute_s, loss=sum(losses) / len(losses) if losses else None)
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

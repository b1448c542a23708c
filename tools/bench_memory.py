"""The in-memory checkpoint tier (`client.save_async`) against torch.save: the `memory` case of `python tools/bench.py
e2e`, or on its own:

    python tools/bench_memory.py                # a 150 MB state, 7 saves, 3 restores from each tier
    python tools/bench_memory.py --mb 50 --saves 3 --restores 1

This process plays the node's agent with the agent's own parts (`recovery.agent.channel.ProcessChannel`, the SDK's
socket, and `recovery.agent.memory.MemoryTier`: the job's shared memory under /dev/shm, the persisting to storage in
the background, the files handed back for reuse); the training process is a child of it, which connects to it as a
rank connects to its agent.

- Stall: the child builds a state of `--mb` MB (an MLP of 2048-wide layers and its Adam state, after a step), and
  `--saves` times trains a step, then times a synchronous `torch.save` of the state to a file on disk followed by
  `os.fsync` (a checkpoint on disk when the call returns), and `client.save_async` of the same state (the copy into
  the agent's shared memory), in alternating order; then waits until the agent has persisted that checkpoint (the
  training between two checkpoints, here longer than the persisting: the agent has also handed the rank's older
  file back for reuse). `memory_ckpt_stall_ratio_to_torch_save` is the median of save_async's stalls
  over the median of torch.save's (goal 0.1 or less); the medians themselves, and torch.save without the fsync,
  are printed too.
- Restore: a new process started as an in-place restart is (a resume plan naming the tier, the agent's environment)
  imports torch, builds the model and loads the checkpoint of the last save into model and optimizer, from this
  node's shared memory (tier `memory`) or from the persisted copy (tier `storage`, evicted from the page cache first
  with posix_fadvise, so that it is read from the disk as after a node's reboot); `--restores` of each, alternating.
  `memory_restore_ratio_to_storage` is the ratio of the medians of the time from the process's start until the
  state is loaded; `*_restore_load_s` are the reads themselves.

Every process started is stopped by its PID when the bench ends; the shared memory is removed with the "agent".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from bench_harness import ROOT, Emit, emit, note

from recovery.agent.channel import ProcessChannel
from recovery.agent.memory import MemoryTier, memory_root

JOB = "bench-memory"
NODE = "bench"
HIDDEN = 2048
PERSIST_WAIT_S = 120.0


# -- the training process ------------------------------------------------------------------------------------------
def _model(mb: float) -> tuple[Any, Any]:
    import torch

    per_layer = 3 * 4 * HIDDEN * (HIDDEN + 1)  # parameters and Adam's two moments, float32
    layers = max(1, round(mb * 2**20 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(model: Any, optimizer: Any) -> None:
    import torch

    optimizer.zero_grad()
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    optimizer.step()


def child_save(args: argparse.Namespace) -> None:
    import recovery.client as recovery

    client = recovery.connect()
    import torch

    torch.manual_seed(0)
    model, optimizer = _model(args.mb)
    disk = Path(args.disk)
    storage = Path(args.storage)
    for step in range(1, args.saves + 1):
        _train_step(model, optimizer)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        timings: dict[str, float] = {}
        for which in (("disk", "memory") if step % 2 else ("memory", "disk")):
            started = time.perf_counter()
            if which == "disk":
                torch.save(state, disk)
                timings["torch_save_s"] = time.perf_counter() - started
                fd = os.open(disk, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                timings["torch_save_fsync_s"] = time.perf_counter() - started
            else:
                path = client.save_async(state, step, storage=storage)
                timings["save_async_s"] = time.perf_counter() - started
                assert path is not None, "no RECOVERY_MEMORY_DIR: the bench gave the child no agent memory"
        timings["bytes"] = float(disk.stat().st_size)
        timings["slots"] = float(len(client._slots._mapped)) if client._slots is not None else 0.0
        print(json.dumps(timings), flush=True)
        persisted = storage / f"step{step:09d}.shard0.mem"
        memory = Path(os.environ["RECOVERY_MEMORY_DIR"])
        deadline = time.monotonic() + PERSIST_WAIT_S
        # the training between two checkpoints, longer than the agent's persisting of one: by the next save the
        # checkpoint is on storage and the rank's older file is back for reuse
        while not (persisted.exists() and (step == 1 or any(memory.glob(".free.rank0.*")))):
            if time.monotonic() > deadline:
                raise SystemExit(f"the agent did not persist step {step} within {PERSIST_WAIT_S:g}s")
            time.sleep(0.02)
    client.close()


def child_restore(args: argparse.Namespace) -> None:
    import recovery.client as recovery

    client = recovery.connect()
    import torch

    model, optimizer = _model(args.mb)
    started = time.perf_counter()
    restored = client.restore(args.storage)
    assert restored is not None, "nothing to restore"
    model.load_state_dict(restored.state["model"])
    optimizer.load_state_dict(restored.state["optimizer"])
    load_s = time.perf_counter() - started
    print(json.dumps({"at": time.monotonic(), "load_s": load_s, "tier": restored.tier,
                      "first": float(next(iter(model.parameters())).detach().flatten()[0])}), flush=True)
    del torch
    sys.stdout.flush()
    os._exit(0)  # torch's teardown is no part of a restore


# -- the agent's side -----------------------------------------------------------------------------------------------
def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


async def _child(command: list[str], env: dict[str, str], started: list[int]) -> tuple[list[dict[str, Any]], float]:
    """Run a child to its end; its JSON lines and when it was started (monotonic)."""
    at = time.monotonic()
    process = await anyio.open_process(command, env=env, stdout=subprocess.PIPE, stderr=None)
    started.append(process.pid)
    output = b""
    assert process.stdout is not None
    async for chunk in process.stdout:
        output += chunk
    if await process.wait() != 0:
        raise RuntimeError(f"{command[2:4]} failed with {process.returncode}")
    return [json.loads(line) for line in output.splitlines() if line.startswith(b"{")], at


def _evict(path: Path) -> None:
    """Drop `path` from the page cache (its pages are clean: the agent fsynced it), so that it is read from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _measure(workdir: Path, mb: float, saves: int, restores: int, started: list[int]) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    root = memory_root(Path("/dev/shm"), NODE, workdir)
    reported: list[tuple[int, str]] = []
    tier = MemoryTier(root, lambda job, step, where, shards: reported.append((step, where)))
    directory = tier.job_dir(JOB)
    storage = workdir / "storage"

    async def handle(message: dict[str, Any]) -> None:
        if message.get("op") == "memory_saved":  # what the agent's relay does with it
            tier.saved(JOB, message["rank"], int(message["step"]), [int(s) for s in message["shards"]],
                       str(message["file"]), message.get("storage"))

    channel = ProcessChannel(workdir / "agent.sock", handle)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--mb", str(mb), "--storage", str(storage)]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(channel.serve)
            tg.start_soon(tier.run)
            env = _environment(RECOVERY_AGENT_SOCKET=str(channel.path), RECOVERY_MEMORY_DIR=str(directory),
                               RECOVERY_NODE=NODE, RANK="0")
            saves_out, _ = await _child([*me, "--child", "save", *common, "--saves", str(saves), "--disk",
                                         str(workdir / "torch-save.pt")], env, started)
            last = saves
            restore_out: dict[str, list[dict[str, Any]]] = {"memory": [], "storage": []}
            for index in range(restores):
                for where in (("memory", "storage") if index % 2 == 0 else ("storage", "memory")):
                    if where == "storage":
                        _evict(storage / f"step{last:09d}.shard0.mem")
                    plan = {"checkpoint_step": last, "next_step": last + 1,
                            "shards": [{"shard": 0, "tier": where, "holders": [NODE if where == "memory"
                                                                                 else "storage"]}]}
                    lines, at = await _child([*me, "--child", "restore", *common], {
                        **env, "RECOVERY_RESUME_PLAN": json.dumps(plan), "RECOVERY_GENERATION": "1"}, started)
                    [line] = lines
                    assert line["tier"] == where, (line, where)
                    restore_out[where].append({**line, "recovered_s": line["at"] - at})
            tg.cancel_scope.cancel()
    finally:
        tier.close()
    return {"saves": saves_out, "restores": restore_out, "reported": reported, "shm_left": root.exists()}


def measure(workdir: Path, emit: Emit, quick: bool = False, mb: float = 150.0, saves: int = 7,
            restores: int = 3) -> None:
    """The `memory` case of `python tools/bench.py e2e`."""
    if quick:
        mb, saves, restores = 50.0, 4, 1
    started: list[int] = []
    try:
        found = anyio.run(_measure, workdir / "memory", mb, saves, restores, started)
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    saves_out = found["saves"]
    tiers = {where for _, where in found["reported"]}
    if tiers != {"memory", "storage"} or found["shm_left"]:
        note(f"warning: the agent reported tiers {sorted(tiers)}; shared memory left: {found['shm_left']}")
    firsts = {r["first"] for runs in found["restores"].values() for r in runs}
    if len(firsts) != 1:
        note("warning: the state restored from memory differs from the one restored from storage")
    size_mb = statistics.median(s["bytes"] for s in saves_out) / 2**20
    stall = statistics.median(s["save_async_s"] for s in saves_out)
    torch_save = statistics.median(s["torch_save_fsync_s"] for s in saves_out)
    unfsynced = statistics.median(s["torch_save_s"] for s in saves_out)
    stalls = [round(s["save_async_s"], 3) for s in saves_out]
    saves = [round(s["torch_save_fsync_s"], 3) for s in saves_out]
    note(f"memory: {size_mb:.0f} MB state, {saves_out[-1]['slots']:.0f} slots mapped; save_async stalls {stalls}, "
         f"torch.save+fsync {saves}")
    emit("e2e", "memory_ckpt_stall_ratio_to_torch_save", round(stall / torch_save, 3),
         f"x (median stall of save_async over torch.save + fsync to disk, a {size_mb:.0f} MB state; goal 0.1)")
    emit("e2e", "memory_ckpt_stall_s", round(stall, 4), f"s per save_async of a {size_mb:.0f} MB state")
    emit("e2e", "torch_save_fsync_s", round(torch_save, 4), f"s per torch.save + fsync of a {size_mb:.0f} MB state")
    emit("e2e", "torch_save_s", round(unfsynced, 4), f"s per torch.save (page cache, no fsync), {size_mb:.0f} MB")
    recovered = {where: statistics.median(r["recovered_s"] for r in runs)
                 for where, runs in found["restores"].items()}
    for where, runs in found["restores"].items():
        emit("e2e", f"{where}_restore_load_s", round(statistics.median(r["load_s"] for r in runs), 4),
             f"s to read a {size_mb:.0f} MB checkpoint from {where} into model and optimizer")
        emit("e2e", f"{where}_restore_recovered_s", round(recovered[where], 3),
             "s from a restarted process's start until its state is loaded")
    emit("e2e", "memory_restore_ratio_to_storage", round(recovered["memory"] / recovered["storage"], 3),
         "x (in-place restart until the state is loaded: from the node's memory over from storage)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=("save", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=150.0, help="the state's size in MB")
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--disk", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "save":
        child_save(args)
    elif args.child == "restore":
        child_restore(args)
    else:
        with tempfile.TemporaryDirectory(prefix="recovery-bench-memory-") as tmp:
            measure(Path(tmp), emit, mb=args.mb, saves=args.saves, restores=args.restores)


if __name__ == "__main__":
    main()

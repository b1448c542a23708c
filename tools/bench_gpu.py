"""The GPU path's figures, on a machine with an NVIDIA GPU: `python tools/bench.py gpu` (tools/gpu_check.py runs it
there with the tests marked `gpu`).

- Standby: a new rank's first training step on the GPU (a product, backward, an optimizer step), timed from after
  `import torch` in a fresh process: cold (the process pays CUDA's initialisation and the device's context) and warm
  (`recovery.client.torch.warm_up_cuda` ran first, as a warm standby runs it before it waits).
  `standby_cold_first_step_s`, `standby_warm_first_step_s` (medians of `--repeat` processes each, alternating), and
  `standby_cuda_saving_s`, their difference: what a rank handed to a warm standby does not pay.
- In-memory checkpoint: the training stream's stall of one save of a `--mb` MB state on the GPU (an MLP's
  parameters and Adam's two moments), `MemorySlots.write` into /dev/shm (page-locked slots, one DMA copy per tensor)
  against `torch.save` of the same state into a file in /dev/shm (and against the tier's former path, each tensor
  `.cpu()` then copied); `--saves` of each, alternating, after one of each to warm up; medians, and
  `memory_ckpt_gpu_stall_ratio_to_torch_save`.
- NCCL: `tools/gpu_nccl_recovery.py`'s figures: a one-rank NCCL group's abort by the SDK's watcher
  (`nccl_announce_to_abort_s`) and its formation again in the same process (`nccl_reform_s`); and whether two ranks
  of one NCCL group may share the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Emit = Callable[..., None]

_FIRST_STEP = """
import sys, time
import torch
warm = sys.argv[1] == "warm"
if warm:
    from recovery.client.torch import warm_up_cuda
    warm_up_cuda()
started = time.monotonic()
device = torch.device("cuda", 0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(device)
optimizer = torch.optim.Adam(model.parameters())
model(torch.ones(64, 1024, device=device)).sum().backward()
optimizer.step()
torch.cuda.synchronize()
print(time.monotonic() - started)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="processes per standby case")
    parser.add_argument("--mb", type=int, default=1024, help="the checkpointed state's size on the GPU")
    parser.add_argument("--saves", type=int, default=5, help="saves timed per checkpoint path")
    parser.add_argument("--quick", action="store_true", help="small sizes: --repeat 1 --mb 64 --saves 2")


def _first_step(kind: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FIRST_STEP, kind], capture_output=True, text=True, timeout=300,
                          check=True, env=env)
    return float(done.stdout.split()[-1])


def bench_standby(args: argparse.Namespace, emit: Emit) -> None:
    cold, warm = [], []
    for _ in range(args.repeat):
        cold.append(_first_step("cold"))
        warm.append(_first_step("warm"))
    emit("gpu", "standby_cold_first_step_s", statistics.median(cold), "s")
    emit("gpu", "standby_warm_first_step_s", statistics.median(warm), "s")
    emit("gpu", "standby_cuda_saving_s", statistics.median(cold) - statistics.median(warm), "s")


def _state(mb: int) -> dict[str, Any]:
    import torch

    width = 4096
    layers = max(1, mb * 1024 * 1024 // (3 * 4 * width * width))  # parameters and Adam's two moments, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(8, width, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def bench_memory(args: argparse.Namespace, emit: Emit) -> None:
    import torch

    from recovery.client.memory import MemorySlots

    state = _state(args.mb)
    size = sum(t.numel() * t.element_size() for t in _tensors(state))
    shm = Path(tempfile.mkdtemp(prefix="recovery-gpu-bench-", dir="/dev/shm"))
    slots = MemorySlots(shm / "tier", rank=0)
    old = MemorySlots(shm / "old", rank=0)
    stalls: dict[str, list[float]] = {"tier": [], "torch_save": [], "cpu_then_copy": []}
    try:
        for save in range(args.saves + 1):
            for name in stalls:
                torch.cuda.synchronize()
                started = time.monotonic()
                if name == "tier":
                    slots.write(state, shm / "tier" / f"step{save:09d}.shard0.rank0.mem")
                elif name == "torch_save":
                    torch.save(state, shm / f"save{save}.pt")
                else:
                    old.write(_to_cpu(state), shm / "old" / f"step{save:09d}.shard0.rank0.mem")
                elapsed = time.monotonic() - started
                if save:  # the first of each allocates its files and page-locks the slot
                    stalls[name].append(elapsed)
            for path in shm.glob("**/*"):
                if path.is_file() and not path.name.startswith("."):
                    path.unlink()  # as the agent hands files back; the page cache is not what is measured
    finally:
        slots.close()
        old.close()
        for path in sorted(shm.glob("**/*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        shm.rmdir()
    emit("gpu", "memory_ckpt_state_mb", size / 1e6, "MB")
    for name, values in stalls.items():
        emit("gpu", f"memory_ckpt_{name}_stall_s", statistics.median(values), "s")
    emit("gpu", "memory_ckpt_tier_gb_per_s", size / 1e9 / statistics.median(stalls["tier"]), "GB/s")
    emit("gpu", "memory_ckpt_gpu_stall_ratio_to_torch_save",
         statistics.median(stalls["tier"]) / statistics.median(stalls["torch_save"]), "ratio")


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def _to_cpu(state: Any) -> Any:
    """The state with every tensor copied to the CPU as `.cpu()` does (the tier's path before it took GPU tensors)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: _to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(value) for value in state)
    return state


def bench_nccl(emit: Emit) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    tool = str(ROOT / "tools" / "gpu_nccl_recovery.py")
    done = subprocess.run([sys.executable, tool], capture_output=True, text=True, timeout=300, check=True, env=env)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    emit("gpu", "nccl_form_s", found["form_s"], "s")
    emit("gpu", "nccl_announce_to_abort_s", found["announce_to_abort_s"], "s")
    emit("gpu", "nccl_reform_s", found["reform_s"], "s")
    emit("gpu", "nccl_version", found["nccl_version"], "")
    done = subprocess.run([sys.executable, tool, "--two-ranks"], capture_output=True, text=True, timeout=300,
                          check=False, env=env)
    lines = done.stdout.strip().splitlines()
    emit("gpu", "nccl_two_ranks_one_gpu", json.loads(lines[-1])["two_ranks_one_gpu"] if lines else done.stderr[-300:],
         "")


def run(args: argparse.Namespace, emit: Emit) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench gpu: torch sees no GPU")
    if args.quick:
        args.repeat, args.mb, args.saves = 1, 64, 2
    emit("gpu", "device", torch.cuda.get_device_name(0), "")
    emit("gpu", "torch", torch.__version__, "")
    bench_standby(args, emit)
    bench_memory(args, emit)
    bench_nccl(emit)

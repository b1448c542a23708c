"""The GPU path, on a real NVIDIA GPU (deselected where torch sees none; tools/gpu_check.py runs them on one):
the SDK's in-process recovery on NCCL, ranks sharing a GPU over gloo with CUDA tensors recovered bit for bit, a warm
standby's CUDA context, the in-memory tier taking CUDA tensors, and the NVML probe reading the real device."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recovery.client import _pinned
from recovery.client.memory import MemorySlots, read_state
from tests.test_e2e_ddp_sdk import (  # noqa: F401  # `cluster`: the module's fixture, shared here
    Cluster,
    assert_bitwise_equal,
    assert_restarted_only,
    cluster,
    run_job,
    sigkill,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
CUDA_SCRIPT = ROOT / "tests" / "gpu_ddp_cuda.py"


def _run_tool(*args: str, timeout: float = 180) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_nccl_recovery.py"), *args], capture_output=True,
                          text=True, timeout=timeout, check=False, cwd=ROOT,
                          env={**os.environ, "GPU_CHECK_STACKS_AFTER_S": str(timeout / 2)})
    print(done.stderr[-6000:])  # the stages, and the threads' stacks of a run that hung
    assert done.returncode == 0, done.stderr[-6000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_nccl_group_aborted_by_the_watcher_and_formed_again_in_process() -> None:
    found = _run_tool()
    assert found["aborted"], found
    assert found["announce_to_abort_s"] < 2.0, found  # the watcher reads the store every 50 ms
    assert found["optimizer_step_refused"] and found["state_unchanged_by_refused_step"], found
    assert found["after_recovery_all_reduce_ok"] and found["trained_after_recovery"], found
    assert found["after_recovery_step_agreed"] == 7, found


def test_ranks_sharing_a_gpu_over_gloo_recover_bitwise_on_cuda_tensors(cluster: Cluster) -> None:  # noqa: F811
    _, reference = asyncio.run(run_job(cluster, "gpu-ref", script=CUDA_SCRIPT))
    measured: dict[str, float] = {}
    w, found = asyncio.run(run_job(cluster, "gpu-kill", sigkill([2], measured), script=CUDA_SCRIPT))
    assert_restarted_only(w, [2])
    assert_bitwise_equal(found, reference)


def test_a_warm_standby_has_its_cuda_context_before_it_is_needed() -> None:
    code = ("import time, torch; from recovery.client.torch import warm_up_cuda; print(warm_up_cuda()); "
            "t = time.monotonic(); torch.nn.Linear(8, 8).cuda()(torch.ones(2, 8, device='cuda')).sum().backward(); "
            "torch.cuda.synchronize(); print(time.monotonic() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=ROOT)
    device, first_step_s = done.stdout.split()
    assert device == "0"
    assert float(first_step_s) < 0.5, first_step_s  # a cold first step pays the context: seconds


def test_the_memory_tier_copies_cuda_tensors_straight_into_its_slots(tmp_path: Path) -> None:
    import torch

    state = {"weight": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor(5, device="cuda"),
             "half": torch.randn(33, 7, device="cuda").half(), "cpu": torch.arange(10), "meta": {"lr": 0.1}}
    slots = MemorySlots(tmp_path / "mem", rank=0, prepare=False)
    try:
        slots.write(state, tmp_path / "mem" / "step000000005.shard0.rank0.mem")
        # page-locked where the driver lets a shared mapping be registered (it refused on the machine of the last
        # GPU run: docs/gpu.md), copied through pageable memory where not: the same bytes either way
        assert slots._pinned is not None
        print(f"slot page-locked: {bool(slots._pinned._registered)}")
        again = slots.write(state, tmp_path / "mem" / "step000000006.shard0.rank0.mem")
        assert again > 4 * 1024 * 1024
    finally:
        slots.close()
    loaded = read_state(tmp_path / "mem" / "step000000006.shard0.rank0.mem")
    for key in ("weight", "step", "half", "cpu"):
        assert torch.equal(loaded[key], state[key].cpu()), key
    assert loaded["meta"] == {"lr": 0.1}
    assert _pinned.on_gpu(state["weight"]) and not _pinned.on_gpu(loaded["weight"])


def test_the_nvml_probe_reads_the_real_gpu() -> None:
    from recovery.agent.probes.nvml import NvmlProbe, load_nvml

    probe = NvmlProbe(load_nvml(), xid_events=True)
    try:
        assert probe.devices >= 1
        assert probe.poll() == []  # a healthy GPU, counters as read at open
        assert not any(c.lost for c in probe._counters)
    finally:
        probe.close()

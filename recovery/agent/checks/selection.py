"""Which checks a node runs, from the agent's configuration (`health_check`) and what the node has."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from recovery.agent.checks.gpu import (
    NVIDIA_DEVICE,
    collective_check,
    gpu_compute_check,
    gpu_found,
    gpu_state_check,
    no_gpu,
)
from recovery.agent.checks.host import command_check, disk_check, memory_check
from recovery.agent.checks.runner import Check, HealthChecks, Publish
from recovery.agent.config import AgentConfig
from recovery.agent.probes.nvml import NvmlProbe


def node_checks(cfg: AgentConfig, nvml: NvmlProbe | None, dirs: Sequence[Path | None],
                gpu_device: Path = NVIDIA_DEVICE) -> list[Check]:
    """`off`: none. `auto`: memory, the directories `dirs` and `check_dirs`, the configured commands, and where a GPU
    is found `gpu-state`, `gpu-compute` and `collective` (nccl). `on`: every built-in one, `collective` on gloo on a
    node without a GPU, and the GPU checks failing there."""
    if cfg.health_check == "off":
        return []
    checks = [memory_check(cfg.check_min_free_memory_gb, cfg.check_budget_s)]
    seen: set[Path] = set()
    for directory in [*dirs, *cfg.check_dirs]:
        if directory is not None and directory.resolve() not in seen:
            seen.add(directory.resolve())
            checks.append(disk_check(directory, cfg.check_min_free_gb, cfg.check_min_write_mb_s, cfg.check_budget_s))
    gpu = gpu_found(nvml, gpu_device)
    if gpu:
        checks += [gpu_state_check(nvml, cfg.check_budget_s),
                   gpu_compute_check(cfg.check_python, cfg.check_gpu_compute_budget_s),
                   collective_check(cfg.check_python, "nccl", cfg.check_collective_budget_s)]
    elif cfg.health_check == "on":
        checks += [no_gpu("gpu-state"), no_gpu("gpu-compute"),
                   collective_check(cfg.check_python, "gloo", cfg.check_collective_budget_s)]
    checks += [command_check(c.name, c.command, c.budget_s) for c in cfg.checks]
    return checks


def open_health_checks(cfg: AgentConfig, nvml: NvmlProbe | None, dirs: Sequence[Path | None],
                       publish: Publish) -> HealthChecks:
    """The agent's health checks: `node_checks`, publishing through `publish` (its `node_event`)."""
    return HealthChecks(cfg.node, node_checks(cfg, nvml, dirs), publish, fresh_s=cfg.check_fresh_s, spare=cfg.spare)

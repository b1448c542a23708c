"""The checks of a GPU node: what NVML says of each GPU's state, and what its GPUs compute (in processes of their
own: the agent never imports torch).

`gpu-state` reads NVML through the agent's own probe (`recovery.agent.probes.nvml`) where it opened one, else opens
NVML for the check, else asks `nvidia-smi`. A GPU fails it with pages waiting to be retired or rows waiting to be
remapped (both take a reset to apply), an uncorrectable ECC error since the driver loaded (volatile), a failed row
remapping, or clocks throttled for a hardware reason (HW slowdown, thermal, power brake: a GPU that trains slower
than its peers, a straggler from its first step).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from recovery.agent.checks.process import last_lines, run_to_end
from recovery.agent.checks.runner import Check, Seen
from recovery.agent.probes.nvml import NvmlProbe, load_nvml

NVIDIA_DEVICE = Path("/dev/nvidia0")
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # where `recovery` is imported from, for `check_python`
# The throttle reasons' bits (nvml.h), where an older pynvml lacks a name
HW_SLOWDOWN, HW_THERMAL, HW_POWER_BRAKE = 0x8, 0x40, 0x80
SMI_FIELDS = ("index", "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure",
              "ecc.errors.uncorrected.volatile.total", "clocks_throttle_reasons.hw_slowdown",
              "clocks_throttle_reasons.hw_thermal_slowdown", "clocks_throttle_reasons.hw_power_brake_slowdown")


def gpu_found(nvml: NvmlProbe | None, device: Path = NVIDIA_DEVICE) -> bool:
    """A GPU on this node: NVML lists one, or the driver made its first device node."""
    return (nvml is not None and nvml.devices > 0) or device.exists()


def no_gpu(name: str) -> Check:
    """A GPU check on a node where none was found, with `health_check = on`: it fails rather than being left out."""
    async def missing() -> Seen:
        return Seen(False, "no GPU found on this node (NVML lists none, no /dev/nvidia0) and health_check = on")

    return Check(name, 1.0, missing)


# -- gpu-state ---------------------------------------------------------------------------------------------------
def gpu_state_check(nvml: NvmlProbe | None, budget_s: float) -> Check:
    return Check("gpu-state", budget_s, partial(anyio.to_thread.run_sync, partial(gpu_state, nvml),
                                                abandon_on_cancel=True))


def gpu_state(probe: NvmlProbe | None) -> Seen:
    """Every GPU's state, through the agent's NVML, else NVML opened here, else `nvidia-smi`."""
    if probe is not None:
        return _judge([_nvml_state(probe.nvml, handle) for handle in probe.handles])
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
    except Exception:  # no pynvml, or no driver behind it: nvidia-smi may still answer
        return _smi_state()
    try:
        return _judge([_nvml_state(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())])
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _nvml_state(nvml: Any, handle: Any) -> list[str]:
    """What is wrong with one GPU, as NVML tells (a reading the device does not support is left out)."""
    def read(call: str, *args: Any) -> Any:
        function = getattr(nvml, call, None)
        if function is None:
            return None
        try:
            return function(handle, *args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", object()):
                raise
            return None

    wrong: list[str] = []
    try:
        if read("nvmlDeviceGetRetiredPagesPendingStatus"):
            wrong.append("retired pages pending (a reset applies them)")
        rows = read("nvmlDeviceGetRemappedRows")
        if rows is not None and rows[2]:
            wrong.append("row remapping pending (a reset applies it)")
        if rows is not None and rows[3]:
            wrong.append("a row remapping failed")
        dbe = read("nvmlDeviceGetTotalEccErrors", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        if dbe:
            wrong.append(f"{dbe} uncorrectable ECC error(s) since the driver loaded")
        reasons = read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons")
        wrong += _throttled(
            int(reasons or 0),
            getattr(nvml, "nvmlClocksThrottleReasonHwSlowdown", HW_SLOWDOWN),
            getattr(nvml, "nvmlClocksThrottleReasonHwThermalSlowdown", HW_THERMAL),
            getattr(nvml, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", HW_POWER_BRAKE))
    except nvml.NVMLError as exc:  # only GPU_IS_LOST gets here
        wrong.append(f"GPU is lost ({exc})")
    return wrong


def _throttled(reasons: int, slowdown: int, thermal: int, power_brake: int) -> list[str]:
    named = [(slowdown, "HW slowdown"), (thermal, "thermal slowdown"), (power_brake, "power brake")]
    said = [name for bit, name in named if reasons & bit]
    return [f"clocks throttled: {', '.join(said)}"] if said else []


def _judge(devices: list[list[str]]) -> Seen:
    wrong = [f"GPU {index}: {'; '.join(problems)}" for index, problems in enumerate(devices) if problems]
    if wrong:
        return Seen(False, "; ".join(wrong))
    return Seen(bool(devices), f"{len(devices)} GPU(s): no pending retirement or remap, no uncorrectable ECC "
                               "error, no hardware throttling" if devices else "NVML lists no GPU")


def _smi_state() -> Seen:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Seen(False, f"neither NVML nor nvidia-smi answers: {exc}")
    if done.returncode != 0:
        return Seen(False, f"nvidia-smi exited {done.returncode}: {last_lines(done.stdout + done.stderr)}")
    return _judge([_smi_row(line) for line in done.stdout.splitlines() if line.strip()])


def _smi_row(line: str) -> list[str]:
    values = dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=False))
    said = {k: v for k, v in values.items() if not v.startswith("[")}  # [N/A], [Not Supported]
    wrong = []
    if said.get("retired_pages.pending", "").lower() == "yes":
        wrong.append("retired pages pending (a reset applies them)")
    if said.get("remapped_rows.pending", "").lower() == "yes":
        wrong.append("row remapping pending (a reset applies it)")
    if said.get("remapped_rows.failure", "").lower() == "yes":
        wrong.append("a row remapping failed")
    dbe = said.get("ecc.errors.uncorrected.volatile.total", "0")
    if dbe.isdigit() and int(dbe):
        wrong.append(f"{dbe} uncorrectable ECC error(s) since the driver loaded")
    throttled = [name for key, name in (("clocks_throttle_reasons.hw_slowdown", "HW slowdown"),
                                        ("clocks_throttle_reasons.hw_thermal_slowdown", "thermal slowdown"),
                                        ("clocks_throttle_reasons.hw_power_brake_slowdown", "power brake"))
                 if said.get(key, "").lower() == "active"]
    if throttled:
        wrong.append(f"clocks throttled: {', '.join(throttled)}")
    return wrong


# -- gpu-compute, collective -------------------------------------------------------------------------------------
def gpu_compute_check(python: str, budget_s: float, fill_mib: int = 256) -> Check:
    """`gpu-compute`: `python -m recovery.agent.checks.gpu_compute` (torch) multiplies matrices on every visible
    GPU against the CPU's product and fills and verifies `fill_mib` of each GPU's memory."""
    argv = [python or sys.executable, "-m", "recovery.agent.checks.gpu_compute", "--fill-mib", str(fill_mib)]
    return Check("gpu-compute", budget_s, partial(run_module, argv))


def collective_check(python: str, backend: str, budget_s: float) -> Check:
    """`collective`: two local processes form a group on `backend` (nccl on a GPU node, gloo on a CPU one) and
    all-reduce (`recovery.agent.checks.collective`)."""
    argv = [python or sys.executable, "-m", "recovery.agent.checks.collective", "--backend", backend]
    return Check("collective", budget_s, partial(run_module, argv))


async def run_module(argv: list[str]) -> Seen:
    """A check module run in its own interpreter: exit 0 passes, its last line is what it saw. The modules are
    standard library and torch only, so another interpreter finds them on the path given here."""
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    status, output = await run_to_end(argv, env={**os.environ, "PYTHONPATH": path})
    said = last_lines(output, 1)
    if status == 0:
        return Seen(True, said)
    ended = f"killed by signal {-status}" if status < 0 else f"exit {status}"
    return Seen(False, f"{ended}: {said}" if said else ended)

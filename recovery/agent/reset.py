"""Resetting a GPU before its ranks restart in place: what `RestartRanks.reset_devices` asks of the node.

An XID 48 (a double-bit ECC error) or a hung GPU is cleared by a reset, not by restarting the process on it; the
policy asks for one instead of moving the node's ranks to a spare. The reset runs after the node's ranks of the job
are gone (a GPU in use cannot be reset) and before they start again, with the command the agent is configured with
(`device_reset_command`, by default `nvidia-smi --gpu-reset -i {device}`); a reset that fails or takes too long fails
the restart with what the command said, so the policy moves the ranks instead.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess

import anyio

DEFAULT_COMMAND = "nvidia-smi --gpu-reset -i {device}"
OUTPUT_KEPT = 400  # characters of the command's output a failure quotes: its last words, not a whole log


class ResetFailed(Exception):
    """A device that could not be reset: the restart's ack says why."""


def command_for(template: str, device: int) -> list[str]:
    """The argv that resets `device`: the template split as a shell would, `{device}` replaced in each word."""
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ResetFailed(f"device_reset_command is not a command line: {exc}") from None
    if not words:
        raise ResetFailed("device_reset_command is empty: this node cannot reset a device")
    return [word.replace("{device}", str(device)) for word in words]


async def reset_device(template: str, device: int, timeout_s: float) -> None:
    """Run the reset command for `device`; ResetFailed (with the command's last output) unless it exits 0 within
    `timeout_s`."""
    argv = command_for(template, device)
    if shutil.which(argv[0]) is None:
        raise ResetFailed(f"cannot reset GPU {device}: {argv[0]} not found (set device_reset_command)")
    with anyio.move_on_after(timeout_s) as scope:
        result = await anyio.run_process(argv, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=False)
    if scope.cancelled_caught:
        raise ResetFailed(f"resetting GPU {device} took more than {timeout_s:g} s ({shlex.join(argv)})")
    if result.returncode != 0:
        said = result.stdout.decode(errors="replace").strip()[-OUTPUT_KEPT:]
        how = f"exit status {result.returncode}" if result.returncode > 0 else f"signal {-result.returncode}"
        raise ResetFailed(f"resetting GPU {device} failed ({shlex.join(argv)}: {how})" + (f": {said}" if said else ""))

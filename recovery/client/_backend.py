"""What differs between the process group's backends for in-process recovery: where a collective's tensors live,
how a live group is interrupted under a blocked collective, and how a broken one is let go. torch is imported
inside the functions, so that `import recovery.client` never imports it.

gloo blocks the calling thread in a collective and raises there when a peer's connection closes: a group is
interrupted by shutting its TCP connections (`_shut` in `recovery.client.torch`), and the collective raises.

NCCL runs a collective as a kernel on its own stream and returns to the host at once: a dead peer leaves the
kernel spinning (on NVLink or shared memory nothing ever fails; on sockets only at the group's timeout), and the
host learns nothing until it synchronizes. A group is interrupted by aborting its communicators (`abort()`:
`ncclCommAbort`, which makes the spinning kernels return), and the host must be told, since the kernels return
without an error: `ProcessGroupRecovery` marks the group aborted before it aborts, and a check after the stream
synchronized (`settled`) raises for it. PyTorch's own watchdog would otherwise tear the process down on the
error (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, 3 by default): for a group the SDK recovers, the SDK aborts, so the
watchdog's handling is off unless the script set it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

NCCL = "nccl"
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def on_device(backend: str) -> bool:
    """Does `backend` take its collectives' tensors on the GPU (NCCL), rather than on the CPU (gloo)?"""
    return backend.lower() == NCCL


def collective_device(backend: str, local_rank: int) -> Any:
    """The device of the tensors the SDK's own collectives use (the step's agreement, the state's hand-over)."""
    import torch

    return torch.device("cuda", local_rank) if on_device(backend) else torch.device("cpu")


def prepare(backend: str, local_rank: int) -> dict[str, Any]:
    """Before a group of `backend` is formed: its options to `init_process_group`. On NCCL the process's device is
    bound first (the communicator is created on it eagerly, so that an abort has one to abort) and the watchdog's
    own error handling is turned off (the SDK aborts and recovers; see the module's doc)."""
    if not on_device(backend):
        return {}
    import torch

    os.environ.setdefault(ASYNC_ERROR_HANDLING, "0")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return {"device_id": device}


def abort(backend: str) -> bool:
    """Abort the default group's communicators under a blocked collective (NCCL): True if there was one to abort.
    Called from the watcher thread; the group's bookkeeping is left to the training thread's `release`."""
    if not on_device(backend):
        return False
    import torch.distributed as dist

    group = dist.group.WORLD
    if group is None:
        return False
    group.abort()
    return True


def release(backend: str, aborted: bool) -> None:
    """Let the default group go: destroyed, or (NCCL, aborted) its bookkeeping dropped without a destroy that would
    wait on communicators that are gone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if aborted and on_device(backend):
        with contextlib.suppress(Exception):  # aborted twice, or already half gone: the destroy below clears it
            dist.distributed_c10d._abort_process_group()
        if not dist.is_initialized():
            return
    dist.destroy_process_group()


def settle(backend: str) -> None:
    """Wait for the collectives queued on the current stream (NCCL's return to the host before they ran): after it,
    the group's abort flag tells whether they completed. Nothing to wait for on gloo, which blocks in them."""
    if on_device(backend):
        import torch

        torch.cuda.current_stream().synchronize()

"""GPU tensors into the in-memory checkpoint tier's mapped files: one device-to-host copy each, straight into the
file's pages, which are page-locked once (`cudaHostRegister`) so that the copy runs at the link's full speed, by
DMA, with no staging buffer. `tensor.cpu()` followed by a memcpy into the file, as for a CPU tensor, copies twice
and the first copy, into pageable memory, goes through the driver's small pinned bounce buffer.

The copies are queued on a stream of their own that first waits for everything queued on the training stream (the
state as of the call), and the caller waits for them before the file changes hands: the stall is the copy itself.
A mapping is registered on its first GPU save and unregistered before it is unmapped (a registered range that is
unmapped under the driver is undefined behaviour). torch is imported inside the functions.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

logger = logging.getLogger("recovery.client")

_REGISTER_DEFAULT = 0


def on_gpu(tensor: Any) -> bool:
    return bool(tensor.device.type == "cuda")


def _address(mapped: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapped)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the mapping cannot be closed while a pointer into it is exported


class PinnedMappings:
    """The mappings registered with CUDA, by the address they start at, and the copy stream."""

    def __init__(self) -> None:
        self._registered: dict[int, int] = {}  # start address -> length
        self._failed: set[int] = set()  # registration refused: copied without it (slower, still one copy)
        self._stream: Any = None

    def register(self, mapped: mmap.mmap) -> bool:
        """Page-lock `mapped` for the GPU's copies, once; False where the driver refused (logged once)."""
        import torch

        start = _address(mapped)
        if start in self._registered:
            return True
        if start in self._failed:
            return False
        error = torch.cuda.cudart().cudaHostRegister(start, len(mapped), _REGISTER_DEFAULT)
        if int(error) != 0:
            logger.warning("cannot page-lock a checkpoint slot for GPU copies (CUDA error %s): copying through "
                           "pageable memory", error)
            self._failed.add(start)
            return False
        self._registered[start] = len(mapped)
        return True

    def unregister(self, mapped: mmap.mmap) -> None:
        """Before `mapped` is unmapped or resized."""
        if mapped.closed:
            return
        start = _address(mapped)
        self._failed.discard(start)
        if self._registered.pop(start, None) is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(start)

    def copy(self, mapped: mmap.mmap, placed: list[tuple[Any, int, int]]) -> None:
        """Copy each GPU tensor (contiguous) into `mapped` at its offset, `placed` as (tensor, offset, bytes), and
        return once every copy has landed."""
        import torch

        if not placed:
            return
        self.register(mapped)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=placed[0][0].device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(placed[0][0].device))  # the state as of this call
        targets = []
        with torch.cuda.stream(stream):
            for tensor, offset, size in placed:
                target = torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=offset)
                target.copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)
                tensor.record_stream(stream)  # its memory is not reused before the copy read it
                targets.append(target)
        stream.synchronize()
        del targets  # views of the mapping: it cannot be unmapped while they live

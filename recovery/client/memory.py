"""The in-memory checkpoint tier on the training side (MindIO ACP's asynchronous checkpoint): a rank's state copied
into its node agent's shared memory, which outlives the process, and read back from there by a process restarted
on the same node. torch is imported inside the functions, so that `import recovery.client` never imports it.

The agent gives every rank a directory of its own shared memory for the job (`RECOVERY_MEMORY_DIR`, under
/dev/shm): a checkpoint is one file there, `step<step>.shard<shard>.rank<rank>.mem`, which the agent persists to
storage in the background and removes once newer ones exist or the job ends. A file is written under a temporary
name and renamed, so that a name that exists is a whole checkpoint.

The format copies tensors as raw bytes (one memcpy each, no pickling of tensor data): a header, then the bytes.

    magic (8 bytes) | header length (8 bytes, little endian) | header (pickle) | padding | tensor bytes ...

The header holds the state with every tensor replaced by a reference (pickle's persistent ids: any nesting of
dicts, lists and objects, tensors shared between entries stored once) and each tensor's dtype, shape and offset.
A copy of the file elsewhere (the agent's storage copy) reads the same way.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import re
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recovery.client._pinned import PinnedMappings, on_gpu

MEMORY_DIR_ENV = "RECOVERY_MEMORY_DIR"
MAGIC = b"RCVMEM01"
ALIGN = 64
"""tensor data starts on 64-byte boundaries: aligned loads for every dtype, and whole cache lines"""
_NAME = re.compile(r"^step(\d+)\.shard(\d+)\.rank(\d+)\.mem$")


def memory_dir() -> Path | None:
    """This rank's directory of its agent's shared memory, or None (no agent, or one without a memory tier)."""
    value = os.environ.get(MEMORY_DIR_ENV)
    return Path(value) if value else None


def file_name(step: int, shard: int, rank: int) -> str:
    return f"step{step:09d}.shard{shard}.rank{rank}.mem"


def storage_name(step: int, shard: int) -> str:
    """The name of the persisted copy on storage: one per shard and step, whichever replica wrote it."""
    return f"step{step:09d}.shard{shard}.mem"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(step, shard, rank) of a checkpoint file's name, or None for anything else (a temporary file)."""
    match = _NAME.match(name)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def find(directory: Path, step: int, shard: int) -> Path | None:
    """A whole checkpoint of `shard` at `step` in `directory`: this node's copy from any rank that holds the shard
    (the lowest rank first: a restarted rank's own predecessor's, when it is the lowest, which no process of the rank
    hands back while it is read)."""
    found = sorted((parsed[2], path) for path in directory.glob(f"step{step:09d}.shard{shard}.rank*.mem")
                   if (parsed := parse_name(path.name)) is not None)
    return found[0][1] if found else None


class _Packer(pickle.Pickler):
    """Pickles the state with its tensors left out: each becomes a persistent id (its index in `tensors`)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Any] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        key = id(obj)
        if key not in self._seen:
            self._seen[key] = len(self.tensors)
            self.tensors.append(obj.detach())
        return ("tensor", self._seen[key])


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Any]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tensors[index]


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class MemorySlots:
    """The files of this rank's agent directory that this process writes checkpoints into, mapped once and kept
    mapped: a save is then one memcpy per tensor into pages that already exist, not a file's allocation (tmpfs
    zero-fills every new page, which costs as much as the copy itself).

    A file changes hands by its name (renames are atomic): `.slot.rank<r>.<n>` is this rank's to write; the rename
    to a checkpoint's name hands it to the agent, which persists it and, once a newer checkpoint of the rank exists,
    renames it `.free.rank<r>.<n>`, back to the rank's pool (`recovery.agent.memory`). A slot left by a process of
    this rank that died in the middle of a copy is free again for its successor."""

    def __init__(self, directory: Path, rank: int, prepare: bool = True) -> None:
        self.directory = directory
        self.rank = rank
        self.prepare = prepare  # allocate a second slot in the background after the first save
        self._mapped: dict[tuple[int, int], mmap.mmap] = {}  # (device, inode) -> its mapping, kept across saves
        self._orphans_freed = False
        self._created = 0
        self._lock = threading.Lock()  # the mappings, between the training thread and the one preparing a slot
        self._preparing: threading.Thread | None = None
        self._pinned: PinnedMappings | None = None  # made at the first GPU tensor saved

    def _claim(self) -> Path:
        """A slot file of this rank: a free one (the oldest name first), else a new one."""
        if not self._orphans_freed:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # the agent's to remove, with the job
            self._orphans_freed = True  # a dead predecessor's slots: never renamed to a checkpoint, never freed
            for orphan in sorted(self.directory.glob(f".slot.rank{self.rank}.*")):
                orphan.rename(orphan.with_name(orphan.name.replace(".slot.", ".free.", 1)))
        for free in sorted(self.directory.glob(f".free.rank{self.rank}.*")):
            slot = free.with_name(free.name.replace(".free.", ".slot.", 1))
            try:
                free.rename(slot)
            except FileNotFoundError:
                continue  # taken by the agent's clean-up meanwhile
            return slot
        return self._new_slot()

    def _new_slot(self) -> Path:
        with self._lock:
            self._created += 1
            slot = self.directory / f".slot.rank{self.rank}.{os.getpid()}.{self._created}"
        os.close(os.open(slot, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        return slot

    def _prepare(self, size: int) -> None:
        """Allocate the next slot's pages while training goes on: the newest checkpoint keeps its file until a newer
        one exists, so a rank writes into two files in turn, and the second would otherwise be allocated by the
        second save, in its stall."""
        try:
            slot = self._new_slot()
            self._mapping(slot, size)
            slot.rename(slot.with_name(slot.name.replace(".slot.", ".free.", 1)))
        except OSError:
            pass  # the next save allocates its slot itself

    def _mapping(self, slot: Path, size: int) -> mmap.mmap:
        fd = os.open(slot, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino)
            with self._lock:
                mapped = self._mapped.pop(key, None)
            if mapped is not None and len(mapped) == size:
                with self._lock:
                    self._mapped[key] = mapped
                return mapped
            if mapped is not None:
                if self._pinned is not None:
                    self._pinned.unregister(mapped)
                mapped.close()
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            with self._lock:
                self._mapped[key] = mapped
            return mapped
        finally:
            os.close(fd)

    def write(self, state: Any, path: Path) -> int:
        """Copy `state` (tensors anywhere in it, on the CPU or a GPU) into a slot and name it `path`, whole or not
        at all; the number of bytes. The copy is the caller's stall: one memcpy per CPU tensor into a mapped file,
        one device-to-host copy per GPU tensor into its page-locked pages (`recovery.client._pinned`)."""

        skeleton = io.BytesIO()
        packer = _Packer(skeleton)
        packer.dump(state)
        # whole tensors; a GPU's stay there and are copied straight into the file, any other comes to the CPU first
        tensors = [t.contiguous() if on_gpu(t) else t.cpu().contiguous() for t in packer.tensors]
        layout: list[tuple[str, tuple[int, ...], int, int]] = []
        offset = 0
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            layout.append((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, size))
            offset = _aligned(offset + size)
        header = pickle.dumps({"skeleton": skeleton.getvalue(), "tensors": layout}, protocol=pickle.HIGHEST_PROTOCOL)
        data_start = _aligned(len(MAGIC) + 8 + len(header))
        total = data_start + offset
        if self._preparing is not None:
            self._preparing.join()  # long done, unless saves come faster than a slot's allocation
            self._preparing = None
        slot = self._claim()
        mapped = self._mapping(slot, total)
        mapped[: len(MAGIC) + 8] = MAGIC + struct.pack("<Q", len(header))
        mapped[len(MAGIC) + 8: len(MAGIC) + 8 + len(header)] = header
        target = ctypes.c_char.from_buffer(mapped)
        base = ctypes.addressof(target) + data_start
        from_gpu = []
        for tensor, (_, _, start, size) in zip(tensors, layout, strict=True):
            if size and on_gpu(tensor):
                from_gpu.append((tensor, data_start + start, size))
            elif size:
                # memmove, one thread, the GIL released: torch's own copy_ splits a large copy over its OpenMP
                # threads, which on a busy node wait for each other (measured 2.5 times slower on 2 loaded cores)
                ctypes.memmove(base + start, tensor.data_ptr(), size)
        del target  # the mapping cannot be unmapped while a pointer into it is exported
        if from_gpu:
            if self._pinned is None:
                self._pinned = PinnedMappings()
            self._pinned.copy(mapped, from_gpu)
        os.replace(slot, path)  # the agent's from here
        if self.prepare and len(self._mapped) < 2:
            self._preparing = threading.Thread(target=self._prepare, args=(total,), name="recovery-memory-slot",
                                               daemon=True)
            self._preparing.start()
        return total

    def close(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        for mapped in self._mapped.values():
            if self._pinned is not None:
                self._pinned.unregister(mapped)
            mapped.close()
        self._mapped.clear()


class _OneOff(MemorySlots):
    """A slot no rank's pool knows: `write_state`s running at once in one directory (the ranks of a job, threads)
    never take, free or rename each other's files."""

    def _claim(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(prefix=".writing.", dir=self.directory)
        os.close(fd)
        return Path(name)


def write_state(state: Any, path: Path) -> int:
    """Copy `state` into a new file at `path` (no slot kept: a one-off, as a test or a tool writes one)."""
    slots = _OneOff(path.parent, -1, prepare=False)
    try:
        return slots.write(state, path)
    finally:
        slots.close()


def read_state(path: Path) -> Any:
    """The state `write_state` wrote at `path` (or a byte-for-byte copy of it): the file is mapped and each tensor
    copied out of the mapping once. Not views of it: the agent hands a file back to its rank's SDK for reuse, and a
    private mapping still shows the pages a later save rewrites."""
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < len(MAGIC) + 8:
            raise ValueError(f"{path} is no in-memory checkpoint")
        mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)  # writable (torch wants it), file untouched
    try:
        return state_from_buffer(mapped, str(path))
    finally:
        mapped.close()


def state_from_buffer(buffer: Any, name: str = "the buffer") -> Any:
    """The state held by `buffer` (a writable buffer with a checkpoint file's bytes: a mapping of one, or bytes
    received from a peer), each tensor copied out of it once."""
    import torch

    if len(buffer) < len(MAGIC) + 8 or bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise ValueError(f"{name} is no in-memory checkpoint")
    (length,) = struct.unpack("<Q", bytes(buffer[len(MAGIC): len(MAGIC) + 8]))
    header = pickle.loads(bytes(buffer[len(MAGIC) + 8: len(MAGIC) + 8 + length]))
    data_start = _aligned(len(MAGIC) + 8 + length)
    source = ctypes.c_char.from_buffer(buffer)
    base = ctypes.addressof(source) + data_start
    tensors = []
    try:
        for dtype, shape, start, nbytes in header["tensors"]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            if tensor.numel() * tensor.element_size() != nbytes or data_start + start + nbytes > len(buffer):
                raise ValueError(f"{name}: a tensor of {shape} {dtype} holds {nbytes} bytes")
            if nbytes:
                ctypes.memmove(tensor.data_ptr(), base + start, nbytes)  # one thread: see MemorySlots.write
            tensors.append(tensor)
    finally:
        del source  # a mapping cannot close while a pointer into it is exported
    return _Unpacker(io.BytesIO(header["skeleton"]), tensors).load()


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back: its step, the state, the tier it came from and the file."""

    step: int
    state: Any
    tier: str
    path: Path


def restore(step: int, shard: int, tier: str, holders: list[str], node: str | None, directory: Path | None,
            storage: Path | None) -> Restored | None:
    """The checkpoint of `shard` at `step` that a resume plan names in `tier` (`memory` or `storage`): from this
    node's shared memory when the plan names this node among the memory holders and the file is here, else the
    storage copy the agent persisted; None for a tier this module does not keep (`peer`, `dying`) or when
    neither copy exists."""
    if tier == "memory" and node in holders and directory is not None:
        path = find(directory, step, shard)
        if path is not None:
            state = read_state(path)
            # A file is written again only after the agent renamed it (handed it back to its rank): under its name
            # still, it was not rewritten while it was read.
            if path.exists():
                return Restored(step, state, "memory", path)
    if tier in ("memory", "storage") and storage is not None:
        # A memory copy on another node is not read across the network here: its persisted copy is, when the
        # agent there got to persist it.
        path = storage / storage_name(step, shard)
        if path.exists():
            return Restored(step, read_state(path), "storage", path)
    return None

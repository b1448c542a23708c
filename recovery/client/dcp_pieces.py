"""A `torch.distributed.checkpoint` checkpoint written one shard at a time, by whoever holds each shard, with no
process group: what a sharded job's dying checkpoint needs, since the fault that asks for it has broken the job's
group (and with it `dcp.save`'s collectives).

Each shard's writer (the rank that holds it live, or a rank whose node holds a copy of it in memory) writes a piece:
the shard's data file `__<shard>_0.distcp`, as `dcp.save` names rank `<shard>`'s, and its part of the metadata
`.piece<shard>` (which chunk of which tensor lies where in that file). The writer whose piece makes the set whole
merges the parts into the checkpoint's `.metadata`: from then on it is a DCP checkpoint like any other, in the
layout a script's own `dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})` has, and
`dcp.load` reads it into a mesh of any size (DCP reshards on load). A user who leaves the product keeps it.

A piece is written into a directory of its own and renamed into place: two writers of one shard (its rank, and the
rank holding its copy) leave one whole file, never a mix; parts and `.metadata` are whole or absent, whoever merges.
No piece holds more than one shard: no process ever holds the whole state.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import TensorWriteData, _create_write_items

Layout = dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]]
"""each sharded tensor of a state, by its place: its global shape and its local shard's offset in it (the same as
`recovery.client.shards.Layout`, which imports this module: not the other way round)"""

METADATA = ".metadata"
_PIECE = ".piece{shard}"
_counter = iter(range(1 << 62))  # a piece's temporary directory: unique across the threads of one process
_counter_lock = threading.Lock()


class _ShardPlanner(DefaultSavePlanner):
    """The default planner's items, except that every tensor `layout` names is a chunk of its whole tensor at its
    offset (as a DTensor's local shard is), and only piece 0 holds what is not sharded (the same on every shard)."""

    def __init__(self, layout: Layout, whole_too: bool) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        # DCP's paths name a dict's keys as strings (an optimizer's parameter index 0 is "0"), a list's indices as ints
        self.layout = {tuple(map(str, place)): where for place, where in layout.items()}
        self.whole_too = whole_too

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn in sorted(self.state_dict):
            value = self.state_dict[fqn]
            place = tuple(map(str, self.mappings[fqn]))
            if place in self.layout:
                shape, offset = self.layout[place]
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offset),
                                                                           sizes=value.size()),
                                                properties=TensorProperties.create_from_tensor(value),
                                                size=torch.Size(shape))))
            elif self.whole_too:
                items.extend(_create_write_items(fqn, value))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # one piece's plan covers one shard: the default's check that every tensor is covered would refuse it
        plans, metadata = create_default_global_save_plan(all_plans)
        metadata = dataclasses.replace(metadata, planner_data=dict(self.mappings))
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        return value if isinstance(value, torch.Tensor) else super().lookup_object(index)


class _PieceWriter(FileSystemWriter):
    """DCP's file writer, its data file named for the shard, its metadata kept as the piece's part."""

    def __init__(self, path: Path, shard: int) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1, overwrite=True)
        self.shard = shard
        self.part: tuple[Metadata, list[Any]] | None = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.shard}_")) for plan in plans]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        self.part = (metadata, [result for results_of in results for result in results_of])


def name(step: int) -> str:
    """The directory of the DCP checkpoint of `step`, under a job's storage."""
    return f"step{step:09d}.dcp"


def write_piece(state: dict[str, Any], layout: Layout, shard: int, shards: int, checkpoint: Path) -> bool:
    """Write shard `shard` of `shards` (its tensors, `layout` saying where each sharded one sits in its whole) as its
    piece of the DCP checkpoint `checkpoint`; True when the checkpoint is whole after it (this writer or another
    merged `.metadata`)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}")
    checkpoint.mkdir(parents=True, exist_ok=True)
    with _counter_lock:
        scratch = checkpoint / f".writing.{shard}.{os.getpid()}.{next(_counter)}"
    try:
        writer = _PieceWriter(scratch, shard)
        dcp.save(state, storage_writer=writer, planner=_ShardPlanner(layout, shard == 0), no_dist=True)
        assert writer.part is not None
        for path in sorted(scratch.glob("*.distcp")):
            os.replace(path, checkpoint / path.name)  # one whole file, whoever of its writers came last
        _write_atomically(checkpoint / _PIECE.format(shard=shard), writer.part, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return merge(checkpoint, shards)


def pieces(checkpoint: Path, shards: int) -> list[int]:
    """The shards whose piece `checkpoint` holds."""
    return [shard for shard in range(shards) if (checkpoint / _PIECE.format(shard=shard)).exists()]


def merge(checkpoint: Path, shards: int) -> bool:
    """Write `checkpoint`'s `.metadata` from its pieces' parts once every shard's is there; True if it is whole."""
    if (checkpoint / METADATA).exists():
        return True
    if len(pieces(checkpoint, shards)) < shards:
        return False
    state_metadata: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for shard in range(shards):
        with (checkpoint / _PIECE.format(shard=shard)).open("rb") as file:
            metadata, results = pickle.load(file)
        planner_data.update(metadata.planner_data or {})
        for fqn, entry in metadata.state_dict_metadata.items():
            known = state_metadata.get(fqn)
            if known is None:
                state_metadata[fqn] = entry
            elif isinstance(known, TensorStorageMetadata) and isinstance(entry, TensorStorageMetadata):
                known.chunks.extend(entry.chunks)
        for result in results:
            storage[result.index] = result.storage_data
    for entry in state_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.sort(key=lambda chunk: tuple(chunk.offsets))
            covered = sum(int(torch.Size(chunk.sizes).numel()) for chunk in entry.chunks)
            if covered != entry.size.numel():
                raise ValueError(f"{checkpoint}: the pieces of {shards} shard(s) hold {covered} of the "
                                 f"{entry.size.numel()} elements of a tensor: a shard is missing, or they are not one "
                                 f"step's shards")
    merged = Metadata(state_dict_metadata=dict(sorted(state_metadata.items())), planner_data=planner_data,
                      storage_data=storage)
    merged.version = CURRENT_DCP_VERSION
    merged.storage_meta = FileSystemWriter(checkpoint).storage_meta()
    _write_atomically(checkpoint / METADATA, merged, checkpoint)
    return True


def _write_atomically(path: Path, value: Any, scratch: Path) -> None:
    with _counter_lock:
        temporary = scratch / f".{path.name}.{os.getpid()}.{next(_counter)}.tmp"
    try:
        with temporary.open("wb") as file:
            pickle.dump(value, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


__all__ = ["METADATA", "merge", "name", "pieces", "write_piece"]

"""Resharding a 1-D FSDP job's state onto a mesh of another size: a job that lost a node and has no spare goes on
with fewer ranks, its model built again on the smaller mesh, and each survivor fills its new shards from the old
shards' files of one step (`recovery.client.shards`: node memory, a buddy's copy, storage).

Every old file holds its rank's local tensors and where each sits in its whole tensor (`shards.Layout`: the global
shape and the local offset). A new shard is a box in the same whole tensor; it is filled from every old shard whose
box meets it, element for element, so any split of any number of dimensions reshards (FSDP's uneven chunks and empty
shards included), growth as well as shrinkage.
"""

from __future__ import annotations

import ctypes
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recovery.client import memory, shards
from recovery.client.shards import Held, Layout, Path_, Resumed

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""a shard's region of its whole tensor: its offset and its shape"""
_TIERS = ("memory", "peer memory", "storage")
"""where a rank's old shards came from, nearest first: a resume names the furthest it used"""


def _named(place: Path_) -> str:
    return ".".join(map(str, place))


def _meet(one: Box, other: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The first and one-past-the-last index, per dimension, of the region both boxes hold; None where it is empty."""
    low = tuple(max(a, b) for a, b in zip(one[0], other[0], strict=True))
    high = tuple(min(a + n, b + m) for a, n, b, m in zip(one[0], one[1], other[0], other[1], strict=True))
    return (low, high) if all(lo < hi for lo, hi in zip(low, high, strict=True)) else None


def _region(low: tuple[int, ...], high: tuple[int, ...], origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, origin, strict=True))


def _leaves(value: Any, layout: Layout, place: Path_ = ()) -> list[Path_]:
    """The places of `value` that hold something other than a container or a sharded tensor."""
    if place in layout:
        return []
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, layout, (*place, k))]
    if isinstance(value, list | tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, layout, (*place, i))]
    return [place]


class Reshard:
    """This rank's new shards, filled from the old shards' states one at a time (`add`), then whole (`result`).

    Built from this rank's state on the new mesh as `shards.local_shards` returns it; that state's tensors may be
    the live parameters themselves, so the shards are filled into tensors of their own and the state is only read.
    """

    def __init__(self, state: Any, layout: Layout) -> None:
        self.state, self.layout = state, layout
        self.shards = {
            place: torch.zeros(local.shape, dtype=local.dtype, device=local.device)
            for place in layout
            for local in [shards._at(state, place)]
        }
        self.covered = dict.fromkeys(layout, 0)
        self.seen: dict[Path_, set[Box]] = {place: set() for place in layout}  # the old shards' boxes taken in
        self.unsharded = _leaves(state, layout)
        self.first: dict[Path_, Any] | None = None  # the unsharded leaves, as the first old shard added holds them

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Reshard:
        """For a model and optimizer just built on the new mesh (the optimizer's state made, e.g. by
        `torch.distributed.checkpoint.state_dict._init_optim_state`: a state it lacks is not filled)."""
        return cls(*shards.local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()}))

    def add(self, piece: dict[str, Any]) -> bool:
        """Copy into this rank's new shards what one old shard's state (`memory.read_state`'s) holds of them. False,
        and nothing taken, for an old shard already added. Raises ValueError, nothing taken, for a tensor whose whole
        shape differs between the meshes or whose old shard lies outside it or overlaps another's in part."""
        boxes: dict[Path_, tuple[Box, torch.Tensor]] = {}
        for place, (shape, offset) in piece.get("layout", {}).items():
            if place not in self.layout:
                continue  # gone from the model or the optimizer: nothing to fill
            whole = tuple(self.layout[place][0])
            local = shards._at(piece, place)
            box = (tuple(int(o) for o in offset), tuple(local.shape))
            if tuple(shape) != whole:
                raise ValueError(f"{_named(place)}: {tuple(shape)} on the old mesh, {whole} on the new")
            if (
                len(box[0]) != len(whole)
                or len(box[1]) != len(whole)
                or any(o < 0 or o + n > w for o, n, w in zip(*box, whole, strict=True))
            ):
                raise ValueError(f"{_named(place)}: an old shard of {box[1]} at {box[0]} is not within {whole}")
            if local.numel():  # an empty shard (FSDP's last ranks on an uneven split) holds nothing to take
                boxes[place] = (box, local)
        if boxes and all(box in self.seen[place] for place, (box, _) in boxes.items()):
            return False  # the same old shard again (from two tiers, say): counted once
        for place, (box, _) in boxes.items():
            # the shards of one step never overlap; a box seen already holds the same elements (a replicated tensor)
            if box not in self.seen[place] and any(_meet(box, seen) for seen in self.seen[place]):
                raise ValueError(
                    f"{_named(place)}: an old shard of {box[1]} at {box[0]} overlaps another in part: "
                    f"the shards are not of one step of one mesh"
                )
        first = self.first if self.first is not None else self._unsharded_of(piece)
        for place, (box, local) in boxes.items():
            if box in self.seen[place]:
                continue
            self.seen[place].add(box)
            target = self.shards[place]
            origin = tuple(self.layout[place][1])
            met = _meet(box, (origin, tuple(target.shape)))
            if met is not None:
                target[_region(*met, origin)] = local[_region(*met, box[0])]
                self.covered[place] += math.prod(hi - lo for lo, hi in zip(*met, strict=True))
        self.first = first
        return True

    def _unsharded_of(self, piece: dict[str, Any]) -> dict[Path_, Any]:
        found: dict[Path_, Any] = {}
        for place in self.unsharded:
            if place in piece.get("layout", {}):
                raise ValueError(f"{_named(place)}: sharded on the old mesh, not on the new")
            try:
                found[place] = shards._at(piece, place)
            except (KeyError, IndexError, TypeError):
                continue  # new in this state (an option the old optimizer lacked): the new state's value
        return found

    def result(self) -> dict[str, Any]:
        """The new state, its structure as built: each shard filled, every other leaf as the first old shard added
        holds it (the old shards agree on them), else as the new state does. Raises ValueError for a shard some of
        whose elements no old shard added held."""
        for place, target in self.shards.items():
            if self.covered[place] != target.numel():
                raise ValueError(
                    f"{_named(place)}: the old shards hold {self.covered[place]} of this rank's "
                    f"{target.numel()} elements of it: a shard is missing"
                )
        return self._built(self.state, ())

    def _built(self, value: Any, place: Path_) -> Any:
        if place in self.shards:
            return self.shards[place]
        if isinstance(value, dict):
            return {k: self._built(v, (*place, k)) for k, v in value.items() if place or k != "layout"}
        if isinstance(value, list | tuple):
            return type(value)(self._built(v, (*place, i)) for i, v in enumerate(value))
        return self.first[place] if self.first is not None and place in self.first else value


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Copy a state of local shards (`Reshard.result`, or a rank's own file) into the model's shards in place and
    into the optimizer, whose sharded state becomes DTensors on the parameters' mesh again."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            target.copy_(state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    for index, entries in saved["state"].items():
        param = params[index]
        for key, value in list(entries.items()):
            # `step` is a plain tensor on every rank; the moments are shards of the parameter's shape
            if (
                isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and key != "step"
                and value.shape == param.to_local().shape
            ):
                entries[key] = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
    optimizer.load_state_dict(saved)


def resume_resharded(
    rank: int,
    world: int,
    old_shards: int,
    at_most: int,
    node: str,
    directory: Path | None,
    storage: Path | None,
    reshard: Callable[[], Reshard],
    load: Callable[[Any], None],
) -> Resumed | None:
    """Agree with every rank of the new world on the newest step, not past `at_most`, whose every one of the
    `old_shards` shards some rank can read (`shards.newest_complete`), fill this rank's new shards from all of them
    (`reshard()` makes the empty ones) and `load` the result; None where no step is whole. An old shard a rank can
    read itself (its node's memory first, then storage) it reads; else the first rank in rank order holding it (in
    memory first) sends the file. A collective of the default group: every rank calls it at once, and every rank
    walks the same shards, senders and receivers in the same order, so the sends and receives pair up."""
    mine = shards.held_here(directory, storage)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (node, sorted(mine)))
    nodes: list[str] = [entry[0] for entry in gathered]
    held: list[list[Held]] = [entry[1] for entry in gathered]
    found = shards.newest_complete(held, old_shards, at_most)
    if found is None:
        return None
    step = found[0]
    readable = [set(entries) for entries in held]
    into = reshard()
    furthest = 0
    peers: dict[str, None] = {}  # the nodes whose memory sent this rank old shards, in order, once each
    for shard in range(old_shards):
        in_memory = [r for r in range(world) if Held(step, shard, "memory") in readable[r]]
        on_storage = [r for r in range(world) if Held(step, shard, "storage") in readable[r]]
        readers = set(in_memory) | set(on_storage)
        sender = (in_memory or on_storage)[0]
        sent_from = "memory" if in_memory else "storage"
        if rank == sender:  # first, so that the ranks waiting on it need not wait for its own read too
            for to in range(world):
                if to not in readers:
                    shards._send_file(mine[Held(step, shard, sent_from)], to)
        if rank in readers:
            tier = "memory" if rank in in_memory else "storage"
            into.add(memory.read_state(mine[Held(step, shard, tier)]))
            furthest = max(furthest, _TIERS.index(tier))
        else:
            payload = shards._receive_file(sender)  # kept alive here: the view below does not
            into.add(memory.state_from_buffer(shards._view(payload), f"step {step} of shard {shard}"))
            del payload
            if sent_from == "memory":
                peers[nodes[sender]] = None
                furthest = max(furthest, _TIERS.index("peer memory"))
            else:
                furthest = max(furthest, _TIERS.index("storage"))
    load(into.result())
    source = _TIERS[furthest] + (f" ({', '.join(peers)})" if furthest == 1 else "")
    return Resumed(step, f"{source} (resharded from {old_shards} shards)")


def old_shards(mine: int, device: Any = "cpu") -> int:
    """The old world's shard count where some rank is to reshard them (`mine`: this rank's, 0 for none), else 0. A
    collective: a process started into the new world does not know the world the survivors trained in."""
    found = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return int(found.item())


def from_live(rank: int, world: int, old: int, kept: tuple[Any, Layout] | None, kept_shard: int, step: int,
              reshard: Callable[[], Reshard], load: Callable[[Any], None], device: Any = "cpu") -> Resumed | None:
    """Reshard from the survivors' live shards of `step` (`kept`: this rank's state and layout when its group went
    down, None where it holds none of `step`), where every one of the `old` shards has one: a scale out, or a scale
    in that lost no shard. Each old shard's first holder in rank order sends it to every other rank, in the same
    order on every rank. None, with nothing sent, where some old shard is not live (every rank sees the same)."""
    holders: list[Any] = [None] * world
    dist.all_gather_object(holders, kept_shard if kept is not None else -1)
    first = {shard: holders.index(shard) for shard in range(old) if shard in holders}
    if len(first) < old:
        return None
    into = reshard()
    for shard in range(old):
        sender = first[shard]
        if rank == sender:
            assert kept is not None
            piece = {**kept[0], "layout": kept[1]}
            for to in range(world):
                if to != rank:
                    send_state(piece, to, device)
            into.add(piece)
        else:
            into.add(receive_state(sender, device))
    load(into.result())
    return Resumed(step, f"live shards (resharded from {old} shards)")


def send_state(state: Any, to: int, device: Any) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=to)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=to)


def receive_state(source: int, device: Any) -> Any:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=source)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=source)
    payload = payload.cpu()
    return torch.load(io.BytesIO(ctypes.string_at(payload.data_ptr(), payload.numel())), weights_only=False)

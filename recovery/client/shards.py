"""Sharded state kept in node memory, with a copy on another node (Gemini's in-memory checkpoints, MindIO ACP), and
the resume of a sharded job from the newest step every shard has somewhere: the part of `recovery.client.fsdp` that
needs no replica.

Every rank copies its shards into its node agent's shared memory (`Client.save_async`: the training stall is that
copy), and a background thread sends the file to the rank's buddy: the rank at the same index on the next node (in
the order the ranks' nodes first appear), which writes it into its own node's memory and tells its agent
(`Client.held_copy`). One node's loss never takes both copies of a shard. Each rank keeps its two newest files, and a
copy waits for the one before it: while the newest step's copies are on their way, the step before is whole on
both nodes.

After a failure, `resume` finds the newest step every shard has in memory on a live node (or, failing that, in the
storage copies the agents persisted) and every rank loads its shards of that step: from its own node's memory when
they are there, else sent by a rank whose node holds them (point to point, in the same order on every rank), else
from storage. Storage is read only when memory holds no complete step.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recovery.client import memory
from recovery.client._client import Client

logger = logging.getLogger("recovery.client")

KEEP = 2
"""checkpoint files a rank keeps in memory, and copies a buddy keeps of it: the newest and the one before"""
COPY_JOIN_S = 10.0
"""how long a failure waits for the copy thread, whose group was just shut, to give up"""
_STORAGE_NAME = re.compile(r"^step(\d+)\.shard(\d+)\.mem$")


def buddies(nodes: list[str]) -> list[int | None]:
    """For every rank (its node given in `nodes`), the rank holding the copy of its shards: the rank at the same
    index (modulo that node's ranks) on the next node, in the order the nodes first appear; None on one node."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    members: dict[str, list[int]] = {node: [] for node in order}
    for rank, node in enumerate(nodes):
        members[node].append(rank)
    found: list[int | None] = []
    for rank, node in enumerate(nodes):
        following = members[order[(order.index(node) + 1) % len(order)]]
        found.append(following[members[node].index(rank) % len(following)])
    return found


@dataclass(frozen=True, order=True)
class Held:
    """A whole checkpoint of one shard at one step that a rank can read: in its node's memory or on storage."""

    step: int
    shard: int
    tier: str  # "memory" or "storage"


def held_here(directory: Path | None, storage: Path | None) -> dict[Held, Path]:
    """What this rank can read: every checkpoint file of its node's memory (its own, its node's other ranks', the
    copies it holds for another node) and of `storage`."""
    found: dict[Held, Path] = {}
    if directory is not None and directory.is_dir():
        for path in sorted(directory.glob("step*.mem")):
            parsed = memory.parse_name(path.name)
            if parsed is not None:
                found.setdefault(Held(parsed[0], parsed[1], "memory"), path)
    if storage is not None and storage.is_dir():
        for path in sorted(storage.glob("step*.mem")):
            match = _STORAGE_NAME.match(path.name)
            if match:
                found.setdefault(Held(int(match[1]), int(match[2]), "storage"), path)
    return found


def newest_complete(held: list[list[Held]], shards: int, at_most: int) -> tuple[int, str] | None:
    """The newest step, not past `at_most`, whose every shard some rank can read, and the tier that needs: `memory`
    when every shard is in memory somewhere, else `storage`; a step wholly in memory wins over a newer one that needs
    storage (storage is read only when memory holds no complete step)."""
    tiers: dict[str, dict[int, set[int]]] = {"memory": {}, "storage": {}}
    for entries in held:
        for entry in entries:
            if entry.step <= at_most and 0 <= entry.shard < shards:
                tiers[entry.tier].setdefault(entry.step, set()).add(entry.shard)
    everything = set(range(shards))
    in_memory = [step for step, have in tiers["memory"].items() if have >= everything]
    if in_memory:
        return max(in_memory), "memory"
    either = [step for step in set(tiers["memory"]) | set(tiers["storage"])
              if tiers["memory"].get(step, set()) | tiers["storage"].get(step, set()) >= everything]
    return (max(either), "storage") if either else None


def whole_at(held: list[list[Held]], shards: int, step: int) -> bool:
    """Can every shard of `step` be read, from memory or from storage?"""
    found = {entry.shard for entries in held for entry in entries if entry.step == step}
    return found >= set(range(shards))


def _read(path: Path) -> torch.Tensor:
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def _view(payload: torch.Tensor) -> Any:
    """A writable buffer over a received payload's bytes (no copy); it does not keep `payload` alive: the caller
    does, while the buffer is used."""
    return (ctypes.c_char * payload.numel()).from_address(payload.data_ptr())


def _send_file(path: Path, to: int, group: Any = None) -> None:
    data = _read(path)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=to, group=group)
    dist.send(data, dst=to, group=group)


def _receive_file(source: int, group: Any = None) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=source, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=source, group=group)
    return payload


class BuddyCopies:
    """This rank's copies to its buddy and from its wards, on a group of their own (made on every new formation, by
    every rank), in a background thread: training does not wait for them."""

    def __init__(self, client: Client, rank: int, nodes: list[str], directory: Path) -> None:
        self.client, self.rank, self.directory = client, rank, directory
        pairs = buddies(nodes)
        self.buddy = pairs[rank]
        self.wards = [ward for ward, buddy in enumerate(pairs) if buddy == rank]
        self.group = dist.new_group(backend="gloo")  # every rank, in the same order: a collective of its own
        self.copied = 0
        self.broken = False
        self._queue: queue.Queue[tuple[int, int, Path] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="recovery-buddy-copies", daemon=True)
        self._thread.start()

    def copy(self, step: int, shard: int, path: Path) -> None:
        """Send `path` (this rank's checkpoint of `shard` at `step`) to the buddy and take the wards' of the same
        step, in the background; a copy still under way is waited for first (at most one in flight: the step before
        is whole on both nodes meanwhile)."""
        if self.broken or (self.buddy is None and not self.wards):
            return
        self._idle.wait()
        self._idle.clear()
        self._queue.put((step, shard, path))

    def wait(self, timeout: float | None = None) -> bool:
        """Until the copy under way, if any, is done (or failed); False if `timeout` passed first."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._exchange(*item)
                self.copied += 1
            except Exception as exc:  # a peer died or the group was shut: no more copies in it
                self.broken = True
                logger.info("rank %d: copy of step %d to its buddy ended: %s", self.rank, item[0], exc)
            finally:
                self._idle.set()
            if self.broken:
                return

    def _exchange(self, step: int, shard: int, path: Path) -> None:
        """One round: the file's size (0: none to send) and bytes to the buddy, the wards' from them. A local error (a
        file gone, memory full) costs this round's copy, never the round itself: a rank that left it would hold up
        its ward's next copy, and so that ward's training."""
        sizes = {ward: torch.zeros(2, dtype=torch.int64) for ward in self.wards}
        works = [dist.irecv(size, src=ward, group=self.group) for ward, size in sizes.items()]
        data = torch.empty(0, dtype=torch.uint8)
        if self.buddy is not None:
            try:
                data = _read(path)
            except (OSError, RuntimeError) as exc:
                logger.warning("rank %d: step %d not copied to its buddy: %s", self.rank, step, exc)
            works.append(dist.isend(torch.tensor([data.numel(), shard], dtype=torch.int64), dst=self.buddy,
                                    group=self.group))
        for work in works:
            work.wait()
        payloads = {ward: torch.empty(int(size[0]), dtype=torch.uint8) for ward, size in sizes.items() if size[0]}
        works = [dist.irecv(payload, src=ward, group=self.group) for ward, payload in payloads.items()]
        if self.buddy is not None and data.numel():
            works.append(dist.isend(data, dst=self.buddy, group=self.group))
        for work in works:
            work.wait()
        for ward, payload in payloads.items():
            ward_shard = int(sizes[ward][1])
            target = self.directory / memory.file_name(step, ward_shard, ward)
            temporary = self.directory / f".held.rank{ward}.{os.getpid()}.tmp"
            try:
                with temporary.open("wb") as file:
                    file.write(memoryview(_view(payload)))
                os.replace(temporary, target)  # whole or not at all, as a rank's own save
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                logger.warning("rank %d: the copy of rank %d's step %d not kept: %s", self.rank, ward, step, exc)
                continue
            self.client.held_copy(step, [ward_shard], target, ward, keep=KEEP)

    def close(self) -> None:
        """Stop the thread (its group is shut or about to be destroyed). A thread still inside a collective when the
        process group is destroyed, or when the interpreter exits, aborts the process: it ends first."""
        self._queue.put(None)
        self._thread.join(COPY_JOIN_S)


Path_ = tuple[Any, ...]
"""where a tensor sits in a state: its keys and indices, outermost first"""
Layout = dict[Path_, tuple[tuple[int, ...], tuple[int, ...]]]
"""each DTensor of a state, by its place: its global shape and its local shard's offset in it"""


def local_shards(value: Any, place: Path_ = (), layout: Layout | None = None) -> tuple[Any, Layout]:
    """`value` with every DTensor replaced by its local shard (not a copy), and the layout that puts the shards of
    every rank together again (`to_dcp`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    layout = {} if layout is None else layout
    if isinstance(value, DTensor):
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        layout[place] = (tuple(value.shape), tuple(int(o) for o in offset))
        return value.to_local().detach(), layout
    if isinstance(value, dict):
        return {k: local_shards(v, (*place, k), layout)[0] for k, v in value.items()}, layout
    if isinstance(value, list | tuple):
        return type(value)(local_shards(v, (*place, i), layout)[0] for i, v in enumerate(value)), layout
    return value, layout


def _at(value: Any, place: Path_) -> Any:
    for key in place:
        value = value[key]
    return value


def _replaced(value: Any, place: Path_, full: dict[Path_, torch.Tensor]) -> Any:
    if place in full:
        return full[place]
    if isinstance(value, dict):
        return {k: _replaced(v, (*place, k), full) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_replaced(v, (*place, i), full) for i, v in enumerate(value))
    return value


def whole_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole state from every shard's (`ShardedTraining.save_async`'s files of one step, one per shard): each
    sharded tensor put together from its shards, everything else as the first shard holds it. Raises ValueError
    when a tensor is not wholly covered (a shard missing)."""
    full: dict[Path_, torch.Tensor] = {}
    covered: dict[Path_, int] = {}
    for state in states:
        for place, (shape, offset) in state.get("layout", {}).items():
            local = _at(state, place)
            whole = full.setdefault(place, torch.zeros(shape, dtype=local.dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=False))] = local
            covered[place] = covered.get(place, 0) + local.numel()
    for place, whole in full.items():
        if covered[place] != whole.numel():
            raise ValueError(f"{'.'.join(map(str, place))}: the shards hold {covered[place]} of its {whole.numel()} "
                             f"elements: a shard is missing")
    first = {k: v for k, v in states[0].items() if k != "layout"}
    return _replaced(first, (), full)


def to_dcp(files: list[Path], checkpoint_id: str | os.PathLike[str]) -> None:
    """Write `files` (one step's, one per shard, in shard order) as a `torch.distributed.checkpoint` checkpoint at
    `checkpoint_id`, in the layout a script's own `dcp.save({"model": model.state_dict(), "optimizer":
    optimizer.state_dict()})` has: `dcp.load` reads it into any mesh (DCP reshards on load). One shard is read at
    a time (`recovery.client.dcp_pieces`): the whole state is never in this process."""
    from recovery.client import dcp_pieces

    target = Path(checkpoint_id)
    for shard, path in enumerate(files):
        state = memory.read_state(path)
        dcp_pieces.write_piece({k: v for k, v in state.items() if k != "layout"}, state.get("layout", {}), shard,
                               len(files), target)
        del state
    if not dcp_pieces.merge(target, len(files)):
        raise ValueError(f"{target}: the pieces of {len(files)} shard(s) are not all there")


def export(directories: list[Path], checkpoint_id: Path, step: int | None = None) -> int:
    """The newest step (or `step`) whose every shard is in `directories` (node memory or storage copies), written
    as a DCP checkpoint; its step."""
    found: dict[Held, Path] = {}
    for directory in directories:
        for held, path in held_here(directory, directory).items():
            found.setdefault(Held(held.step, held.shard, "memory"), path)
    shards = 1 + max((h.shard for h in found), default=-1)
    complete = sorted({h.step for h in found if all(Held(h.step, s, "memory") in found for s in range(shards))})
    if step is None and not complete:
        raise ValueError(f"no step has every one of {shards} shard(s) in {', '.join(map(str, directories))}")
    chosen = complete[-1] if step is None else step
    files = [found.get(Held(chosen, shard, "memory")) for shard in range(shards)]
    if None in files:
        raise ValueError(f"step {chosen}: shard(s) {[s for s, f in enumerate(files) if f is None]} not found")
    to_dcp([f for f in files if f is not None], checkpoint_id)
    return chosen


@dataclass(frozen=True)
class Resumed:
    """What `resume` loaded on this rank: the step, and where its shards came from (`memory` on its own node,
    `peer memory` sent from another node's, `storage`)."""

    step: int
    source: str


def whole_checkpoints(storage: Path | None) -> list[int]:
    """The steps of the DCP checkpoints on `storage` that are whole (dying ones, `dying_checkpoint`)."""
    from recovery.client import dcp_pieces

    if storage is None or not storage.is_dir():
        return []
    found = []
    for path in sorted(storage.glob("step*.dcp")):
        match = re.fullmatch(r"step(\d+)\.dcp", path.name)
        if match and (path / dcp_pieces.METADATA).exists():
            found.append(int(match[1]))
    return found


def resume(rank: int, world: int, shards: int, shard_of: Callable[[int], int], at_most: int, node: str,
           directory: Path | None, storage: Path | None, load: Callable[[Any], None],
           planned: int | None = None, load_checkpoint: Callable[[Path], None] | None = None,
           after: int = -1) -> Resumed | None:
    """Agree with every rank on the step to resume from, and `load` this rank's shards of it (see the module's doc):
    the step of the control plane's resume plan that a rank started for this recovery holds (`planned`), when every
    shard of it can be read, else the newest step whose every shard can be; None where no step is complete (then the
    job restarts from its own checkpoint). With `load_checkpoint`, a whole DCP checkpoint on storage (a dying one)
    counts too, where it is the plan's step or newer than every step memory holds whole: every rank then loads it at
    once (`dcp.load`, which reshards). Copies of steps up to `after` are of another world's shards (before a scale
    resharded the job) and are passed over. A collective of the default group: every rank calls it at once."""
    mine = {held: path for held, path in held_here(directory, storage).items() if held.step > after}
    checkpoints = whole_checkpoints(storage) if load_checkpoint is not None else []
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (node, sorted(mine), planned, checkpoints))
    nodes = [entry[0] for entry in gathered]
    held: list[list[Held]] = [entry[1] for entry in gathered]
    plans = [entry[2] for entry in gathered if entry[2] is not None]
    everywhere = sorted(set.intersection(*(set(entry[3]) for entry in gathered)))  # every rank reads it
    found = newest_complete(held, shards, at_most)
    dcp_step = max((s for s in everywhere if s <= at_most), default=None)
    if plans and plans[0] <= at_most and whole_at(held, shards, plans[0]):
        found = (plans[0], "plan")
    elif plans and plans[0] in everywhere:
        dcp_step, found = plans[0], None
    if dcp_step is not None and load_checkpoint is not None and (found is None or dcp_step > found[0]):
        assert storage is not None
        from recovery.client import dcp_pieces

        load_checkpoint(storage / dcp_pieces.name(dcp_step))
        return Resumed(dcp_step, "storage (a DCP dying checkpoint)")
    if found is None:
        return None
    step, _ = found
    source = ""
    for owner in range(world):  # every rank walks the same pairs, in rank order
        shard = shard_of(owner)
        in_memory = [r for r in range(world) if Held(step, shard, "memory") in held[r]]
        on_storage = [r for r in range(world) if Held(step, shard, "storage") in held[r]]
        if owner in in_memory or (not in_memory and owner in on_storage):
            if owner == rank:
                tier = "memory" if owner in in_memory else "storage"
                load(memory.read_state(mine[Held(step, shard, tier)]))
                source = tier
            continue
        sender = (in_memory or on_storage)[0]
        tier = "memory" if in_memory else "storage"
        if rank == sender:
            _send_file(mine[Held(step, shard, tier)], owner)
        elif rank == owner:
            payload = _receive_file(sender)  # held here: the view below does not keep it alive
            load(memory.state_from_buffer(_view(payload), f"step {step} of shard {shard}"))
            del payload
            source = f"peer memory ({nodes[sender]})" if tier == "memory" else "storage"
    return Resumed(step, source)


def dying_checkpoint(storage: Path, step: int, shard: int, shards: int, live: tuple[Any, Layout] | None,
                     directory: Path | None, wards: list[int]) -> dict[str, Any]:
    """This rank's part of a dying checkpoint at `step`, written as DCP pieces (`recovery.client.dcp_pieces`) into
    `<storage>/step<step>.dcp`: its shard from its `live` state (the shards and their layout), and the shards of its
    `wards` (the ranks whose copies its node holds) wherever their copies of `step` are in `directory`. The newest
    older step of the same shards that this node's memory holds is written too, into its own checkpoint: a rank
    lost in a crash left no state at the survivors' step, but its newest copy is here, and with the survivors' own
    copies of that step it makes a whole checkpoint. Returns what a save handler returns: tier `dying`, the shards
    of `step` written, where."""
    from recovery.client import dcp_pieces

    def piece(at: int, which: int, path: Path) -> bool:
        state = memory.read_state(path)
        layout = state.pop("layout", {}) if isinstance(state, dict) else {}
        return dcp_pieces.write_piece(state, layout, which, shards, storage / dcp_pieces.name(at))

    written: list[int] = []
    whole: list[int] = []
    if live is not None:
        if dcp_pieces.write_piece(live[0], live[1], shard, shards, storage / dcp_pieces.name(step)):
            whole.append(step)
        written.append(shard)
    held: dict[tuple[int, int], Path] = {}  # (step, shard) -> this node's copy, the own shard's and the wards'
    if directory is not None and directory.is_dir():
        for path in sorted(directory.glob("step*.mem")):
            parsed = memory.parse_name(path.name)
            if parsed is not None and (parsed[1] == shard or parsed[2] in wards) and parsed[0] <= step:
                held.setdefault((parsed[0], parsed[1]), path)
    # one older step at most: a preempted rank writes on its way out, within the platform's grace
    older = sorted({at for at, which in held if which == shard and at < step}, reverse=True)[:1]
    for (at, which), path in sorted(held.items()):
        if (at == step and (which != shard or live is None)) or at in older:
            try:
                if piece(at, which, path):
                    whole.append(at)
            except (OSError, ValueError) as exc:  # a copy handed back or removed meanwhile: the others still count
                logger.warning("step %d of shard %d not written to the dying checkpoint: %s", at, which, exc)
                continue
            if at == step:
                written.append(which)
    if whole:
        logger.warning("dying checkpoint(s) whole at step(s) %s in %s", sorted(set(whole)), storage)
    return {"tier": "dying", "shards": sorted(set(written)), "location": os.fspath(storage / dcp_pieces.name(step)),
            "shared": True}


def shut(copies: BuddyCopies | None) -> None:
    if copies is not None:
        with contextlib.suppress(Exception):
            copies.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m recovery.client.shards --to CKPT DIR...`: a sharded job's memory copies (a node's
    /dev/shm/recovery-<node>-*/<job>, or the storage the agents persisted them to) as a DCP checkpoint."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--to", required=True, type=Path, help="the DCP checkpoint's directory")
    parser.add_argument("--step", type=int, default=None, help="default: the newest step with every shard")
    args = parser.parse_args(argv)
    try:
        step = export(args.directories, args.to, args.step)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"step {step} written to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

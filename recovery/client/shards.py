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

    def wait(self) -> None:
        """Until the copy under way, if any, is done (or failed)."""
        self._idle.wait()

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
        sizes = {ward: torch.zeros(2, dtype=torch.int64) for ward in self.wards}
        works = [dist.irecv(size, src=ward, group=self.group) for ward, size in sizes.items()]
        data = None
        if self.buddy is not None:
            data = _read(path)
            works.append(dist.isend(torch.tensor([data.numel(), shard], dtype=torch.int64), dst=self.buddy,
                                    group=self.group))
        for work in works:
            work.wait()
        payloads = {ward: torch.empty(int(size[0]), dtype=torch.uint8) for ward, size in sizes.items()}
        works = [dist.irecv(payload, src=ward, group=self.group) for ward, payload in payloads.items()]
        if self.buddy is not None and data is not None:
            works.append(dist.isend(data, dst=self.buddy, group=self.group))
        for work in works:
            work.wait()
        for ward, payload in payloads.items():
            ward_shard = int(sizes[ward][1])
            target = self.directory / memory.file_name(step, ward_shard, ward)
            temporary = self.directory / f".held.rank{ward}.{os.getpid()}.tmp"
            with temporary.open("wb") as file:
                file.write(memoryview(_view(payload)))
            os.replace(temporary, target)  # whole or not at all, as a rank's own save
            self.client.held_copy(step, [ward_shard], target, ward, keep=KEEP)

    def close(self) -> None:
        """Stop the thread (its group is shut or about to be destroyed)."""
        self._queue.put(None)
        self._thread.join(COPY_JOIN_S)


@dataclass(frozen=True)
class Resumed:
    """What `resume` loaded on this rank: the step, and where its shards came from (`memory` on its own node,
    `peer memory` sent from another node's, `storage`)."""

    step: int
    source: str


def resume(rank: int, world: int, shards: int, shard_of: Callable[[int], int], at_most: int, node: str,
           directory: Path | None, storage: Path | None, load: Callable[[Any], None]) -> Resumed | None:
    """Agree with every rank on the newest step whose every shard can be read, and `load` this rank's shards of it
    (see the module's doc); None where no step is complete (then the job restarts from its own checkpoint). A
    collective of the default group: every rank calls it at once."""
    mine = held_here(directory, storage)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (node, sorted(mine)))
    nodes = [entry[0] for entry in gathered]
    held: list[list[Held]] = [entry[1] for entry in gathered]
    found = newest_complete(held, shards, at_most)
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


def shut(copies: BuddyCopies | None) -> None:
    if copies is not None:
        with contextlib.suppress(Exception):
            copies.close()

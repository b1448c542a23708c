"""The node's in-memory checkpoint tier (MindIO ACP): the shared memory the agent gives its ranks' checkpoints, which
outlives every training process and goes with the job (or the agent).

Every job gets a directory under `memory_dir` (/dev/shm: tmpfs, the node's RAM), passed to its ranks as
`RECOVERY_MEMORY_DIR`. A rank's SDK copies its state into a file there (`recovery.client.memory`: the training stall
is that copy) and says `memory_saved`; the agent then reports the checkpoint in tier `memory` on this node, copies
the file to the storage directory the rank named (one at a time, in the background: training goes on), reports it
in tier `storage`, and hands the rank's older checkpoint files back to its SDK for reuse (a rename to
`.free.rank<r>.<n>`: mapped pages are reused instead of allocated again). When the job ends here, or the agent
stops, the directory is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

logger = logging.getLogger("recovery.agent")

FILE_PREFIX = "step"
FILE_SUFFIX = ".mem"
PERSIST_QUEUE = 1024
END_WAIT_S = 120.0
"""how long a job's end waits for its checkpoints still being persisted before their memory goes"""

Report = Callable[[str, int, str, list[int]], None]
"""(job, step, tier, shards): a checkpoint to report as `checkpoint.saved`"""


@dataclass(frozen=True)
class Persist:
    job: str
    rank: int
    step: int
    shards: list[int]
    source: Path
    storage: Path


@dataclass
class JobMemory:
    directory: Path
    files: dict[int, list[Path]] = field(default_factory=dict)  # rank -> its checkpoint files, oldest first
    held: dict[int, list[Path]] = field(default_factory=dict)  # rank of another node -> its copies here, oldest first
    keep: dict[int, int] = field(default_factory=dict)  # rank -> how many of its newest files stay
    persisting: set[Path] = field(default_factory=set)
    freed: int = 0  # names handed back so far, for unique `.free` names


def memory_root(base: Path, node: str, runtime_dir: Path) -> Path:
    """This agent's directory under `base`: by node and runtime directory, so that agents sharing a host (tests,
    several nodes simulated on one) never share one."""
    tag = hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:10]
    return base / f"recovery-{node}-{tag}"


def _shard_file(step: int, shard: int) -> str:
    # The name `recovery.client.memory.storage_name` reads (the agent does not import the SDK: see test_layers).
    return f"step{step:09d}.shard{shard}.mem"


def persist_file(source: Path, target: Path) -> None:
    """Copy `source` to `target` durably, whole or not at all (a reader sees the old file or the new one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, temporary)  # sendfile(2): no copy through the agent's memory
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class MemoryTier:
    """The agent's part of the memory tier: its jobs' directories, their files' lifetime and the persisting."""

    def __init__(self, root: Path, report: Report) -> None:
        self.root = root
        self.report = report
        self.jobs: dict[str, JobMemory] = {}
        self._queue: tuple[MemoryObjectSendStream[Persist], MemoryObjectReceiveStream[Persist]] = \
            anyio.create_memory_object_stream[Persist](PERSIST_QUEUE)
        self.persisted = 0

    def job_dir(self, job: str) -> Path:
        """The job's directory, for the environment of its ranks here. The SDK makes it at its first save: a job
        that never saves into memory leaves nothing in the node's memory, even when the agent is killed."""
        memory = self.jobs.get(job)
        if memory is None:
            memory = self.jobs[job] = JobMemory(self.root / job)
        return memory.directory

    def saved(self, job: str, rank: int, step: int, shards: list[int], name: str, storage: str | None,
              held_for: int | None = None, keep: int = 1) -> None:
        """A rank's SDK copied a checkpoint into `name` of its job's directory: report it, queue its persisting,
        hand the rank's older files back. `held_for`: the file is a copy of another rank's (on another node: a
        sharded job's buddy copy), which that rank persists itself; `keep`: how many of the newest files of the rank
        (or of its copies here) stay (a sharded job keeps two: the newest complete step across every shard may be
        the one before the newest, while the newest's copies are on their way)."""
        memory = self.jobs.get(job)
        if memory is None or "/" in name or not name.startswith(FILE_PREFIX) or not name.endswith(FILE_SUFFIX):
            logger.warning("rank %d of %s named no checkpoint file of its job's memory: %r", rank, job, name)
            return
        path = memory.directory / name
        if not path.exists():
            logger.warning("the memory checkpoint %s of rank %d of %s is gone", name, rank, job)
            return
        self.report(job, step, "memory", shards)
        owner = rank if held_for is None else held_for
        files = (memory.files if held_for is None else memory.held).setdefault(owner, [])
        if path not in files:
            files.append(path)
        memory.keep[owner] = max(1, min(keep, 8))
        if storage and held_for is None:
            memory.persisting.add(path)
            try:
                self._queue[0].send_nowait(Persist(job, rank, step, shards, path, Path(storage)))
            except anyio.WouldBlock:
                memory.persisting.discard(path)
                logger.warning("persisting is %d checkpoints behind: step %d of %s stays in memory only",
                               PERSIST_QUEUE, step, job)
        if held_for is None:
            self._release(job, rank)
        else:
            self._drop_held(job, held_for)

    def _release(self, job: str, rank: int) -> None:
        """Every checkpoint file of the rank but its newest (`keep` of them), unless still being persisted, back to
        its SDK."""
        memory = self.jobs.get(job)
        if memory is None:
            return
        files = memory.files.get(rank, [])
        count = memory.keep.get(rank, 1)
        keep = files[-count:]
        for path in files[:-count]:
            if path in memory.persisting:
                keep.insert(len(keep) - count, path)
                continue
            memory.freed += 1
            with contextlib.suppress(FileNotFoundError):
                path.rename(path.with_name(f".free.rank{rank}.agent{memory.freed:06d}"))
        memory.files[rank] = keep

    def _drop_held(self, job: str, rank: int) -> None:
        """Copies of another node's rank beyond the newest `keep`: removed (no process here writes into them)."""
        memory = self.jobs.get(job)
        if memory is None:
            return
        files = memory.held.get(rank, [])
        count = memory.keep.get(rank, 1)
        for path in files[:-count]:
            path.unlink(missing_ok=True)
        memory.held[rank] = files[-count:]

    async def run(self) -> None:
        """Persist the queued checkpoints, one at a time (the storage's bandwidth is the job's, not this agent's)."""
        async for item in self._queue[1]:
            memory = self.jobs.get(item.job)
            try:
                for shard in item.shards[:1]:  # one file holds the rank's shards; named by the first
                    await anyio.to_thread.run_sync(persist_file, item.source, item.storage / _shard_file(item.step,
                                                                                                      shard))
            except OSError as exc:
                logger.warning("could not persist step %d of %s to %s: %s", item.step, item.job, item.storage, exc)
            else:
                self.persisted += 1
                self.report(item.job, item.step, "storage", item.shards)
            finally:
                if memory is not None:
                    memory.persisting.discard(item.source)
                    self._release(item.job, item.rank)

    async def end(self, job: str) -> None:
        """The job ended here: once its checkpoints are persisted (bounded by END_WAIT_S), its memory goes."""
        memory = self.jobs.get(job)
        if memory is None:
            return
        with anyio.move_on_after(END_WAIT_S):
            while memory.persisting:
                await anyio.sleep(0.05)  # polling the persister's progress, within the bound above
        self.jobs.pop(job, None)
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(memory.directory, ignore_errors=True))
        logger.info("memory checkpoints of %s removed", job)

    def close(self) -> None:
        """The agent stops: every job's memory goes with it (the node's memory would too)."""
        self.jobs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

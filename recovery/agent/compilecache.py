"""Compiled code that survives a restart: per-job compile caches that outlive the ranks, and a copy that spares find.

A rank of a script that uses `torch.compile` compiles every graph on its first steps (Inductor's generated code, the
C++ or Triton kernels built from it): seconds on a small model, minutes at scale, paid again by every restarted
process. PyTorch keeps what it compiled in caches on disk (Inductor's FX graph and AOTAutograd caches and its kernels
under `TORCHINDUCTOR_CACHE_DIR`, Triton's under `TRITON_CACHE_DIR`) and finds it there again in a new process; by
default those are per user in /tmp, which a restart on the same node reuses, but a spare node, where the job never
ran, has none, and a node shared by several jobs mixes them. So the agent gives each job its own cache directories,
`<compile_cache_dir>/<job>/inductor` and `.../triton` (unless the job's environment names its own), which outlive
its ranks on the node, and with a `shared_dir` (a directory every node reads and writes: a network file system) it
copies them there, `<shared_dir>/<job>/compile-cache`, once the node's ranks stepped and then every `SYNC_S` while
they run: a spare keeping standbys for the job fetches that copy ahead of a fault, any node before it starts a rank
of the job whose cache it lacks. The copy is one way per file (a file present with the same size is not copied
again; each is written beside its place and renamed into it), so two nodes writing the same content-addressed
entries never leave one half written.

Removed: a node's directory when the job ends there (its ranks there exited cleanly, or the job failed); the shared
copy when the job completes, by the agent of its first node. Their size is what PyTorch writes: for a small model on
the CPU a few MB, for a large model on GPUs hundreds of MB (mostly kernels).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from pathlib import Path

import anyio

logger = logging.getLogger("recovery.agent")

CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
"""the environment variables PyTorch's compile caches are found by, and each one's directory in the job's"""
SYNC_S = 30.0
"""how often a node copies what its ranks compiled to the shared directory while they run"""
SHARED_NAME = "compile-cache"
FRESH_S = 10.0
"""a fetch this recent is not made again: a node's ranks, started together, share one"""


def copy_new(source: Path, target: Path) -> int:
    """Copy every file of `source` that `target` lacks (or holds with another size) into it, each written beside
    its place and renamed into it; the number of files copied. A file that vanishes meanwhile is passed over."""
    copied = 0
    if not source.is_dir():
        return 0
    for folder, _, files in os.walk(source):
        here = Path(folder)
        there = target / here.relative_to(source)
        for name in files:
            path, dest = here / name, there / name
            try:
                size = path.stat().st_size
                if dest.exists() and dest.stat().st_size == size:
                    continue
                there.mkdir(parents=True, exist_ok=True)
                partial = there / f".{name}.{os.getpid()}.partial"
                shutil.copyfile(path, partial)
                os.replace(partial, dest)
                copied += 1
            except FileNotFoundError:  # PyTorch replaced or removed it meanwhile: the next copy takes its successor
                continue
    return copied


class CompileCaches:
    """The compile caches of the jobs on this node (`root`, one directory per job) and their shared copies
    (`shared`: None, no copy; spares then compile again)."""

    def __init__(self, root: Path, shared: Path | None, enabled: bool = True) -> None:
        self.root = root
        self.shared = shared
        self.enabled = enabled
        self._fetched: dict[str, float] = {}  # job -> when its shared copy was last fetched (monotonic)
        self._following: dict[str, anyio.CancelScope] = {}  # job -> its `follow` task's scope

    def job_dir(self, job: str) -> Path:
        return self.root / job

    def shared_dir(self, job: str) -> Path | None:
        return None if self.shared is None else self.shared / job / SHARED_NAME

    def environment(self, job: str, job_env: dict[str, str]) -> dict[str, str]:
        """The cache variables a rank of `job` gets: the job's own where its environment names them."""
        if not self.enabled:
            return {}
        return {var: str(self.job_dir(job) / name) for var, name in CACHES.items() if var not in job_env}

    async def fetch(self, job: str, fresh_s: float = FRESH_S) -> int:
        """Bring what the job's shared copy holds that this node lacks (a spare ahead of a fault, a node before a
        rank of the job starts there), unless it did within `fresh_s` (a node's ranks start together); the files
        copied."""
        shared = self.shared_dir(job)
        now = time.monotonic()
        if not self.enabled or shared is None or now - self._fetched.get(job, -math.inf) < fresh_s:
            return 0
        self._fetched[job] = now
        try:
            copied = await anyio.to_thread.run_sync(copy_new, shared, self.job_dir(job))
        except OSError as exc:  # the shared file system away: the ranks compile again, as without it
            logger.warning("compile cache of %s not fetched from %s: %s", job, shared, exc)
            return 0
        if copied:
            logger.info("compile cache of %s: %d file(s) fetched from %s", job, copied, shared)
        return copied

    async def publish(self, job: str) -> int:
        """Copy what this node's ranks of `job` compiled since to the shared directory; the files copied."""
        shared = self.shared_dir(job)
        if not self.enabled or shared is None:
            return 0
        try:
            return await anyio.to_thread.run_sync(copy_new, self.job_dir(job), shared)
        except OSError as exc:
            logger.warning("compile cache of %s not copied to %s: %s", job, shared, exc)
            return 0

    def to_follow(self, job: str) -> anyio.CancelScope | None:
        """The scope of a task to follow `job`'s caches on this node (`follow`), if none does yet."""
        if not self.enabled or self.shared is None or job in self._following:
            return None
        scope = self._following[job] = anyio.CancelScope()
        return scope

    async def follow(self, job: str, stepped: anyio.Event, scope: anyio.CancelScope,
                     period_s: float = SYNC_S) -> None:
        """Once the node's ranks of `job` stepped (their first graphs compiled), copy their caches to the shared
        directory, and again every `period_s` (a task of the agent, until the job ends here: `end`)."""
        with scope:
            await stepped.wait()
            while True:
                await self.publish(job)
                await anyio.sleep(period_s)  # the next copy's period: later graphs (a new shape, an eval step)

    async def end(self, job: str, completed: bool = False) -> None:
        """The job ended on this node: its caches here go; `completed` (the job's first node saw it complete), its
        shared copy too."""
        self._fetched.pop(job, None)
        following = self._following.pop(job, None)
        if following is not None:
            following.cancel()
            await self.publish(job)  # what its last steps compiled
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(self.job_dir(job), ignore_errors=True))
        shared = self.shared_dir(job)
        if completed and shared is not None:
            await anyio.to_thread.run_sync(_remove, shared)


def _remove(shared: Path) -> None:
    """The job's shared copy, and its job's directory there if nothing else is left in it."""
    shutil.rmtree(shared, ignore_errors=True)
    with contextlib.suppress(OSError):
        shared.parent.rmdir()

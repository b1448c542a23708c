"""Warm standbys: per job on this node, one pre-started interpreter that has imported what the job's ranks import
(torch, by default) and waits. A rank the agent (re)starts is handed to it instead of a new interpreter, which saves
the restarted rank its own start-up (about a second of `import torch` and `torch._dynamo` on a small machine, more
under load); then the agent starts the next standby, after `standby_delay_s`, so that its imports do not compete
for the CPU with the recovery under way.

On by default, two per job and node (one where the job has one rank there): the agent's `standby` setting for every
job (a cold restart's `import torch` is most of a single rank's recovery, and an idle interpreter is cheap on a
training node; two, because one fault often takes two ranks of a node together, a rank dying with the peer it
crashed or a host's memory killer taking two, and with one standby the second rank starts cold and the whole
recovery waits for it), or the job's own entrypoint environment `RECOVERY_STANDBY` (`0` opts a job out; a number N
keeps N per node, `all` one per rank on the node: a job whose faults restart every rank, a script without the SDK,
needs one for each). A spare keeps standbys too, for the newest accepted job that may take it (the agent's
`spare_standby_jobs`), one for each rank of a node of the job, since a lost node's ranks all move to the spare
together, until the job ends or a newer one takes its place. `RECOVERY_STANDBY_PRELOAD` (comma-separated modules)
overrides the agent's `standby_preload`. Only an entrypoint that runs a Python script (`python script.py ...` or
`python -m module ...`, the interpreter named `python*`) can be handed over; any other starts cold, as without a
standby. A job's standbys on the node are forked by one parent (`recovery.agent.standby_parent`, and
`recovery.agent.interpreter` for what a hand-over changes), which imports once, in a session of its own, started with
the job's environment and working directory, so that what the imports read is what a cold start would have read
(a parent per thread settings too: torch sizes its pools at import); a standby still importing when a rank is needed
is taken all the same and switched to full speed, its parent too (what it imported is the rank's head start: a cold
interpreter beside it would import it all again).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import orjson

from events.values import Entrypoint
from recovery.agent.standby_parent import ForkedStandby, StandbyParent, regroup
from recovery.agent.stephook import with_step_hook

logger = logging.getLogger("recovery.agent")

STANDBY_ENV = "RECOVERY_STANDBY"
PRELOAD_ENV = "RECOVERY_STANDBY_PRELOAD"
IDLE_ENV = "RECOVERY_STANDBY_IDLE"  # `recovery.agent.interpreter`'s: it imports nothing of the agent
DEFAULT_PER_NODE = 2
"""standbys a job keeps on a node when its entrypoint does not say (fewer where it has fewer ranks there)"""
READY_TIMEOUT_S = 600.0
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_DYNAMIC", "MKL_DYNAMIC")
"""what the thread pools of torch and its math libraries read once, when torch is imported: a standby imported it
under its own environment, so it can become only a rank whose environment says the same (or the rank would compute
with other threads than a cold start of it, and a CPU reduction split another way can end in other bits)"""


def thread_settings(env: dict[str, str]) -> tuple[str | None, ...]:
    """The values of THREAD_SETTINGS in `env` (None: unset)."""
    return tuple(env.get(name) for name in THREAD_SETTINGS)


def can_hand_over(entrypoint: Entrypoint) -> bool:
    """A Python interpreter running a script or a module, with no interpreter options before it."""
    if not Path(entrypoint.command).name.startswith("python") or not entrypoint.args:
        return False
    first = entrypoint.args[0]
    return (first == "-m" and len(entrypoint.args) > 1) or not first.startswith("-")


@dataclass(slots=True)
class Standby:
    """One warm interpreter of a job, forked by the job's standby parent; ready once its warm-ups are done."""

    job: str
    process: ForkedStandby
    threads: tuple[str | None, ...] = ()  # `thread_settings` of the environment it imported under
    ready: anyio.Event = field(default_factory=anyio.Event)
    taken: bool = False  # handed a rank: its imports, if not done yet, finish for the rank

    @property
    def pid(self) -> int | None:
        """None until its parent, its imports done, forked it."""
        return self.process.pid

    async def hand_over(self, entrypoint: Entrypoint, env: dict[str, str], output: Path) -> ForkedStandby:
        """Make the standby the rank: its command line, environment, working directory and output. Waits for the
        fork of a standby whose parent still imports; StandbyLost if it never comes (the rank starts cold)."""
        output.parent.mkdir(parents=True, exist_ok=True)
        rank = {"argv": list(entrypoint.args), "cwd": entrypoint.cwd, "env": env, "output": str(output)}
        pid = await self.process.hand_over(orjson.dumps(rank) + b"\n")  # read once its warm-ups are done
        if not self.ready.is_set():
            # promoted again now that the hand-over is on its standard input: an interpreter that had not yet gone
            # idle when `take` promoted it goes idle, then finds the line there and comes back by itself; one that
            # went idle after that look is brought back here
            self.promote()
            await regroup(pid)
        return self.process

    def promote(self) -> None:
        """Every thread of it, and of its parent, back to `SCHED_OTHER` and a rank's scheduling weight: a rank waits
        on the rest of its imports now, which must not run only on CPU time the node's other processes leave."""
        self.process.parent.promote()  # it may still import what the standby is forked with
        self.process.promote()

    async def close(self) -> None:
        """An idle standby ends when its standard input closes; the kill is for one still warming."""
        await self.process.aclose()


def one_thread_each(env: dict[str, str], local_ranks: int) -> dict[str, str]:
    """`env`, with OMP_NUM_THREADS 1 where a node runs several ranks and neither the job nor the agent sets it, as
    torchrun does: each rank's intra-op pool sized to all the node's cores oversubscribes them (four ranks on two
    cores stepped 1.6 times slower)."""
    if local_ranks > 1 and "OMP_NUM_THREADS" not in env:
        return {**env, "OMP_NUM_THREADS": "1"}
    return env


def standbys_wanted(choice: str | None, enabled: bool, local_ranks: int) -> int:
    """How many standbys a job keeps on a node: `RECOVERY_STANDBY` of its entrypoint (`0`/`false`/`no`/empty: none,
    a number: that many, `all`: one per rank here, anything else: one), else `DEFAULT_PER_NODE` (at most one per
    rank here) if the agent's `standby` is on."""
    if choice is None:
        return max(1, min(DEFAULT_PER_NODE, local_ranks)) if enabled else 0
    choice = choice.strip().lower()
    if choice in ("", "0", "false", "no"):
        return 0
    if choice == "all":
        return max(1, local_ranks)
    return max(1, min(int(choice), local_ranks)) if choice.isdigit() else 1


class StandbyPool:
    """The agent's standbys: per job, as many as it wants (`standbys_wanted`)."""

    def __init__(self, runtime_dir: Path, enabled: bool, preload: str, delay_s: float, step_hook: bool = True,
                 idle_s: float = 10.0) -> None:
        self.runtime_dir = runtime_dir
        self.idle_s = idle_s  # how long a standby imports on idle CPU time alone (the agent's `standby_idle_s`)
        self.step_hook = step_hook  # the ranks' step hook, installed at the standby's start as at a rank's
        self.enabled = enabled
        self.preload = preload
        self.delay_s = delay_s
        self._standbys: dict[str, list[Standby]] = {}
        self._wanted: dict[str, int] = {}
        self._closed: set[str] = set()
        self._warming: list[str] = []  # a spare's: the jobs it keeps standbys for, oldest first
        self._starting: dict[str, int] = {}  # per job, standbys being started, not yet in the pool
        self._parents: dict[tuple[str, tuple[str | None, ...], bool], StandbyParent] = {}
        """per job, thread settings and idleness: the interpreter that imported once and forks the standbys"""
        self._starting_parent = anyio.Lock()
        self._lingering: list[StandbyParent] = []  # let go, waiting for the ranks they forked to end
        self._count = 0

    def wanted(self, entrypoint: Entrypoint, local_ranks: int = 1, whole: bool = False) -> int:
        """How many standbys the job keeps here (0: none); `whole`: its faults restart every rank (no process of it
        here recovers in place), so by default each of its ranks here has one."""
        if not can_hand_over(entrypoint):
            return 0
        choice = entrypoint.env.get(STANDBY_ENV)
        if choice is None and whole and self.enabled:
            return max(1, local_ranks)
        return standbys_wanted(choice, self.enabled, local_ranks)

    def trim(self, job: str, wanted: int) -> list[Standby]:
        """The job's standbys past `wanted`, taken out to be closed (it learned it needs fewer)."""
        self._wanted[job] = wanted
        standbys = self._standbys.get(job)
        if not standbys or len(standbys) <= wanted:
            return []
        extra, self._standbys[job] = standbys[wanted:], standbys[:wanted]
        return extra

    def spare_wanted(self, entrypoint: Entrypoint, ranks_per_node: int) -> int:
        """How many standbys a spare keeps for a job that may take it: one for each rank a node of the job runs (a
        lost node's ranks all move to the spare together), unless the job's `RECOVERY_STANDBY` says otherwise."""
        if not can_hand_over(entrypoint):
            return 0
        choice = entrypoint.env.get(STANDBY_ENV)
        if choice is None:
            return max(1, ranks_per_node) if self.enabled else 0
        return standbys_wanted(choice, self.enabled, ranks_per_node)

    def warm_for(self, job: str, jobs: int) -> list[str]:
        """A spare warms standbys for `job` now, keeping them for the `jobs` newest such jobs: the older ones it
        drops (their standbys are to be stopped with `drop`)."""
        self._warming = [*(j for j in self._warming if j != job), job]
        dropped, self._warming = self._warming[:-jobs] if jobs else self._warming, self._warming[-jobs:] if jobs else []
        return dropped

    async def drop(self, job: str) -> None:
        """Stop the job's standbys and want none until it asks again (`keep`): a spare no longer warm for it."""
        self._wanted[job] = 0
        with contextlib.suppress(ValueError):
            self._warming.remove(job)
        for standby in self._standbys.pop(job, []):
            await standby.close()
        await self._close_parents(job)

    def take(self, job: str, env: dict[str, str]) -> Standby | None:
        """One of the job's standbys that imported under the thread settings of `env`, the rank's environment (it is
        then the caller's): a ready one, else one still importing, promoted to full speed (what it has imported is
        the rank's head start over a cold interpreter, which would import it all again beside it); else None: a
        cold start."""
        wanted = thread_settings(env)
        fitting = [s for s in self._standbys.get(job, []) if s.process.returncode is None and s.threads == wanted]
        for standby in sorted(fitting, key=lambda s: not s.ready.is_set()):  # the ready first, in pool order
            self._standbys[job].remove(standby)
            standby.taken = True
            if not standby.ready.is_set():
                standby.promote()
                logger.info("standby of %s (pid %s) taken before its imports were done", job, standby.pid)
            return standby
        return None

    async def keep(self, job: str, entrypoint: Entrypoint, count: int | Callable[[], int] = 1,
                   local_ranks: int = 1, stepped: anyio.Event | None = None, idle: bool = True,
                   delay_s: float | None = None) -> None:
        """Start the job's next standby after the delay (or once `stepped` is set: its ranks here stepped, their
        start-up is over), unless it has `count` already (a function: asked once the delay is over, what the agent
        knows of the job then), and wait for it to be ready (a task of the agent). Its environment has the threads a
        rank of `local_ranks` here gets: torch sizes its pool at import, before the hand-over. `idle`: it imports
        on CPU time the node's ranks leave (`SCHED_IDLE`); a spare's, beside no rank, at full speed."""
        if isinstance(count, int):
            self._wanted[job] = max(count, self._wanted.get(job, 0))
        delay = self.delay_s if delay_s is None else delay_s
        with anyio.move_on_after(delay):  # the recovery or the job's start first: they want the CPU now
            await (stepped.wait() if stepped is not None else anyio.sleep(delay))
        if not isinstance(count, int):
            self._wanted[job] = count()
        starting = self._starting.get(job, 0)
        if job in self._closed or len(self._standbys.get(job, [])) + starting >= self._wanted.get(job, 0):
            return
        self._starting[job] = starting + 1  # counted until it is in the pool: the job's other keeps see it
        try:
            standby, log = await self._open(job, entrypoint, local_ranks, idle)
        finally:
            self._starting[job] -= 1
        await self._ready(job, standby, log)

    async def _open(self, job: str, entrypoint: Entrypoint, local_ranks: int, idle: bool) -> tuple[Standby, Path]:
        """Fork a standby of the job from its parent (started first where the job has none here, or where it
        ended), in the pool from then on; and the parent's log."""
        env = with_step_hook(one_thread_each({**os.environ, **entrypoint.env}, local_ranks), self.step_hook)
        # the job's own `RECOVERY_STANDBY_IDLE=0` (nodes whose CPUs its ranks keep busy): at full speed from the start
        env[IDLE_ENV] = "1" if idle and entrypoint.env.get(IDLE_ENV, "1") != "0" else "0"
        key = (job, thread_settings(env), idle)
        async with self._starting_parent:  # the job's standbys asked at once share one parent
            parent = self._parents.get(key)
            if parent is None or not parent.alive:
                preload = entrypoint.env.get(PRELOAD_ENV, self.preload)
                modules = [m.strip() for m in preload.split(",") if m.strip()]
                self._count += 1
                log = self.runtime_dir / f"{job}.standby{self._count}.log"
                parent = await StandbyParent.start(entrypoint.command, modules, entrypoint.cwd, env, log)
                self._parents[key] = parent
        standby = Standby(job, parent.fork(), key[1])
        self._standbys.setdefault(job, []).append(standby)
        return standby, parent.log

    async def _ready(self, job: str, standby: Standby, log: Path) -> None:
        ready = False
        with anyio.move_on_after(READY_TIMEOUT_S):
            with anyio.move_on_after(self.idle_s):
                ready = await standby.process.ready()
            if not ready and not standby.process.ended:
                # no idle CPU time on this node for that long (its ranks keep every core busy): at a rank's weight
                # from now on, or it might never be ready; once forked too, as a standby goes idle by itself
                standby.promote()
                await regroup(standby.process.parent.process.pid)
                if await standby.process.forked_or_ended():
                    standby.promote()
                    await regroup(standby.process.pid)  # type: ignore[arg-type]  # forked: its pid is known
                ready = await standby.process.ready()
        if ready:
            standby.ready.set()
            if not standby.taken:
                logger.info("standby of %s ready (pid %s, imports and warm-ups %.3fs)", job, standby.pid,
                            standby.process.ready_s)
        elif not standby.taken:
            logger.warning("standby of %s did not start (see %s): its ranks start cold", job, log)
            with contextlib.suppress(ValueError):
                self._standbys.get(job, []).remove(standby)
            await standby.close()

    async def _close_parents(self, job: str) -> None:
        self._lingering = [parent for parent in self._lingering if parent.alive]
        for key in [key for key in self._parents if key[0] == job]:
            parent = self._parents.pop(key)
            if await parent.close():
                self._lingering.append(parent)  # until the ranks it forked have ended

    async def discard(self, job: str, for_good: bool = False) -> None:
        """Stop the job's standbys; `for_good`: the job is over here, start no other."""
        if for_good:
            self._closed.add(job)
        for standby in self._standbys.pop(job, []):
            await standby.close()
        if for_good:
            await self._close_parents(job)

    async def close(self) -> None:
        for job in list(self._standbys):
            await self.discard(job, for_good=True)

"""The stacks of a job's processes on this node, taken before a suspected hang is acted on (`dump_stacks`, seed
004's `dump`): a hang is found by comparing every rank's stack (the odd one out is the rank the others wait for in
their collective), and once the processes are killed that evidence is gone.

py-spy (its binary ships in its wheel, a dependency) reads a running CPython's stack from outside, as root or with
ptrace allowed, with no cooperation from the script: a stock script or a rank stuck in C code is dumped as well as
an SDK one. Each dump is bounded in time (`DUMP_TIMEOUT_S`: a process that cannot be read is reported with why,
never waited for) and in size (`MAX_STACK_CHARS`, innermost frames kept). The kill that follows the dump waits for
it (`Dumps.settled`), within the same bound.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import anyio

from events.kinds import MAX_STACK_CHARS, RankStack

logger = logging.getLogger("recovery.agent")

DUMP_TIMEOUT_S = 5.0
"""the longest one process's dump may take; a kill waits this long at most for the dumps under way"""
TOOL = "py-spy"


def dump_tool() -> str | None:
    """The py-spy binary: on PATH, or beside the interpreter the agent runs in (its virtualenv's `bin`)."""
    beside = Path(sys.executable).with_name(TOOL)
    return shutil.which(TOOL) or (str(beside) if beside.exists() else None)


def trimmed(text: str) -> str:
    """`text` within the wire's bound: py-spy prints the innermost frame first, so the end is what goes."""
    if len(text) <= MAX_STACK_CHARS:
        return text
    cut = "\n... (cut: the outermost frames)\n"
    return text[:MAX_STACK_CHARS - len(cut)] + cut


async def take_stack(rank: int, pid: int, tool: str | None, timeout_s: float = DUMP_TIMEOUT_S) -> RankStack:
    """Rank `rank`'s stack (process `pid`), or the reason there is none."""
    if tool is None:
        return RankStack(rank=rank, pid=pid, error=f"{TOOL} not found on the node")
    with anyio.move_on_after(timeout_s):
        try:
            # Full file names: the report tells the script's frames from the libraries' by them.
            done = await anyio.run_process([tool, "dump", "--full-filenames", "--pid", str(pid)], check=False,
                                           stdin=subprocess.DEVNULL)
        except OSError as exc:
            return RankStack(rank=rank, pid=pid, error=f"{TOOL} did not run: {exc}")
        out = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            why = (done.stderr.decode(errors="replace").strip() or out.strip())[-900:]
            return RankStack(rank=rank, pid=pid, error=f"{TOOL} exited {done.returncode}: {why}")
        return RankStack(rank=rank, pid=pid, stack=trimmed(_printable(out)))
    return RankStack(rank=rank, pid=pid, error=f"{TOOL} took longer than {timeout_s:g} s")


def _printable(text: str) -> str:
    """The wire's free text takes no control character but tab and line ends."""
    return "".join(c if c >= " " or c in "\t\n\r" else "?" for c in text)


class Dumps:
    """The dumps under way per job: a kill of the job's processes first lets them finish (bounded)."""

    def __init__(self) -> None:
        self._running: dict[str, anyio.Event] = {}

    def begin(self, job: str) -> anyio.Event:
        """A dump of `job` starts now (call before any await, so that a kill started after it sees it)."""
        done = self._running[job] = anyio.Event()
        return done

    def end(self, job: str, done: anyio.Event) -> None:
        done.set()
        if self._running.get(job) is done:
            del self._running[job]

    async def settled(self, job: str) -> None:
        """Until the dump of `job` under way (if any) is taken, within its bound."""
        done = self._running.get(job)
        if done is not None:
            with anyio.move_on_after(DUMP_TIMEOUT_S + 1.0):
                await done.wait()

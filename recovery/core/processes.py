"""What a job's processes say of themselves: a start, what their SDK can do, their first output, their stacks. None
of it decides anything by itself: a start marks the rank alive, the capabilities say how much a later fault may
restart and whether a dying checkpoint can be asked (`Job.can`), and the output and the stacks are kept for the
postmortem (a stock script's restart is measured to its first output; `recovery-replay report` compares stacks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recovery.core.job import Job
from recovery.core.record import Rejected

NOTED = frozenset(("process.started", "process.capabilities", "process.output", "process.stacks"))
"""the kinds `note` takes"""
AFTER_THE_END = frozenset(("process.capabilities", "process.output", "process.stacks"))
"""the kinds a job that has ended still takes: facts about processes that may arrive after its end"""


def note(job: Job, type_: str, data: Any, ts: int, stale: Callable[[Job, int, int], bool]) -> None:
    """Apply one of `NOTED` to `job`; `stale(job, rank, attempt)` says whether a process event is from a process the
    rank's restart has replaced since (and refuses an unknown rank or generation)."""
    if type_ == "process.started":
        if data.announces and job.caps is None:
            job.caps = frozenset()  # its agent relays what the SDK can do: nothing until a rank says
        if not stale(job, data.rank, data.attempt):
            job.put(job.alive, data.rank, 1)
            job.put(job.last_seen, data.rank, ts)
            job.put(job.spoke, data.rank, 0)  # a new process: silent until it has spoken is not yet a hang
    elif type_ == "process.capabilities":
        if not stale(job, data.rank, data.attempt):  # a replaced process's word is no longer the rank's
            job.caps = (job.caps or frozenset()) | frozenset(data.caps)
            if job.counted:
                job.sdk = False  # its reports, however they came before this word, were the step hook's counts
    elif type_ == "process.output":
        if data.rank >= job.world:
            raise Rejected("unknown_rank", f"rank {data.rank} is not in job {job.id}")
    elif type_ == "process.stacks":
        outside = sorted({s.rank for s in data.ranks if s.rank >= job.world})
        if outside:
            raise Rejected("unknown_rank", f"ranks {outside} are not in job {job.id}")

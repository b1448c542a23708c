"""Hangs of a stock script, seen from outside its processes: a script without the SDK sends no heartbeat, so its
agent watches what the kernel and py-spy show of its ranks instead.

Two rules, each chosen so that what a healthy job does for minutes never trips it:

- **stopped**: a rank's process in state `T` (SIGSTOP, SIGTSTP: /proc/<pid>/stat) for `stopped_s`. Nothing a
  training script does on its own stops it; a debugger's ptrace stop is `t`, and py-spy's own short stop too, so
  neither counts.
- **still**: a rank whose CPU time (utime + stime) and I/O (rchar + wchar, /proc/<pid>/io) have not moved for
  `still_s`, not in uninterruptible I/O (`D`: a slow disk is slow, not hung), whose stack (py-spy) is the same at
  both ends of that time and outside any collective, while a peer of its job on the node waits inside one. A slow
  first step computes or loads (CPU and I/O move), a long checkpoint save writes (I/O moves) while its peers wait in
  a barrier: neither is still. What is left is a rank that waits on something that will never come (a lock, a queue,
  a dead peer it reads from) while the others wait for it.

A rank that uses the SDK is left to it: its silence is a surer sign (`rank_silence_s`). The rules are pure functions
of samples (`observe`), tested with made-up /proc data; reading /proc and taking stacks is the agent's part
(`recovery.agent.hangs`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

STOPPED = "T"
UNINTERRUPTIBLE = "D"
COLLECTIVE_FRAME = re.compile(
    r"torch/distributed/|torch/nn/parallel/distributed\.py|\b(all_reduce|allreduce|all_gather|reduce_scatter|"
    r"broadcast|barrier|all_to_all|_engine_run_backward|monitored_barrier)\b")
"""a frame of a process waiting in a collective: torch.distributed's calls, DDP's, and autograd's backward, whose end
waits for DDP's gradient all-reduce"""


@dataclass(frozen=True, slots=True)
class ProcSample:
    """What /proc shows of one rank's process (and its children) at one moment."""

    pid: int
    state: str
    cpu_ticks: int
    """utime + stime, clock ticks"""
    io_chars: int | None
    """rchar + wchar, bytes (None: /proc/<pid>/io not readable)"""


@dataclass(frozen=True, slots=True)
class Suspicion:
    """A rank the rules find hung, and why, for `process.hang`."""

    rank: int
    seconds: float
    cause: str


@dataclass(slots=True)
class _Watched:
    sample: ProcSample
    changed_at: float  # when its CPU time or I/O last moved (agent clock)
    stopped_at: float | None  # since when it is in state T
    stack: str | None = None  # its stack at the first look since it became still (None: not taken yet)
    stack_at: float = 0.0  # when that look was
    reported: bool = False


@dataclass
class HangRules:
    """The two rules over a job's ranks on this node, fed one sample per rank per poll."""

    stopped_s: float = 10.0
    still_s: float = 45.0
    watched: dict[int, _Watched] = field(default_factory=dict)

    def observe(self, now: float, samples: dict[int, ProcSample]) -> list[Suspicion]:
        """Take this poll's samples (rank -> sample of its live process); the ranks found stopped too long."""
        for rank in list(self.watched):
            if rank not in samples:
                del self.watched[rank]  # gone, or replaced: its exit says what happened
        found = []
        for rank, sample in samples.items():
            seen = self.watched.get(rank)
            if seen is None or seen.sample.pid != sample.pid:  # a new process of the rank starts afresh
                self.watched[rank] = _Watched(sample, now, now if sample.state == STOPPED else None)
                continue
            moved = (sample.cpu_ticks != seen.sample.cpu_ticks or sample.io_chars != seen.sample.io_chars
                     or sample.state == UNINTERRUPTIBLE)
            if moved:
                seen.changed_at, seen.stack, seen.reported = now, None, False  # it lives
            if sample.state != STOPPED:
                seen.stopped_at = None
            elif seen.stopped_at is None:
                seen.stopped_at = now
            seen.sample = sample
            if (seen.stopped_at is not None and now - seen.stopped_at >= self.stopped_s and not seen.reported):
                seen.reported = True
                found.append(Suspicion(rank, round(now - seen.stopped_at, 3),
                                       f"stopped (state T: SIGSTOP) for {now - seen.stopped_at:.0f} s"))
        return found

    def still(self, now: float, after_s: float) -> list[int]:
        """The ranks not reported yet whose CPU time and I/O have not moved for `after_s`."""
        return sorted(rank for rank, seen in self.watched.items()
                      if not seen.reported and seen.stopped_at is None and now - seen.changed_at >= after_s)

    def judge_still(self, now: float, stacks: dict[int, str]) -> list[Suspicion]:
        """With the stacks of the job's ranks here (taken now): the still ones found hung. A still rank's stack is
        looked at once it has been still half of `still_s`; once it has been still `still_s` and its stack is the
        same as at that first look (half of `still_s` before at least), outside a collective, while a peer's is
        inside one, it hangs."""
        found = []
        for rank in self.still(now, self.still_s / 2):
            seen = self.watched[rank]
            stack = stacks.get(rank)
            if stack is None:
                continue
            if seen.stack != stack:
                seen.stack, seen.stack_at = stack, now  # the first look, or it moved on in between: look again later
                continue
            peers_wait = any(in_collective(s) for r, s in stacks.items() if r != rank)
            if (now - seen.changed_at >= self.still_s and now - seen.stack_at >= self.still_s / 2 and peers_wait
                    and not in_collective(stack)):
                seen.reported = True
                found.append(Suspicion(rank, round(now - seen.changed_at, 3),
                                       f"still for {now - seen.changed_at:.0f} s (no CPU time, no I/O, the same "
                                       f"stack) outside a collective while a peer waits in one"))
        return found


def in_collective(stack: str) -> bool:
    """Does a py-spy dump show the process waiting in a collective?"""
    return bool(COLLECTIVE_FRAME.search(stack))


def read_sample(pid: int, proc: Path = Path("/proc")) -> ProcSample | None:
    """The process's state, CPU time and I/O, with its children's (a launcher's python); None if it is gone."""
    own = _stat(proc / str(pid))
    if own is None:
        return None
    state, ticks = own
    io = _io(proc / str(pid))
    for child in _children(pid, proc):
        theirs = _stat(proc / str(child))
        if theirs is not None:
            ticks += theirs[1]
            if theirs[0] == STOPPED:
                state = STOPPED  # the script under a launcher is the one that matters
            child_io = _io(proc / str(child))
            io = None if io is None or child_io is None else io + child_io
    return ProcSample(pid, state, ticks, io)


def _stat(directory: Path) -> tuple[str, int] | None:
    try:
        text = (directory / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after the command name, which may hold spaces and parentheses
    if len(fields) < 13 or fields[0] in ("Z", "X"):
        return None
    return fields[0], int(fields[11]) + int(fields[12])  # state; utime, stime (fields 14 and 15 of stat)


def _io(directory: Path) -> int | None:
    try:
        lines = (directory / "io").read_text().splitlines()
    except OSError:
        return None
    counters = dict(line.split(":", 1) for line in lines if ":" in line)
    try:
        return int(counters["rchar"]) + int(counters["wchar"])
    except (KeyError, ValueError):
        return None


def _children(pid: int, proc: Path) -> list[int]:
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []
    children: list[int] = []
    for task in tasks:
        try:
            children.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return children

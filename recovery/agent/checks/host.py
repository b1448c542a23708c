"""The checks every node runs: its memory, the directories its ranks write to, and the platform's own commands."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import anyio

from recovery.agent.checks.process import last_lines, run_to_end
from recovery.agent.checks.runner import Check, Seen

GIB = 1 << 30
MIB = 1 << 20
WRITE_MIB = 4  # enough to pass the page cache's first absorption with fsync, small enough to take milliseconds
MEMINFO = Path("/proc/meminfo")


def memory_check(min_gib: float, budget_s: float, meminfo: Path = MEMINFO) -> Check:
    """`memory`: the kernel's estimate of the memory new processes can have (MemAvailable) is at least `min_gib`."""
    return Check("memory", budget_s, partial(anyio.to_thread.run_sync, partial(free_memory, min_gib, meminfo),
                                            abandon_on_cancel=True))


def free_memory(min_gib: float, meminfo: Path = MEMINFO) -> Seen:
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        return Seen(False, f"no MemAvailable in {meminfo}")
    available = int(fields["MemAvailable"].split()[0]) * 1024 / GIB  # kB
    verdict = "at least" if available >= min_gib else "under"
    return Seen(available >= min_gib, f"MemAvailable {available:.2f} GiB, {verdict} {min_gib:g} GiB")


def disk_check(directory: Path, min_free_gib: float, min_write_mib_s: float, budget_s: float) -> Check:
    """`disk:<dir>`: the directory (made if missing: the ranks would make it) has `min_free_gib` free, and takes a
    write of a few MiB with fsync at `min_write_mib_s` at least."""
    probe = partial(disk_space_and_speed, directory, min_free_gib, min_write_mib_s)
    return Check(f"disk:{directory}", budget_s, partial(anyio.to_thread.run_sync, probe, abandon_on_cancel=True))


def disk_space_and_speed(directory: Path, min_free_gib: float, min_write_mib_s: float) -> Seen:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory).free / GIB
        speed = _write_speed(directory)
        if speed < min_write_mib_s:
            # One fsync stalled behind another process's writeback is no slow disk: the better of two is judged.
            speed = max(speed, _write_speed(directory))
    except OSError as exc:
        return Seen(False, f"{exc.strerror or exc} ({directory})")
    problems = [f"free {free:.1f} GiB under {min_free_gib:g}"] if free < min_free_gib else []
    if speed < min_write_mib_s:
        problems.append(f"wrote {WRITE_MIB} MiB at {speed:.1f} MiB/s, under {min_write_mib_s:g}")
    figures = f"free {free:.1f} GiB (at least {min_free_gib:g}), wrote {WRITE_MIB} MiB with fsync at " \
              f"{speed:.0f} MiB/s (at least {min_write_mib_s:g})"
    return Seen(not problems, "; ".join(problems) if problems else figures)


def _write_speed(directory: Path) -> float:
    """MiB/s of a WRITE_MIB write with fsync into a file of `directory`, removed after."""
    block = os.urandom(MIB)  # not zeros: a compressing file system would write nothing
    fd, name = tempfile.mkstemp(prefix=".recovery-check-", dir=directory)
    try:
        started = time.perf_counter()
        for _ in range(WRITE_MIB):
            os.write(fd, block)
        os.fsync(fd)
        return WRITE_MIB / max(time.perf_counter() - started, 1e-6)
    finally:
        os.close(fd)
        os.unlink(name)


def command_check(name: str, command: str, budget_s: float) -> Check:
    """One of the platform's own checks: `command` run with /bin/sh; exit 0 passes; its last lines are what it
    saw; killed with its children past `budget_s`."""
    return Check(name, budget_s, partial(run_command, command))


async def run_command(command: str) -> Seen:
    status, output = await run_to_end(["/bin/sh", "-c", command])
    said = last_lines(output)
    if status == 0:
        return Seen(True, said)
    ended = f"killed by signal {-status}" if status < 0 else f"exit {status}"
    return Seen(False, f"{ended}: {said}" if said else ended)

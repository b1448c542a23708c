"""The failed exits of an incident's processes, counted per generation and per way they failed.

A script that fails the same way on every rank, in one generation after the other, before the job's first step,
is no fault a restart can cure (a typo in a flag, a missing file, a bug at import): the rescheduling policy sees
these counts (`RescheduleContext.exits`) to tell it from a fault of the infrastructure, and to quote the script's
own error when the job fails. Kept on the incident as a small tuple (two generations, a few ways each): the
journal's shallow copy of an incident stays exact, and a job-wide crash of 100,000 ranks counts in a few entries.
"""

from __future__ import annotations

from typing import Any

from events import kinds
from policies.base import FailedExits
from recovery.core.job import Job

MAX_WAYS = 8
"""distinct ways one generation's processes failed that are counted apart; the rest count as one"""
OTHER = "other errors"
_STOP_SIGNALS = (9, 15)
_STOP_CODES = (0, 128 + 9, 128 + 15)


def failed(data: kinds.ProcessExited) -> bool:
    """Did the process fail of its own: not a clean end, and not ended as a stop ends one (SIGTERM, SIGKILL)?"""
    if data.signal is not None:
        return data.signal not in _STOP_SIGNALS
    return data.exit_code is not None and data.exit_code not in _STOP_CODES


def stop_like(data: kinds.ProcessExited) -> bool:
    """Did the process end as a stop ends one: cleanly, or by SIGTERM or SIGKILL (as a signal or as the shell's
    128 + signal)?"""
    return data.exit_code in _STOP_CODES if data.signal is None else data.signal in _STOP_SIGNALS


def exit_text(data: kinds.ProcessExited) -> str:
    return f"signal {data.signal}" if data.signal is not None else f"exit code {data.exit_code}"


def way(data: kinds.ProcessExited) -> tuple[str, bool]:
    """How the process failed, as one line, and whether the script said it (not only an exit status)."""
    if data.error is not None:
        return data.error.summary(), True
    return (f"signal {data.signal}", False) if data.signal is not None else (f"exit code {data.exit_code}", False)


def note_exit(job: Job, data: Any, ts: int) -> None:
    """Count `data` (any signal's payload; only a failed process exit counts) in the job's open incident."""
    incident = job.incident
    if incident is None or not isinstance(data, kinds.ProcessExited) or not failed(data):
        return
    error, said = way(data)
    early = job.step_ts is None  # no step since the job's processes (re)started
    generation = data.attempt
    entries = list(incident.exits)
    same = [e for e in entries if e.generation == generation]
    if len(same) >= MAX_WAYS and not any(e.error == error for e in same):
        error, said = OTHER, False
    for index, entry in enumerate(entries):
        if entry.generation == generation and entry.error == error:
            entries[index] = FailedExits(generation, error, entry.ranks + 1, said and entry.said,
                                         early and entry.early, entry.first_ns)
            break
    else:
        entries.append(FailedExits(generation, error, 1, said, early, ts))
    kept = sorted({e.generation for e in entries})[-2:]  # the last two generations that failed
    incident.exits = tuple(sorted((e for e in entries if e.generation in kept), key=lambda e: (e.generation,
                                                                                               e.first_ns)))

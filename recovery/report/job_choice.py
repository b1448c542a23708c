"""Which job of a log the what-if replays: the simulator runs one job, and a log may hold several (a job that ran
on the nodes before it, jobs alongside it). Unless told (`--job`), it takes the one a postmortem of the log is
about: the job a per-job export was written for, else the one with the most incidents (of those with as many, the
last submitted: a postmortem is of the latest trouble), else, where no job had an incident, the first submitted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from recovery.log import ExportHeader
from recovery.report.source import RawDict


@dataclass(frozen=True)
class JobChoice:
    """The job chosen, why, and the log's jobs with their incidents."""

    job: str | None
    """None: the log holds no job.submitted"""
    why: str
    incidents: dict[str, int] = field(default_factory=dict)
    """every job the log submitted, in the order of their submission -> its incidents"""

    @property
    def others(self) -> list[str]:
        return [job for job in self.incidents if job != self.job]


def choose_job(records: Iterable[RawDict], given: str | None = None, exported: str | None = None) -> JobChoice:
    """The job to replay of `records`: `given` if given, else the job the export's header names (`exported`), else
    the job of the log's incidents (see the module)."""
    incidents: dict[str, set[str]] = {}
    for record in records:
        envelope = record["envelope"]
        if envelope.get("type") == "job.submitted" and isinstance(envelope.get("job"), str):
            incidents.setdefault(envelope["job"], set())
        elif envelope.get("type") == "decision":
            data = envelope.get("data") or {}
            if data.get("job") in incidents and isinstance(data.get("incident"), str):
                incidents[data["job"]].add(data["incident"])
    counts = {job: len(ids) for job, ids in incidents.items()}
    if given is not None:
        return JobChoice(given, "as asked (--job)", counts)
    if exported is not None:
        return JobChoice(exported, "the export is of this job (its header names it)", counts)
    if not counts:
        return JobChoice(None, "", counts)
    if len(counts) == 1:
        [job] = counts
        return JobChoice(job, "the log's only job", counts)
    most = max(counts.values())
    if not most:
        return JobChoice(next(iter(counts)), f"no job of the log's {len(counts)} had an incident: the first "
                                             f"submitted", counts)
    tied = [job for job, n in counts.items() if n == most]
    why = f"{most} incident(s), the most of the log's {len(counts)} jobs"
    if len(tied) > 1:
        why += f" (the last submitted of the {len(tied)} with as many)"
    return JobChoice(tied[-1], why, counts)


def exported_job(path: str | os.PathLike[str]) -> str | None:
    """The job a per-job export's header names (`recovery-replay export --job`); None for a whole log."""
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                header = ExportHeader.from_line(line)
                return None if header is None else header.job
    return None

"""JSONL exports of a log: the per-job export header and the filters that decide what an export keeps.

A whole log, or a slice of one, is written as it is; a per-job export (`recovery-replay export --job`) keeps what a
replay of that job's decisions needs, and starts with an `ExportHeader` saying so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from events import RawRecord, Record, encode_record
from events.outputs import Rejection
from events.subjects import PREFIX, is_output, unpartitioned
from recovery.log.base import EventLog

EXPORT_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ExportHeader:
    """The first line of a per-job JSONL export: `{"export": {...}}`, saying what the filters left out, so that
    `recovery-replay verify` knows what it can check exactly. A whole log, or a slice of one, has no header.

    `inputs` is "all" when every input record from `start_seq` (and `since_ns`) on is kept and only other jobs'
    outputs are left out (the `recovery-replay export --job` filter: a replay re-derives `job`'s decisions
    exactly), or "job" when only `job`'s own records are kept (the log API's narrow filter)."""

    job: str | None = None
    inputs: str = "all"
    since_ns: int | None = None
    start_seq: int = 1
    format: int = EXPORT_FORMAT

    def encode(self) -> bytes:
        return orjson.dumps({"export": asdict(self)}, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_line(cls, line: bytes) -> ExportHeader | None:
        """The header a line holds, None if the line is a record (or anything else: the record reader judges
        it), ValueError for a header this version cannot read."""
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or "seq" in obj or not isinstance(obj.get("export"), dict):
            return None
        fields = obj["export"]
        version = fields.get("format")
        if not isinstance(version, int) or version > EXPORT_FORMAT or version < 1:
            raise ValueError(f"export header of format {version!r}: this version reads format {EXPORT_FORMAT} "
                             f"(written by a newer recovery?)")
        job, inputs = fields.get("job"), fields.get("inputs", "all")
        since, start = fields.get("since_ns"), fields.get("start_seq", 1)
        if (not (job is None or isinstance(job, str)) or inputs not in ("all", "job")
                or not (since is None or isinstance(since, int)) or not isinstance(start, int)):
            raise ValueError(f"export header is damaged: {orjson.dumps(fields).decode()}")
        return cls(job=job, inputs=inputs, since_ns=since, start_seq=start, format=version)

    @classmethod
    def for_filters(cls, job: str | None, since_ns: int | None, start_seq: int,
                    replayable: bool) -> ExportHeader | None:
        """The header an export with these filters gets: only a per-job export has one (it names the job whose
        outputs it holds). A cut by time or sequence alone is a plain slice of the log, which a reader sees from
        its first sequence."""
        if job is None:
            return None
        return cls(job=job, inputs="all" if replayable else "job", since_ns=since_ns, start_seq=max(start_seq, 1))




def subject_job(subject: str) -> str | None:
    """The job a decision subject (`recovery.dec.<job>`) or job-event subject (`recovery.ev.job.<job>.<kind>`)
    names, else None; a partitioned log's job event (`recovery.p.<k>.ev.job...`) names its job as well."""
    tokens = unpartitioned(subject).split(".")
    if len(tokens) >= 3 and tokens[0] == PREFIX and tokens[1] == "dec":
        return tokens[2]
    if len(tokens) >= 4 and tokens[0] == PREFIX and tokens[1] == "ev" and tokens[2] == "job":
        return tokens[3]
    return None


def record_jobs(record: Record | RawRecord) -> set[str]:
    """The jobs a record belongs to: its envelope's job, and the job named by a decision subject
    (`recovery.dec.<job>`) or a job-event subject (`recovery.ev.job.<job>.<kind>`), so that a bad input
    on a job's subject, which has no decoded envelope, still belongs to that job."""
    jobs: set[str] = set()
    if isinstance(record, Record) and record.envelope.job:
        jobs.add(record.envelope.job)
    named = subject_job(record.subject)
    if named is not None:
        jobs.add(named)
    return jobs


def rejection_jobs(rejection: Rejection) -> set[str]:
    """The jobs a rejection concerns: the rejected envelope's job and the job its subject names. Empty for a
    node event's or an unattributable input's: such a rejection concerns every job (a per-job export keeps it)."""
    jobs = {rejection.job} if rejection.job else set()
    named = subject_job(rejection.subject)
    if named is not None:
        jobs.add(named)
    return jobs


def record_matches(record: Record | RawRecord, job: str | None = None, since_ns: int | None = None) -> bool:
    """The narrow export filters: `job` is one of the record's jobs, and the log time is at or after `since_ns`.
    A log narrowed to one job's records cannot be replayed exactly (the engine's decisions for a job depend on
    node events and other jobs): `replay_matches` is the filter for that."""
    if since_ns is not None and record.ts < since_ns:
        return False
    return job is None or job in record_jobs(record)


def replay_matches(record: Record | RawRecord, job: str | None = None, since_ns: int | None = None) -> bool:
    """The `recovery-replay export` filter: log time at or after `since_ns`, and for `job`, every input record
    (any job's or node's, and bad input: the engine's decisions for `job` depend on the whole cluster, such as
    a spare another job took), `job`'s decisions, every job's `job.accepted` decision (the policies each job
    ran with, so that verify can tell a changed policy of a job sharing the cluster from a bug), and the dead
    letters that concern `job` or no job. Only the other jobs' other outputs are left out."""
    if since_ns is not None and record.ts < since_ns:
        return False
    if job is None or not is_output(record.subject):
        return True
    if isinstance(record, Record):
        envelope = record.envelope
        if envelope.type == "rejection" and record.subject.startswith(f"{PREFIX}.dlq."):
            jobs = rejection_jobs(envelope.data)
            return not jobs or job in jobs
        if envelope.type == "decision" and envelope.data.kind == "job.accepted":
            return True
    jobs = record_jobs(record)
    # An undecodable record on a dead-letter subject names no job: kept, like a rejection of no job.
    return job in jobs or (not jobs and record.subject.startswith(f"{PREFIX}.dlq."))


def export_filter(job: str | None, since_ns: int | None, replayable: bool
                  ) -> Callable[[Record | RawRecord], bool]:
    """The filter of an export: `replay_matches` for a replayable one (what `recovery-replay export` writes),
    else the narrow `record_matches`."""
    match = replay_matches if replayable else record_matches
    return lambda record: match(record, job, since_ns)


async def export_log(
    log: EventLog, path: str | os.PathLike[str], start_seq: int = 1, job: str | None = None,
    since_ns: int | None = None, *, replayable: bool = False,
) -> int:
    """Write the records of `log` from `start_seq` that match the filters as a JSONL export; returns how
    many. A per-job export starts with its `ExportHeader`. `replayable` keeps every input record for a `job`
    export (see `replay_matches`); without it only the job's own records are kept. The file appears complete
    or not at all (written beside it, then renamed)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    count = 0
    header = ExportHeader.for_filters(job, since_ns, start_seq, replayable)
    keep = export_filter(job, since_ns, replayable)
    try:
        with tmp.open("wb") as fh:
            if header is not None:
                fh.write(header.encode() + b"\n")
            async for record in log.read(start_seq):
                if keep(record):
                    fh.write(encode_record(record) + b"\n")
                    count += 1
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return count

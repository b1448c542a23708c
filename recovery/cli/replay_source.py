"""What `recovery-replay` reads: a JSONL export or the live JetStream stream, partitioned or not.

A log of one partition is replayed through one engine. A partitioned log (P > 1 active partitions: job events stored
under `recovery.p.<k>.ev.job...`, fence claims under `recovery.fence...`) is replayed partition by partition, each
through an engine of its own fed what its daemon read (`recovery.log.partitions.partition_located`), as the daemons
decided. The commands that read the log whole (timeline, report, diff, whatif) see each job event on the subject it
was published on (`events.subjects.unpartitioned`): a partitioned log reads as one log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

from events import subjects
from events.envelope import RawRecord, Record
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log import ExportHeader, iter_numbered, read_header
from recovery.log.datadir import served
from recovery.log.file import overruns_in_file
from recovery.log.partitions import partition_located, partitions_of
from recovery.log.verify import Located, LogReplay, replay_log
from recovery.report import source as report_source

PEEK = 64
"""records read to tell a partitioned log (its first are its partitions' fence claims and job events)"""
PARTITIONED = (f"{subjects.PARTITIONED_EVENTS}.", f"{subjects.FENCES}.")


def records(source: str | argparse.Namespace) -> Iterator[Record | RawRecord]:
    """The records of a JSONL file, or of the JetStream stream when the arguments carry `--nats`; a partitioned
    log's job events on the subjects they were published on."""
    for _, record in located(source)[1]:
        if record.subject.startswith(PARTITIONED[0]):
            record = record.model_copy(update={"subject": subjects.unpartitioned(record.subject)})
        yield record


def located(source: str | argparse.Namespace) -> tuple[ExportHeader | None, Iterator[Located]]:
    """The export header (if the file has one) and the records with where each is: `LOG:<line>` or `seq <n>`."""
    if isinstance(source, str):
        path = source
    elif getattr(source, "nats", None):
        if source.log:
            raise ValueError("give either a LOG file or --nats, not both")
        read = asyncio.run(read_nats(source.nats, source.stream))
        return None, ((f"seq {record.seq}", record) for record in read)
    elif not source.log:
        raise ValueError("give a LOG file or --nats URL")
    else:
        path = source.log
    return read_header(path), ((f"{path}:{number}", record) for number, record in iter_numbered(path))


async def connect_log(url: str, stream: str) -> Any:
    """A read-only view of the stream: it is neither created nor reconfigured (that is the daemon's job)."""
    # Imported here for start-up time: nats-py takes a tenth of a second to import, and only --nats needs it.
    import nats
    import nats.errors
    import nats.js.errors

    from recovery.log.jetstream import JetStreamLog

    try:
        # a cluster's servers, comma-separated: whichever answers
        nc = await nats.connect(url.split(","), connect_timeout=3, max_reconnect_attempts=3, name="recovery-replay")
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise OSError(f"cannot connect to {url}: {exc!r}") from None
    js = nc.jetstream(timeout=10)
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        await nc.close()
        raise OSError(f"no stream {stream!r} on {url}") from None
    return JetStreamLog(nc, js, stream, owns_connection=True)


async def read_nats(url: str, stream: str) -> list[Record | RawRecord]:
    log = await connect_log(url, stream)
    try:
        return [record async for record in log.read()]
    finally:
        await log.close()


def open_data_dirs(args: argparse.Namespace, held: contextlib.ExitStack) -> None:
    """A data directory given where a log is expected (a `recovery-run --standalone` run's, or a daemon's): the
    commands that read JetStream read it through a server started on a copy of its store (`recovery.log.datadir`);
    those that read exports (whatif, diff) read an export of it. What is started is stopped when `held` closes."""
    stream = getattr(args, "stream", "RECOVERY")
    if args.command in ("whatif", "diff"):
        if args.command == "diff":
            args.shown = (args.a, args.b)
        for name in ("log",) if args.command == "whatif" else ("a", "b"):
            if Path(getattr(args, name)).is_dir():
                setattr(args, name, _exported(Path(getattr(args, name)), stream, held))
        return
    if getattr(args, "log", None) and Path(args.log).is_dir():
        if args.nats:
            raise ValueError("give either a LOG file (or data directory) or --nats, not both")
        args.nats, args.log = held.enter_context(served(Path(args.log), stream)), None


def _exported(directory: Path, stream: str, held: contextlib.ExitStack) -> str:
    """The whole log of a data directory as a JSONL export in a scratch directory `held` removes; the server that
    read it is stopped once it is written."""
    scratch = held.enter_context(tempfile.TemporaryDirectory(prefix="recovery-replay-"))
    path = str(Path(scratch) / f"{directory.name or 'log'}.jsonl")
    with served(directory, stream) as url:
        asyncio.run(_export_all(url, stream, path))
    return path


async def _export_all(url: str, stream: str, path: str) -> None:
    log = await connect_log(url, stream)
    try:
        await log.export(path)
    finally:
        await log.close()


def report_records(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The records a report reads, one at a time: from the file, or streamed from JetStream (`recovery.report.source`
    gives a partitioned log's job events their published subjects)."""
    if args.nats:
        if args.log:
            raise ValueError("give either a LOG file or --nats, not both")
        return report_source.iter_nats(args.nats, args.stream, connect_log)
    if not args.log:
        raise ValueError("give a LOG file or --nats URL")
    return report_source.iter_file(args.log)


def replay_args(args: argparse.Namespace, job: str | None = None,
                source: tuple[ExportHeader | None, Iterator[Located]] | None = None,
                engine: Engine | None = None) -> LogReplay:
    """Replay the log the arguments name (or `source`), for the job a per-job export holds (or `job`)."""
    header, where = located(args) if source is None else source
    if header is not None and header.job is not None:
        if job is not None and job != header.job:
            raise ValueError(f"this export holds only job {header.job}'s outputs, not job {job}'s")
        job = header.job
    path = None if getattr(args, "nats", None) else args.log  # a data directory was served as --nats by now
    overruns = overruns_in_file(path) if source is None and path else None  # the file streams through the replay
    return replay_log(where, engine, job=job, header=header, overruns=overruns)


@dataclass(frozen=True, slots=True)
class PartitionReplay:
    """One partition's replay (`partition` None: the log of one partition), and how many inputs the whole log
    holds (each partition reads every node event: their inputs do not add up to the log's)."""

    partition: Partition | None
    replay: LogReplay
    log_inputs: int


def partition_replays(args: argparse.Namespace, job: str | None, every: bool = False) -> list[PartitionReplay]:
    """The replay of the log the arguments name, or of a partitioned log each partition's (only the partition of
    `job`, or of the job a per-job export holds, unless `every`), each through an engine of its partition: one
    replay of partition None for a log of one partition."""
    header, where = located(args)
    first = list(islice(where, PEEK))
    if args.partitions is None and not any(r.subject.startswith(PARTITIONED) for _, r in first):
        result = replay_args(args, job, (header, chain(first, where)))
        return [PartitionReplay(None, result, result.inputs)]
    everything = [*first, *where]  # a partitioned log is read once per partition
    count = args.partitions or partitions_of(r for _, r in everything) or 1
    if count == 1:
        result = replay_args(args, job, (header, iter(everything)))
        return [PartitionReplay(None, result, result.inputs)]
    scope = job if job is not None else None if header is None else header.job
    indices = range(count) if scope is None or every else [subjects.partition_of(scope, count)]
    whole = _sequence(everything)
    out = []
    for part in (Partition(k, count) for k in indices):
        result = replay_args(args, job, (header, partition_located(everything, part)), Engine(part))
        # The other partitions' records and the fence claims are absent from this partition's sequence: whether the
        # replay can be exact is the whole log's to say.
        result.first_seq, result.missing, result.first_gap, result.backwards = whole[:4]
        out.append(PartitionReplay(part, result, whole[4]))
    return out


def log_partitions(path: str, given: int | None = None) -> int | None:
    """How many partitions the export at `path` was written with (`given` if given): None for a log of one."""
    if given is not None:
        return given
    where = iter_numbered(path)
    first = [record for _, record in islice(where, PEEK)]
    if not any(r.subject.startswith(PARTITIONED) for r in first):
        return None
    return partitions_of(chain(first, (record for _, record in where)))


def _sequence(everything: Sequence[Located]) -> tuple[int | None, int, int | None, int | None, int]:
    """The whole log's first sequence, records missing from it, the first gap, the first step back (as
    `recovery.log.verify.replay_log` counts them over what it reads), and its input records (fence claims left
    out: no engine reads them)."""
    first = gap = back = previous = None
    missing = inputs = 0
    for _, record in everything:
        seq = record.seq
        if previous is None:
            first = seq
        elif seq > previous + 1:
            missing += seq - previous - 1
            gap = previous + 1 if gap is None else gap
        elif seq <= previous and back is None:
            back = seq
        previous = seq
        inputs += not (subjects.is_output(record.subject) or record.subject.startswith(PARTITIONED[1]))
    return first, missing, gap, back, inputs

"""A partition's log out of a partitioned one, as that partition's engine read it: for an offline replay.

With P > 1 partitions the log stream stores a job event under its partition's subjects (`recovery.p.<k>.ev.job...`,
`events.subjects.partition_transform`), and every partition reads every node event. The records of partition `k`
are its jobs' events (on the subject they were published on, as the daemon applies them), every node event, the
decisions about its jobs and the dead letters of its inputs; the fence claims are left out. Partition
`STRAYS_PARTITION` also has the stray inputs (`events.subjects.stray_input`), which it alone reads. Replayed through an
engine of that partition (`replay(partition_log(records, p), Engine(p))`), they give the partition's decisions and
its state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from events import subjects
from events.envelope import RawRecord, Record
from recovery.core.partition import Partition

_JOB = f"{subjects.PREFIX}.ev.job."
_NODE = f"{subjects.PREFIX}.ev.node."
_DECISION = f"{subjects.PREFIX}.dec."
_DEAD_LETTER = f"{subjects.PREFIX}.dlq."


def _token(subject: str, prefix: str) -> str:
    return subject[len(prefix):].split(".", 1)[0]


def partition_log(records: Iterable[Record | RawRecord], partition: Partition) -> list[Record | RawRecord]:
    """The records of `partition`, in log order, each job event on its published subject."""
    return [record for _, record in partition_located(((None, r) for r in records), partition)]


Where = TypeVar("Where")


def partition_located(located: Iterable[tuple[Where, Record | RawRecord]], partition: Partition
                      ) -> Iterator[tuple[Where, Record | RawRecord]]:
    """`partition_log` over records that carry where each is (a file's line, a stream's sequence)."""
    mine = f"{subjects.PARTITIONED_EVENTS}.{partition.index}."
    for where, record in located:
        subject = record.subject
        if subject.startswith(mine):
            yield where, record.model_copy(update={"subject": subjects.unpartitioned(subject)})
        elif subject.startswith(_NODE):
            yield where, record
        elif subjects.stray_input(subject):
            if partition.index == subjects.STRAYS_PARTITION:  # the one partition that reads them
                yield where, record
        elif subject.startswith(_DECISION):
            if partition.owns_job(_token(subject, _DECISION)):
                yield where, record
        elif subject.startswith(_DEAD_LETTER) and _rejects_mine(record, partition):
            yield where, record


def partitions_of(records: Iterable[Record | RawRecord], limit: int = 1024) -> int | None:
    """How many partitions a log was written with, read from the log itself: the smallest count under which every
    job event's stored partition is `partition_of` its job (None: not a partitioned log). A job's partition under
    the wrong count disagrees for some job once the log holds a few: give the count where it holds one or two."""
    seen: dict[str, int] = {}
    prefix = f"{subjects.PARTITIONED_EVENTS}."
    for record in records:
        subject = record.subject
        if subject.startswith(prefix):
            index, _, rest = subject[len(prefix):].partition(".")
            if rest.startswith("ev.job.") and index.isdigit():
                seen.setdefault(rest[len("ev.job."):].split(".", 1)[0], int(index))
    if not seen:
        return None
    for count in range(max(seen.values()) + 1, limit + 1):
        if all(subjects.partition_of(job, count) == index for job, index in seen.items()):
            return count
    raise ValueError(f"no partition count up to {limit} puts this log's jobs where it stored them")


def _rejects_mine(record: Record | RawRecord, partition: Partition) -> bool:
    """Is this dead letter one of the partition's: about an input of one of its jobs, or a node event (every
    partition reads those, and stores the same dead letter under the same id)?"""
    if not isinstance(record, Record):
        return False
    rejected = getattr(record.envelope.data, "subject", "")
    if isinstance(rejected, str) and subjects.stray_input(rejected):
        return partition.index == subjects.STRAYS_PARTITION
    if isinstance(rejected, str) and rejected.startswith(_JOB):
        return partition.owns_job(_token(rejected, _JOB))
    return isinstance(rejected, str) and rejected.startswith(_NODE)

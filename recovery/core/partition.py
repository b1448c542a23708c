"""A partition of the jobs, as the engine of one partition sees it: which spare nodes are its own.

With P > 1 partitions every partition's engine reads every node event (a device fault must reach each job on the
node, whatever its partition), so every engine hears of every spare node. A spare is granted by exactly one of
them: the partition that owns it, `partition_of(node, P)`, the same hash JetStream's `partition()` gives a subject
token. The ownership is a pure function of the node's name and the partition, so a replay of the partition's log
grants the same spares."""

from __future__ import annotations

from dataclasses import dataclass

from events.subjects import partition_of


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition `index` of `count`."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"partition {self.index} is not one of 0..{self.count - 1}")

    def owns_spare(self, node: str) -> bool:
        return partition_of(node, self.count) == self.index

    def owns_job(self, job: str) -> bool:
        return partition_of(job, self.count) == self.index

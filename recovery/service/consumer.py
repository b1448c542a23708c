"""What the daemon reads from JetStream, through the one pull reader (`recovery.log.pull`): its durable input
consumer (`InputReader`), in stream order and in batches, acknowledged once the effects are stored, and the ids of
what is already stored (`scan_ids`), so that a restart does not publish an effect twice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

import anyio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import subjects
from recovery.log import MSG_ID
from recovery.log.pull import Delivery, PullReader, ReaderLost

INPUTS = subjects.EVENTS
ORPHAN_S = 60.0
"""an input consumer nobody reads is removed this long after (a daemon gone; one made ahead while a takeover reads
its backlog is not read for that long)"""


class InputReader:
    """The daemon's pull consumer over the input subjects.

    It is (re)created at a given stream sequence: at start (the sequence after the restored snapshot) and
    whenever order cannot be guaranteed any more (`ReaderLost`: a gap, a redelivery of a record not yet applied,
    a reconnect, a stall, the consumer deleted or gone with its server). Inputs are acknowledged (AckPolicy.ALL)
    only after their effects, so that what was not finished is delivered again.

    The consumer is ephemeral, a single replica in memory, whatever the log's replicas: where it stands is the
    engine's (`last_seq`, in every snapshot), and it is made again at every start, so nothing in it needs to outlive
    its server. A replicated durable one made each acknowledgement a proposal of its own group, several hundred a
    second for a dozen partitions, and each takeover an election. Each one made is named `<name>-<unique>`: when its
    server is lost, the next is made on one that answers at once, and the lost one goes `ORPHAN_S` after it was
    last read."""

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, name: str, batch: int,
                 ack_wait_s: float, pull_expires_s: float = 2.0, filter_subject: str | None = INPUTS) -> None:
        # `filter_subject` None: the whole log, for a partition, which passes over what is not its own
        # (`subjects.partition_reads`): its inputs are under two filters, which JetStream serves slowly.
        config = ConsumerConfig(
            name=name, ack_policy=AckPolicy.ALL, ack_wait=ack_wait_s, max_deliver=-1,
            filter_subject=filter_subject, max_ack_pending=max(4 * batch, 4096), num_replicas=1,
            mem_storage=True, max_waiting=512, inactive_threshold=ORPHAN_S,
        )
        self.pull = PullReader(nc, js, stream, config, batch=batch, pull_expires_s=pull_expires_s)

    @property
    def lag(self) -> int:
        """Inputs still pending after the last delivery."""
        return self.pull.lag

    @property
    def caught_up(self) -> bool:
        """The reader reached the end of the input at least once: what comes now is live."""
        return self.pull.caught_up

    async def open(self, start_seq: int, *, pull: bool = True) -> int:
        """(Re)create the consumer at `start_seq`; the number of inputs pending. `pull` False: made ahead (while a
        backlog before `start_seq` is read), read from `begin`."""
        return await self.pull.open(start_seq, pull=pull)

    async def begin(self) -> None:
        await self.pull.begin()

    async def close(self) -> None:
        await self.pull.close()

    async def next_batch(self, wait_s: float, last_applied: int) -> list[Delivery]:
        """Up to a batch of inputs after `last_applied`, in stream order (none if nothing arrived within
        `wait_s`). A redelivery of an input already applied (its ack was lost or late) is skipped; one of an input
        not yet applied means the consumer's order is no longer ours: ReaderLost."""
        out: list[Delivery] = []
        for d in await self.pull.next_batch(wait_s):
            if d.seq <= last_applied or (out and d.seq <= out[-1].seq):
                continue
            if d.delivered > 1:
                raise ReaderLost(f"redelivery of {d.seq}, ahead of the last applied {last_applied}")
            out.append(d)
        return out

    async def ack(self, delivery: Delivery) -> None:
        """Acknowledge this delivery and every one before it (AckPolicy.ALL)."""
        await self.pull.ack(delivery)


async def scan_ids(nc: Client, js: JetStreamContext, stream: str, filters: list[str | list[str] | None], start_seq: int,
                   start_time: datetime | None, batch: int = 4096, idle_s: float = 1.0,
                   keep: Callable[[str], bool] | None = None) -> set[str]:
    """The `Nats-Msg-Id` of every message on `filters` in `stream` from `start_seq` (or `start_time`) to the
    stream's last sequence now, read headers-only through an ephemeral consumer per filter, all at once (JetStream
    serves a consumer of several filters far slower; a takeover waits on this scan). A filter None reads every
    subject, and `keep` says which of them count. A pull lost on a busy server is found within `2 * idle_s + 1` s
    (ReaderLost), and the caller scans again."""
    end = int((await js.stream_info(stream)).state.last_seq)

    async def scan(subject: str | list[str] | None) -> set[str]:
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, headers_only=True, mem_storage=True, num_replicas=1,
                                inactive_threshold=30.0)
        if isinstance(subject, list):
            config.filter_subjects = subject
        else:
            config.filter_subject = subject
        start: int | None = max(start_seq, 1)
        if start_time is not None:
            config.deliver_policy, config.opt_start_time, start = DeliverPolicy.BY_START_TIME, start_time, None
        reader = PullReader(nc, js, stream, config, batch=batch, pull_expires_s=idle_s, end_seq=end)
        ids: set[str] = set()
        try:
            await reader.open(start)
            while not reader.done:
                for d in await reader.next_batch(reader.stall_s):
                    msg_id = (d.headers or {}).get(MSG_ID)
                    if msg_id and (keep is None or keep(d.subject)):
                        ids.add(msg_id)
        finally:
            await reader.close()
        return ids

    return set().union(*await asyncio.gather(*(scan(subject) for subject in filters)))


async def read_backlog(nc: Client, js: JetStreamContext, stream: str, filters: list[str], start_seq: int,
                       end_seq: int, batch: int) -> AsyncIterator[list[Delivery]]:
    """Every message on `filters` in `stream` from `start_seq` to `end_seq`, in stream order, in batches.

    A partition's inputs are under two filters (its jobs' events and every node's), and JetStream reads a consumer
    of several filters far slower than one of a single filter: on three servers at 3 replicas, 1,800-2,300 messages a
    second against 26,000-31,000 for either filter alone (70,000 messages, 12 partitions, 2,500 nodes;
    `docs/platform.md`). Its own consumer reads the whole log (every partition's job events); a backlog (a partition
    taken over, a restart) is read through one ephemeral consumer per filter instead, each in stream order, merged by
    stream sequence: the order the partition's own consumer gives. ReaderLost as `PullReader` raises it."""
    # One pull outstanding each: the readers share one connection, and what the server holds for it (`pull_max_bytes`).
    readers = [PullReader(nc, js, stream, ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
                                                         filter_subject=subject),
                          batch=batch, end_seq=end_seq, pulls=1) for subject in filters]
    queues: list[deque[Delivery]] = [deque() for _ in readers]
    try:
        await asyncio.gather(*(reader.open(start_seq) for reader in readers))  # at once: each is a server's round trip
        while True:
            for reader, queue in zip(readers, queues, strict=True):
                while not queue and not reader.done:  # every reader with more to come shows its next message
                    queue.extend(d for d in await reader.next_batch(reader.stall_s) if d.seq <= end_seq)
            if not any(queues):
                return
            out: list[Delivery] = []
            while len(out) < batch:
                index = min((k for k, q in enumerate(queues) if q), key=lambda k: queues[k][0].seq)
                out.append(queues[index].popleft())
                if not queues[index] and not readers[index].done:
                    break  # its next message may come before the others' heads: fetch it first
                if not any(queues):
                    break
            yield out
    finally:
        for reader in readers:
            await reader.close()


@dataclass
class Backlog:
    """What `apply_backlog` did: the partition's consumer had `pending` messages once made; `read` messages were
    applied through `apply` in `batches` calls, which took `apply_s` of the time (the rest is the reading)."""

    pending: int
    read: int
    apply_s: float
    batches: int


class BacklogAhead:
    """A partition's backlog read ahead: from `start` (the restored snapshot's next input) to the log's last sequence
    when it began (`end`), through `read_backlog`, a few batches ahead of whoever applies them (`batches`). Begun as
    a takeover reads the snapshot's manifest, it fetches while the snapshot is fetched and opened, and then while
    each batch is applied. `end` is None for a backlog shorter than `at` records: the partition's consumer reads that
    one. `cancel` it when it is not used."""

    def __init__(self, nc: Client, js: JetStreamContext, stream: str, filters: list[str], start: int, batch: int,
                 at: int, depth: int = 4) -> None:
        self.start = start
        self.end: int | None = None
        self.error: BaseException | None = None
        self._measured = asyncio.Event()
        self._send, self._receive = anyio.create_memory_object_stream[list[Delivery]](depth)
        self._task = asyncio.ensure_future(self._read(nc, js, stream, filters, batch, at))

    async def _read(self, nc: Client, js: JetStreamContext, stream: str, filters: list[str], batch: int,
                    at: int) -> None:
        async with self._send:
            try:
                end = int((await js.stream_info(stream)).state.last_seq)
                self.end = end if end - self.start + 1 >= at else None
                self._measured.set()
                if self.end is not None:
                    async with contextlib.aclosing(read_backlog(nc, js, stream, filters, self.start, end,
                                                                batch)) as parts:
                        async for part in parts:
                            await self._send.send(part)
            except Exception as exc:  # the applier's to raise, after what was read before it
                self.error = exc
            finally:
                self._measured.set()

    async def measured(self) -> int | None:
        """The backlog's last sequence once known (None: too short to read ahead); what the read ahead raised
        before it knew."""
        await self._measured.wait()
        if self.end is None and self.error is not None:
            raise self.error
        return self.end

    async def batches(self) -> AsyncIterator[list[Delivery]]:
        """The backlog's batches in stream order; what the read ahead raised, once the batches before it are given."""
        async with self._receive:
            async for part in self._receive:
                yield part
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()


async def apply_backlog(reader: InputReader, ahead: BacklogAhead, apply: Callable[[list[Delivery]], Awaitable[None]],
                        stopping: Callable[[], bool]) -> Backlog | None:
    """`apply` each batch of the backlog `ahead` reads (measured: its `end` known) while `reader`'s consumer is made
    after its end (a consumer of the whole log on three servers takes a takeover's while), which is read from now
    on; None if `stopping` said so between two batches."""
    assert ahead.end is not None
    start_seq, end_seq = ahead.start, ahead.end
    made = asyncio.ensure_future(reader.open(end_seq + 1, pull=False))  # in a task: its failure is the caller's
    read, apply_s, applied = 0, 0.0, 0
    try:
        reader.pull.lag = end_seq - start_seq + 1  # what `/status` says while the backlog is read
        async with contextlib.aclosing(ahead.batches()) as batches:
            async for part in batches:
                reader.pull.lag = end_seq - part[-1].seq
                t0 = time.monotonic()
                await apply(part)
                read, apply_s, applied = read + len(part), apply_s + time.monotonic() - t0, applied + 1
                if stopping():
                    return None
        opened = await made
    finally:
        ahead.cancel()
        if not made.cancel() and not made.cancelled():
            made.exception()  # retrieved: raised above already, or the backlog's own failure is the caller's
    await reader.begin()
    return Backlog(opened, read, apply_s, applied)

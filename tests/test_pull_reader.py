"""The one JetStream pull reader (`recovery.log.pull`) against a real nats-server: ranges, order, loss, acks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import nats
import orjson
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from recovery.log.jetstream import TRANSIENT, ensure_stream, stream_config
from recovery.log.pull import DELIVERY_OVERHEAD, Delivery, PullReader, ReaderLost, parse_reply
from recovery.testing.nats import NatsServer

STREAM = "PULL"
SUBJECT = "pull.test"


@dataclass
class Js:
    nc: Client
    js: JetStreamContext

    async def publish(self, count: int) -> None:
        for i in range(count):
            await self.js.publish(SUBJECT, orjson.dumps({"i": i}))


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Js]:
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    context = nc.jetstream()
    await ensure_stream(context, stream_config(STREAM, [f"{SUBJECT}.>", SUBJECT]))
    yield Js(nc, context)
    await nc.close()


def no_ack() -> ConsumerConfig:
    return ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True)


async def read_until_done(reader: PullReader) -> list[Delivery]:
    got: list[Delivery] = []
    with anyio.fail_after(10):
        while not reader.done:
            got += await reader.next_batch(reader.stall_s)
    return got


async def read_count(reader: PullReader, count: int) -> list[Delivery]:
    got: list[Delivery] = []
    with anyio.fail_after(10):
        while len(got) < count:
            got += await reader.next_batch(5)
    return got


def test_reply_subjects_of_both_formats_parse() -> None:
    v1 = "$JS.ACK.RECOVERY.daemon.2.17.5.1700000000123456789.40"
    v2 = "$JS.ACK.hub.ACCOUNT.RECOVERY.daemon.2.17.5.1700000000123456789.40.token"
    assert parse_reply(v1) == parse_reply(v2) == (2, 17, 5, 1700000000123456789, 40)
    with pytest.raises(ValueError):
        parse_reply("_INBOX.abc")


async def test_an_end_sequence_stops_the_reader(js: Js) -> None:
    await js.publish(10)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=2, end_seq=6)
    try:
        assert await reader.open(3) == 8  # pending counts the whole stream after the start, not the range
        got = await read_until_done(reader)
        assert [d.seq for d in got] == [3, 4, 5, 6]
        assert [orjson.loads(d.data)["i"] for d in got] == [2, 3, 4, 5]
        assert all(d.delivered == 1 and d.subject == SUBJECT for d in got)
        assert [d.ts for d in got] == sorted(d.ts for d in got)
        assert await reader.next_batch(0.01) == []
    finally:
        await reader.close()


async def test_an_unbounded_reader_follows_new_messages_and_reports_lag(js: Js) -> None:
    await js.publish(3)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=100)
    try:
        assert await reader.open(1) == 3
        got = await read_count(reader, 3)
        assert reader.caught_up and reader.lag == 0 and not reader.done
        await js.publish(2)
        got += await read_count(reader, 2)
        assert [d.seq for d in got] == [1, 2, 3, 4, 5]
    finally:
        await reader.close()


async def test_a_pull_that_reached_no_consumer_is_asked_again_not_waited_out(js: Js) -> None:
    """A pull the server answers with 503 (no responders: on a cluster, a consumer's interest may reach the client's
    server after the consumer is made) is sent again at once; before, the reader waited for its stall (11 s here)."""
    await js.publish(3)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=100, pull_expires_s=5.0)
    real_pull, pulls = reader._pull, 0

    async def first_to_nobody() -> None:
        nonlocal pulls
        pulls += 1
        if pulls > 1:
            return await real_pull()
        subject, reader._next_subject = reader._next_subject, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.nobody"
        try:
            await real_pull()  # answered 503: no consumer of that name
        finally:
            reader._next_subject = subject

    reader._pull = first_to_nobody  # type: ignore[method-assign]
    try:
        await reader.open(1)
        got: list[Delivery] = []
        for _ in range(16):  # 8 s at most: short of the 11 s after which the old reader gave up on the pull
            got += await reader.next_batch(0.5)
            if len(got) == 3:
                break
        assert [d.seq for d in got] == [1, 2, 3] and pulls >= 2
    finally:
        await reader.close()


async def test_pulls_no_consumer_answers_for_a_stall_raise_reader_lost_not_a_loop_of_retries(js: Js) -> None:
    """A consumer gone with its server (a replica-1 consumer on a lost server, or removed without a 409) answers
    every pull 503: the reader asks again for a stall's time, then gives the consumer up (ReaderLost), to be made
    again, instead of asking forever."""
    await js.publish(2)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=10, pull_expires_s=0.5)
    try:
        await reader.open(1)
        await read_count(reader, 2)
        reader._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.gone"  # every pull from now reaches no consumer
        started = time.monotonic()
        with anyio.fail_after(30), pytest.raises(ReaderLost, match="no consumer answered"):
            while True:
                await reader.next_batch(0.5)
        assert time.monotonic() - started >= reader.stall_s  # not at the first 503: a new consumer's may be passing
    finally:
        await reader.close()


async def test_a_consumer_that_starts_over_under_its_name_raises_reader_lost_and_a_redelivery_is_passed_over(
        js: Js) -> None:
    """A replica-1 consumer lost with its server is made again from its assignment when that server comes back, and
    numbers its deliveries from 1 again: a first delivery numbered as one already read is that, not a repeat (a
    redelivery keeps its number and counts up). Passed over as repeats, they left a partition reading nothing."""
    await js.publish(3)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=10)
    try:
        await reader.open(1)
        assert [d.seq for d in await read_count(reader, 3)] == [1, 2, 3]
        name, ts = reader.name, time.time_ns()

        def delivery(delivered: int, sseq: int, cseq: int) -> Msg:
            return Msg(js.nc, subject=SUBJECT, reply=f"$JS.ACK.{STREAM}.{name}.{delivered}.{sseq}.{cseq}.{ts}.0",
                       data=b"{}")

        reader._buffer.append(delivery(2, 2, 2))  # delivered again: passed over
        assert await reader.next_batch(0.1) == []
        reader._buffer.append(delivery(1, 1, 1))  # the consumer made again, from the start
        with pytest.raises(ReaderLost, match="started over"):
            await reader.next_batch(0.1)
    finally:
        await reader.close()


async def test_a_consumer_that_answers_every_pull_empty_while_the_log_goes_on_raises_reader_lost(js: Js) -> None:
    """A replica-1 consumer made on a server that came back moments ago serves that server's copy of the stream, which
    is catching up: every pull answered, empty, for a minute. A reader of a stored range short of its end, or an
    unfiltered one the log has gone past for a stall, gives it up (ReaderLost) instead of waiting on it silently."""
    await js.publish(20)
    await js.js.add_consumer(STREAM, ConsumerConfig(durable_name="empty", ack_policy=AckPolicy.NONE,
                                                    filter_subject=f"{SUBJECT}.nothing"))
    for end_seq, what in ((20, "short of 20"), (None, "the log held 20")):
        reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=2, pull_expires_s=0.5, end_seq=end_seq)
        try:
            await reader.open(1)
            assert [d.seq for d in await reader.next_batch(5)] == [1, 2]
            reader._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.empty"  # it answers, with nothing
            got: list[int] = []
            with anyio.fail_after(30), pytest.raises(ReaderLost, match=what):
                while not reader.done:  # (what the pulls already on their way bring first)
                    got += [d.seq for d in await reader.next_batch(0.5)]
            assert got == list(range(3, 3 + len(got))) and len(got) <= 6 and not reader.done
        finally:
            await reader.close()


async def test_a_deleted_consumer_raises_reader_lost(js: Js) -> None:
    await js.publish(2)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=10)
    try:
        await reader.open(1)
        await read_count(reader, 2)
        await js.js.delete_consumer(STREAM, reader.name)  # its waiting pulls end with 409 Consumer Deleted
        with anyio.fail_after(10), pytest.raises(ReaderLost, match="consumer deleted"):
            while True:
                await reader.next_batch(5)
    finally:
        await reader.close()


async def test_a_gap_in_the_consumer_sequence_raises_reader_lost(js: Js) -> None:
    await js.publish(3)
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=1)
    try:
        await reader.open(1)  # two pulls of one message each: the first two messages
        # Another pull on the same consumer, on the same connection, so the server takes it after the reader's:
        # the third message goes elsewhere and the reader's next delivery skips a consumer sequence.
        # (Its own subscription: a delivery carries the message's subject, not the inbox a request would match.)
        elsewhere = await js.nc.subscribe(js.nc.new_inbox())
        await js.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{reader.name}", b'{"batch": 1}',
                            reply=elsewhere.subject)
        stolen = await elsewhere.next_msg(timeout=5)
        await elsewhere.unsubscribe()
        assert parse_reply(stolen.reply)[1:3] == (3, 3)
        await js.publish(1)
        got: list[Delivery] = []
        with anyio.fail_after(10), pytest.raises(ReaderLost, match="gap in the consumer sequence: 2 then 4"):
            while True:
                got += await reader.next_batch(5)
        assert [d.seq for d in got] == [1, 2]
    finally:
        await reader.close()


async def test_a_reconnect_raises_reader_lost(js: Js, nats_server: NatsServer) -> None:
    await js.publish(2)
    # Pulls that last longer than the outage: only the reconnect can end the wait, not a stall.
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=10, pull_expires_s=30)
    try:
        await reader.open(1)
        await read_count(reader, 2)
        nats_server.stop()
        nats_server.start()
        with anyio.fail_after(30), pytest.raises(ReaderLost, match="reconnected"):
            while True:
                await reader.next_batch(1)
        assert isinstance(ReaderLost(), TRANSIENT)  # every caller simply opens it again
        await js.publish(1)
        assert await reader.open(3) == 1
        assert [d.seq for d in await read_count(reader, 1)] == [3]
    finally:
        await reader.close()


async def test_a_durable_ack_all_reader_resumes_after_its_acks(js: Js) -> None:
    await js.publish(8)
    durable = ConsumerConfig(durable_name="resumes", ack_policy=AckPolicy.ALL, ack_wait=60, filter_subject=SUBJECT)
    first = PullReader(js.nc, js.js, STREAM, durable, batch=2, end_seq=5)
    try:
        await first.open()
        got = await read_until_done(first)
        assert [d.seq for d in got] == [1, 2, 3, 4, 5]
        await first.ack(got[-1])  # AckPolicy.ALL: every one before it too
        with anyio.fail_after(10):
            while (info := await js.js.consumer_info(STREAM, "resumes")).ack_floor.stream_seq < 5:
                pass  # the ack is a plain publish: ask until the server has taken it
        assert info.num_ack_pending == 0
    finally:
        await first.close()  # a durable consumer stays
    second = PullReader(js.nc, js.js, STREAM, durable, batch=2, end_seq=8)
    try:
        assert await second.open() == 3  # attached: it goes on after what was delivered and acknowledged
        assert [d.seq for d in await read_until_done(second)] == [6, 7, 8]
        assert await second.open(2) == 7  # a start sequence re-creates it there
        assert (await js.js.consumer_info(STREAM, "resumes")).ack_floor.consumer_seq == 0  # a new consumer
    finally:
        await second.close()


async def test_pulls_are_bounded_by_bytes_and_bring_a_backlog_of_large_messages_in_order(
        nats_server: NatsServer, js: Js) -> None:
    """Pulls of 1,000 messages with no byte limit ask the server for a whole backlog of large inputs at once (1 GB
    of 1 MB inputs), more than the client's inbox holds before it drops deliveries as a slow consumer. Every pull
    request now names a byte bound, and a backlog of 24 MB in 400 kB messages arrives whole and in order through
    pulls of 1 MB."""
    body = b"x" * 400_000
    for i in range(60):
        await js.js.publish(SUBJECT, orjson.dumps({"i": i}) + body)
    requests: list[dict[str, int]] = []

    async def on_request(msg: Msg) -> None:
        requests.append(orjson.loads(msg.data))

    monitor = await nats.connect(nats_server.url)
    await monitor.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.>", cb=on_request)
    await monitor.flush()
    reader = PullReader(js.nc, js.js, STREAM, no_ack(), batch=100, max_bytes=1024 * 1024,
                        pending_bytes_limit=4 * 1024 * 1024)
    try:
        await reader.open(1)
        got = await read_count(reader, 60)
        assert [orjson.loads(d.data[: d.data.index(b"}") + 1])["i"] for d in got] == list(range(60))
        await monitor.flush()
        assert requests and all(r["max_bytes"] == 1024 * 1024 + DELIVERY_OVERHEAD for r in requests)
        assert len(requests) >= 24  # 1 MB a pull: at least 24 MB / 1 MB of them
    finally:
        await reader.close()
        await monitor.close()


def test_a_byte_bound_below_the_largest_message_is_raised_to_it() -> None:
    class Connection:
        max_payload = 8 * 1024 * 1024

    reader = PullReader(Connection(), None, STREAM, no_ack(), max_bytes=1024)  # type: ignore[arg-type]
    # or a message that size could never be delivered (its subject and reply count too)
    assert reader.max_bytes == 8 * 1024 * 1024 + DELIVERY_OVERHEAD

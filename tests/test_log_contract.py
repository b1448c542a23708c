"""The event-log contract over the memory, JSONL file and JetStream logs, and JetStream-only checks."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from nats.js.api import RetentionPolicy, StorageType

from events.subjects import DEAD_LETTERS, DECISIONS, EVENTS
from recovery.log import FileLog, MemoryLog
from recovery.log.jetstream import JetStreamLog
from recovery.testing.log_contract import HEARTBEAT, EventLogContract, LogFactory, heartbeat, read_all
from recovery.testing.nats import NatsServer


class TestMemoryLog(EventLogContract):
    @pytest.fixture
    async def make_log(self) -> AsyncIterator[LogFactory]:
        async def factory() -> MemoryLog:
            return MemoryLog()

        yield factory


class TestFileLog(EventLogContract):
    persistent = True

    @pytest.fixture
    async def make_log(self, tmp_path: Path) -> AsyncIterator[LogFactory]:
        opened: list[FileLog] = []

        async def factory() -> FileLog:
            log = FileLog(tmp_path / "log.jsonl")
            opened.append(log)
            return log

        yield factory
        for log in opened:
            await log.close()


class TestJetStreamLog(EventLogContract):
    persistent = True

    @pytest.fixture
    async def make_log(self, nats_server: NatsServer) -> AsyncIterator[LogFactory]:
        opened: list[JetStreamLog] = []

        async def factory() -> JetStreamLog:
            log = await JetStreamLog.connect(nats_server.url)
            opened.append(log)
            return log

        yield factory
        for log in opened:
            await log.close()


# JetStream only ----------------------------------------------------------------------------------------


@pytest.fixture
async def js_log(nats_server: NatsServer) -> AsyncIterator[JetStreamLog]:
    log = await JetStreamLog.connect(nats_server.url)
    yield log
    await log.close()


async def test_stream_config(js_log: JetStreamLog) -> None:
    config = (await js_log.stream_info()).config
    assert config.name == "RECOVERY"
    assert config.retention == RetentionPolicy.LIMITS
    assert config.storage == StorageType.FILE
    assert config.deny_delete is True
    assert config.deny_purge is True
    assert config.duplicate_window == 600
    assert config.num_replicas == 1
    assert sorted(config.subjects or []) == sorted([EVENTS, DECISIONS, DEAD_LETTERS])


async def test_setup_is_idempotent(nats_server: NatsServer) -> None:
    first = await JetStreamLog.connect(nats_server.url)
    second = await JetStreamLog.connect(nats_server.url)
    try:
        assert (await first.append(HEARTBEAT, heartbeat(1))).seq == 1
        third = await JetStreamLog.connect(nats_server.url)
        await third.close()
        assert (await second.append(HEARTBEAT, heartbeat(2))).seq == 2
        assert [r.seq for r in await read_all(first)] == [1, 2]
        # A changed setting is applied to the existing stream, which keeps its records.
        wider = await JetStreamLog.connect(nats_server.url, duplicate_window_s=900)
        try:
            assert (await wider.stream_info()).config.duplicate_window == 900
            assert await wider.last_seq() == 2
        finally:
            await wider.close()
    finally:
        await first.close()
        await second.close()


def _rfc3339_ns(text: str) -> int:
    """'2026-01-02T03:04:05.123456789Z' -> integer nanoseconds since the epoch, exactly."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", text)
    assert match is not None, text
    seconds = int(datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp())
    return seconds * 1_000_000_000 + int((match.group(2) or "").ljust(9, "0"))


async def test_ts_is_the_exact_jetstream_timestamp(js_log: JetStreamLog) -> None:
    for i in range(1, 6):
        await js_log.append(HEARTBEAT, heartbeat(i))
    for record in await read_all(js_log):
        reply = await js_log.nc.request(f"$JS.API.STREAM.MSG.GET.{js_log.stream}",
                                        orjson.dumps({"seq": record.seq}))
        stored = orjson.loads(reply.data)["message"]
        assert record.ts == _rfc3339_ns(stored["time"])


async def test_reads_across_many_pull_batches(nats_server: NatsServer) -> None:
    log = await JetStreamLog.connect(nats_server.url, read_batch=7)
    try:
        for i in range(1, 51):
            await log.append(HEARTBEAT, heartbeat(i))
        assert [r.seq for r in await read_all(log)] == list(range(1, 51))
        assert [r.seq for r in await read_all(log, 44)] == list(range(44, 51))
    finally:
        await log.close()


async def test_survives_a_server_restart(nats_server: NatsServer) -> None:
    # A short request timeout: a publish sent into the dead connection is retried sooner.
    log = await JetStreamLog.connect(nats_server.url, request_timeout=1.0)
    try:
        for i in range(1, 4):
            await log.append(HEARTBEAT, heartbeat(i))
        before = await read_all(log)
        nats_server.stop()
        nats_server.start()
        # The client reconnects by itself; append retries until it has, and the duplicate window survived.
        dup = await log.append(HEARTBEAT, heartbeat(3))
        assert (dup.seq, dup.duplicate) == (3, True)
        assert (await log.append(HEARTBEAT, heartbeat(4))).seq == 4
        after = await read_all(log)
        assert after[:3] == before
        assert [r.seq for r in after] == [1, 2, 3, 4]
    finally:
        await log.close()


async def test_read_resumes_through_a_server_restart(nats_server: NatsServer) -> None:
    log = await JetStreamLog.connect(nats_server.url, request_timeout=1.0, read_batch=16)
    try:
        for i in range(1, 101):
            await log.append(HEARTBEAT, heartbeat(i))
        seen = []
        async for record in log.read():
            seen.append(record.seq)
            if record.seq == 10:
                # The reader's consumer lives in server memory and dies with it: reading goes on anyway.
                nats_server.stop()
                nats_server.start()
        assert seen == list(range(1, 101))
    finally:
        await log.close()

"""The one contract every event log passes: memory, JSONL file and JetStream (tests/test_log_contract.py), and
any other adapter of the `EventLog` Protocol (a pytest suite: it needs pytest and pytest-asyncio).

A subclass provides the async fixture `make_log`: a factory that opens the log under test (calling it
again opens the same log again, for the persistent ones) and closes what it opened at teardown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from events import RawRecord, Record, make_envelope
from events.envelope import EnvelopeBase
from events.subjects import dead_letter, decision, job_event, node_event
from recovery.log import MSG_ID, EventLog, iter_file

LogFactory = Callable[[], Awaitable[Any]]

HEARTBEAT = job_event("j1", "process.heartbeat")


def heartbeat(i: int, job: str = "j1") -> EnvelopeBase:
    return make_envelope("process.heartbeat", {"rank": 0, "step": i}, id=f"{job}-e{i}", job=job)


def decision_envelope(job: str, cause_seq: int) -> EnvelopeBase:
    data = {"job": job, "cause_seq": cause_seq, "index": 0, "kind": "fault.suspected", "previous": "running",
            "state": "running", "reason": "missed heartbeats"}
    return make_envelope("decision", data, id=f"dec-{job}-{cause_seq}-0", job=job)


async def read_all(log: Any, start_seq: int = 1) -> list[Record | RawRecord]:
    return [record async for record in log.read(start_seq)]


class EventLogContract:
    """Abstract: subclass it as `Test...` and override `make_log`."""

    persistent: ClassVar[bool] = False
    """Whether a log opened again by the factory sees what an earlier one stored."""

    @pytest.fixture
    async def make_log(self) -> AsyncIterator[LogFactory]:
        raise NotImplementedError("a contract subclass provides make_log")
        yield  # pragma: no cover

    @pytest.fixture
    async def log(self, make_log: LogFactory) -> Any:
        return await make_log()

    async def test_is_an_event_log(self, log: Any) -> None:
        assert isinstance(log, EventLog)

    async def test_empty(self, log: Any) -> None:
        assert await log.last_seq() == 0
        assert await read_all(log) == []

    async def test_records_come_back_in_order_with_consecutive_seqs(self, log: Any) -> None:
        envelopes = [heartbeat(i) for i in range(1, 8)]
        appended = [await log.append(HEARTBEAT, env) for env in envelopes]
        assert [(a.seq, a.duplicate) for a in appended] == [(i, False) for i in range(1, 8)]
        records = await read_all(log)
        assert [r.seq for r in records] == list(range(1, 8))
        assert all(isinstance(r, Record) for r in records)
        assert [r.envelope.id for r in records if isinstance(r, Record)] == [e.id for e in envelopes]

    async def test_ts_is_non_decreasing_integer_nanoseconds(self, log: Any) -> None:
        before = time.time_ns()
        for i in range(1, 20):
            await log.append(HEARTBEAT, heartbeat(i))
        after = time.time_ns()
        stamps = [r.ts for r in await read_all(log)]
        assert all(type(ts) is int for ts in stamps)
        assert stamps == sorted(stamps)
        # Nanoseconds since the epoch, from this host's clock (the server runs here): catches a unit slip.
        slack = 5_000_000_000
        assert before - slack <= stamps[0] and stamps[-1] <= after + slack

    async def test_subjects_and_headers_round_trip(self, log: Any) -> None:
        sent = [
            (HEARTBEAT, heartbeat(1), {"traceparent": "00-abc-def-01", "X-Source": "agent@n1"}),
            (node_event("n1", "device.fault"),
             make_envelope("device.fault", {"device": 3, "vendor": "nvidia", "code": "79"}, id="f1", node="n1"),
             None),
            (decision("j1"), decision_envelope("j1", 1), {"Recovery-Policy": "ladder@1"}),
            (dead_letter("malformed_json"), b"{broken", {"Reason": "payload is not JSON"}),
        ]
        for subject, payload, headers in sent:
            await log.append(subject, payload, headers)
        records = await read_all(log)
        assert [r.subject for r in records] == [s for s, _, _ in sent]
        for record, (_, payload, headers) in zip(records, sent, strict=True):
            expected = dict(headers or {})
            if isinstance(payload, EnvelopeBase):
                expected[MSG_ID] = payload.id
            assert record.headers == expected

    async def test_envelope_round_trips_equal(self, log: Any) -> None:
        envelopes = [
            heartbeat(1),
            make_envelope("device.fault", {"device": 0, "vendor": "ascend", "code": "0x80E01801", "ecc_dbe": 2},
                          id="f-1", node="n7", source="probe@n7", time="2025-01-01T00:00:00Z"),
            decision_envelope("j1", 1),
        ]
        for env in envelopes:
            await log.append(HEARTBEAT, env)
        records = await read_all(log)
        assert all(isinstance(r, Record) for r in records)
        for record, env in zip(records, envelopes, strict=True):
            assert isinstance(record, Record)
            assert type(record.envelope) is type(env)
            assert record.envelope.model_dump() == env.model_dump()

    async def test_msg_id_header_is_the_envelope_id(self, log: Any) -> None:
        await log.append(HEARTBEAT, heartbeat(1))
        await log.append(HEARTBEAT, heartbeat(2), {"other": "x"})
        records = await read_all(log)
        assert [r.headers[MSG_ID] for r in records] == ["j1-e1", "j1-e2"]

    async def test_duplicate_id_is_dropped(self, log: Any) -> None:
        first = await log.append(HEARTBEAT, heartbeat(1))
        await log.append(HEARTBEAT, heartbeat(2))
        # The same id again, even with other data, on another subject: stored once, first seq returned.
        again = make_envelope("process.heartbeat", {"rank": 5, "step": 99}, id="j1-e1", job="j1")
        dup = await log.append(job_event("j1", "other"), again)
        assert (dup.seq, dup.duplicate) == (first.seq, True)
        # Raw bytes with an explicit message id are deduplicated the same way.
        raw = await log.append(HEARTBEAT, b"raw-1", {MSG_ID: "raw-id"})
        raw_dup = await log.append(HEARTBEAT, b"raw-2", {MSG_ID: "raw-id"})
        assert (raw_dup.seq, raw_dup.duplicate) == (raw.seq, True)
        assert await log.last_seq() == 3
        records = await read_all(log)
        assert [r.seq for r in records] == [1, 2, 3]
        assert isinstance(records[0], Record) and records[0].envelope.model_dump() == heartbeat(1).model_dump()
        assert isinstance(records[2], RawRecord) and records[2].data == b"raw-1"

    async def test_raw_bytes_are_stored_as_given(self, log: Any) -> None:
        payloads = [
            b"not json {",
            b'{"type": "no.such.type", "id": "x"}',
            b'{"id": "h1", "type": "process.heartbeat", "job": "j1", "data": {"rank": -1}}',
            b"[1, 2, 3]",
            "caf\u00e9 \u2603 not an envelope".encode(),
        ]
        for payload in payloads:
            appended = await log.append(HEARTBEAT, payload)
            assert not appended.duplicate
        records = await read_all(log)
        assert all(isinstance(r, RawRecord) for r in records)
        assert [r.data for r in records if isinstance(r, RawRecord)] == payloads
        assert all(MSG_ID not in r.headers for r in records)  # no envelope, no id: not deduplicated

    async def test_non_utf8_raw_bytes_round_trip_and_export(self, log: Any, tmp_path: Path) -> None:
        payload = b"\xff\xfe\x00binary\x80"
        await log.append(HEARTBEAT, payload)
        records = await read_all(log)
        assert isinstance(records[0], RawRecord) and records[0].data == payload
        assert await log.export(tmp_path / "export.jsonl") == 1
        assert list(iter_file(tmp_path / "export.jsonl")) == records

    async def test_read_from_start_seq(self, log: Any) -> None:
        for i in range(1, 11):
            await log.append(HEARTBEAT, heartbeat(i))
        assert [r.seq for r in await read_all(log, 4)] == list(range(4, 11))
        assert [r.seq for r in await read_all(log, 10)] == [10]
        assert await read_all(log, 11) == []
        assert [r.seq for r in await read_all(log, 0)] == list(range(1, 11))

    async def test_last_seq(self, log: Any) -> None:
        assert await log.last_seq() == 0
        for i in range(1, 6):
            await log.append(HEARTBEAT, heartbeat(i))
            assert await log.last_seq() == i
        await log.append(HEARTBEAT, heartbeat(3))  # duplicate
        assert await log.last_seq() == 5

    async def test_reading_twice_gives_the_same_records(self, log: Any) -> None:
        for i in range(1, 6):
            await log.append(HEARTBEAT, heartbeat(i))
        await log.append(HEARTBEAT, b"junk")
        first = await read_all(log)
        second = await read_all(log)
        assert len(first) == 6
        assert first == second

    async def test_read_stops_at_the_last_seq_when_it_started(self, log: Any) -> None:
        for i in range(1, 6):
            await log.append(HEARTBEAT, heartbeat(i))
        seen = []
        async for record in log.read():
            seen.append(record.seq)
            if record.seq == 2:
                await log.append(HEARTBEAT, heartbeat(100))
        assert seen == [1, 2, 3, 4, 5]
        assert [r.seq for r in await read_all(log)] == [1, 2, 3, 4, 5, 6]

    async def test_export_round_trips_through_iter_file(self, log: Any, tmp_path: Path) -> None:
        await log.append(HEARTBEAT, heartbeat(1), {"traceparent": "t1"})
        await log.append(job_event("j2", "process.heartbeat"), heartbeat(1, job="j2"))
        await log.append(HEARTBEAT, b"\x00not json \xe2\x98\x83")
        await log.append(decision("j1"), decision_envelope("j1", 1))
        await log.append(node_event("n1", "network.link_down"),
                         make_envelope("network.link_down", {"link": "mlx5_0"}, id="l1", node="n1"))
        records = await read_all(log)
        path = tmp_path / "export.jsonl"
        assert await log.export(path) == len(records) == 5
        assert list(iter_file(path)) == records
        assert await log.export(path, start_seq=3) == 3
        assert list(iter_file(path)) == records[2:]

    async def test_export_filters_by_job_and_time(self, log: Any, tmp_path: Path) -> None:
        await log.append(HEARTBEAT, heartbeat(1))
        await log.append(job_event("j2", "process.heartbeat"), heartbeat(1, job="j2"))
        await log.append(decision("j1"), decision_envelope("j1", 1))
        await log.append(HEARTBEAT, b"bad input on j1's subject")
        await log.append(decision("j2"), decision_envelope("j2", 2))
        await log.append(HEARTBEAT, heartbeat(2))
        records = await read_all(log)
        path = tmp_path / "j1.jsonl"
        assert await log.export(path, job="j1") == 4
        assert [r.seq for r in iter_file(path)] == [1, 3, 4, 6]
        since = records[3].ts
        expected = [r for r in records if r.ts >= since]
        assert await log.export(path, since_ns=since) == len(expected)
        assert list(iter_file(path)) == expected
        assert await log.export(path, job="j2", since_ns=since) == len([r for r in expected if r.seq in (2, 5)])
        assert await log.export(path, job="nobody") == 0
        assert list(iter_file(path)) == []

    async def test_a_reopened_log_keeps_records_and_duplicate_ids(self, make_log: LogFactory) -> None:
        """A persistent log opened again holds what it held, and still knows the ids it stored; one that is not
        (`persistent = False`, the memory log) starts empty, and an id it had is new to it."""
        log = await make_log()
        for i in range(1, 4):
            await log.append(HEARTBEAT, heartbeat(i))
        before = await read_all(log)
        await log.close()
        reopened = await make_log()
        if not self.persistent:
            assert await reopened.last_seq() == 0 and await read_all(reopened) == []
            again = await reopened.append(HEARTBEAT, heartbeat(2))
            assert (again.seq, again.duplicate) == (1, False)
            return
        assert await reopened.last_seq() == 3
        assert await read_all(reopened) == before
        dup = await reopened.append(HEARTBEAT, heartbeat(2))
        assert (dup.seq, dup.duplicate) == (2, True)
        fresh = await reopened.append(HEARTBEAT, heartbeat(4))
        assert (fresh.seq, fresh.duplicate) == (4, False)

"""The golden scenarios' inputs, published over NATS to a running `recovery-daemon` process, give exactly the
decisions an offline replay of the same stored events gives.

The daemon's timer service is off: the golden logs hold their `timer.fired` events, published here as inputs in
their order. Log time is the JetStream timestamp, so the decisions are compared with the offline replay of the
stream the daemon read (same records, same timestamps), not with the golden file's: the test is that the daemon
applies every input once, in stream order, and records every effect once, in order, whatever its batching.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from events import subjects
from events.envelope import Record
from recovery.log import MSG_ID, iter_file
from recovery.log.jetstream import JetStreamLog
from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess, check_log, connect, input_ids, read_stream, wait_for
from tests.golden.scenarios import SCENARIOS, path


async def publish_inputs(url: str, name: str) -> tuple[int, list[str]]:
    """Publish the scenario's input records in order; (last stream sequence, their ids)."""
    nc, js = await connect(url)
    log = JetStreamLog(nc, js, "RECOVERY", owns_connection=False)
    ids, last = [], 0
    try:
        for record in iter_file(path(name)):
            if subjects.is_output(record.subject):
                continue
            if isinstance(record, Record):
                appended = await log.append(record.subject, record.envelope)
            else:
                appended = await log.append(record.subject, record.data, headers=dict(record.headers))
            ids.append(record.headers.get(MSG_ID, ""))
            last = appended.seq
    finally:
        await nc.close()
    return last, ids


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_inputs_over_nats_match_the_offline_replay(name: str, nats_server: NatsServer, tmp_path: Path) -> None:
    batch = 1 + sorted(SCENARIOS).index(name) * 37 % 300  # batches of different sizes across the scenarios
    daemon = DaemonProcess(tmp_path, nats_server.url, timers_enabled=False, batch_size=batch)
    daemon.start()
    try:
        daemon.wait_ready()
        last, ids = asyncio.run(publish_inputs(nats_server.url, name))
        wait_for(lambda: daemon.status()["published_seq"] >= last, 30, "the daemon to apply every input")
        code, seconds = daemon.terminate()
        assert code == 0 and seconds < 5, daemon.log_tail()
    finally:
        daemon.close()
    records = asyncio.run(read_stream(nats_server.url))
    assert input_ids(records) == ids  # every input stored once, in the golden order
    result = check_log(records)
    golden = [r for r in iter_file(path(name)) if isinstance(r, Record) and r.envelope.type == "decision"]
    assert result.recorded_decisions, "the daemon made no decision"
    assert len(result.recorded_decisions) <= 2 * len(golden) + 4  # sanity: the same kind of run
    assert not [line for line in daemon.logs() if line.get("level") == "error"]

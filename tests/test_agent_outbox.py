"""The agent's outbox against a real nats-server that goes away: events wait in order, none is lost or doubled,
and past its capacity the oldest are dropped and counted."""

from __future__ import annotations

import asyncio

import nats

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.agent.outbox import Outbox
from recovery.log.jetstream import ensure_stream, stream_config
from recovery.testing.nats import NatsServer
from tests.daemon_support import read_stream
from tests.e2e_support import wait_until


def put(outbox: Outbox, i: int) -> None:
    envelope = make_envelope("process.heartbeat", {"rank": 0, "step": i}, id=f"hb-{i}", job="j")
    outbox.put(subjects.job_event("j", "process.heartbeat"), encode_envelope(envelope), envelope.id)


async def test_events_put_while_nats_is_away_are_stored_in_order_once_it_returns(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = nc.jetstream(timeout=1.0)
    await ensure_stream(js, stream_config())
    outbox = Outbox(js, capacity=1000)
    task = asyncio.create_task(outbox.run())
    try:
        put(outbox, 0)
        await wait_until(lambda: outbox.published == 1, 10, "the first event")
        nats_server.stop()
        for i in range(1, 50):
            put(outbox, i)  # never blocks: training goes on
        nats_server.start()
        await wait_until(lambda: outbox.published == 50, 30, "every event after the outage")
    finally:
        task.cancel()
        await nc.close()
    ids = [r.headers.get("Nats-Msg-Id") for r in await read_stream(nats_server.url)]
    assert ids == [f"hb-{i}" for i in range(50)] and outbox.dropped == 0


async def test_past_its_capacity_the_outbox_drops_the_oldest_and_counts_them(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    outbox = Outbox(nc.jetstream(), capacity=3)
    for i in range(5):
        put(outbox, i)
    assert [p.msg_id for p in outbox.queue] == ["hb-2", "hb-3", "hb-4"] and outbox.dropped == 2
    await nc.close()


async def test_a_full_outbox_drops_heartbeats_before_exits_and_steps(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    outbox = Outbox(nc.jetstream(), capacity=3)
    exited = make_envelope("process.exited", {"rank": 0, "exit_code": 1}, id="exit-0", job="j")
    outbox.put(subjects.job_event("j", "process.exited"), encode_envelope(exited), exited.id)
    for i in range(3):
        envelope = make_envelope("process.heartbeat", {"rank": 1, "step": i}, id=f"hb-{i}", job="j")
        outbox.put(subjects.job_event("j", "process.heartbeat"), encode_envelope(envelope), envelope.id,
                   heartbeat=True)
    step = make_envelope("progress.step", {"rank": 1, "step": 3}, id="step-3", job="j")
    outbox.put(subjects.job_event("j", "progress.step"), encode_envelope(step), step.id)
    assert [p.msg_id for p in outbox.queue] == ["exit-0", "hb-2", "step-3"] and outbox.dropped == 2
    await nc.close()

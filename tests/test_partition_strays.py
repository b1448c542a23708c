"""With several partitions, an input stored under `recovery.ev.` on a subject that is neither a job event's nor a
node event's (`recovery.ev.job.X`, `recovery.ev.other.x`: agents may publish there) is read by exactly one partition,
which dead-letters it as a single daemon does, and `verify` sees it. Real nats-server, one daemon owning every
partition."""

from __future__ import annotations

from pathlib import Path

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from events.outputs import Rejection
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.log import MSG_ID
from recovery.log.partitions import partition_located
from recovery.log.verify import first_divergence, rejection_divergence, replay_log
from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess, async_wait_for, connect, read_stream

P = 3
STRAYS = ["recovery.ev.job.lm", "recovery.ev.other.x", "recovery.ev.job"]


def test_stray_subjects_are_told_apart_from_job_and_node_events() -> None:
    assert [subjects.stray_input(s) for s in STRAYS] == [True, True, True]
    assert not subjects.stray_input(subjects.job_event("lm", "job.started"))
    assert not subjects.stray_input(subjects.node_event("n1", "device.fault"))
    assert not subjects.stray_input("recovery.dec.lm")


async def test_each_stray_input_is_dead_lettered_once_by_one_partition_and_verified(
        nats_server: NatsServer, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "d", nats_server.url, partitions=P, lease_ttl_s=2.0)
    nc, js = await connect(nats_server.url)
    try:
        daemon.start()
        daemon.wait_ready()
        await async_wait_for(lambda: len(daemon.status().get("owned", [])) == P, 30, "every partition owned")
        for index, subject in enumerate(STRAYS):
            envelope = make_envelope("job.started", {}, id=f"stray-{index}", job="lm", source="agent")
            await js.publish(subject, encode_envelope(envelope), headers={MSG_ID: envelope.id})

        async def dead_letters() -> list[Rejection]:
            return [r.envelope.data for r in await read_stream(nats_server.url)
                    if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]

        async def answered() -> bool:
            return len(await dead_letters()) >= len(STRAYS)

        await async_wait_for(answered, 30, "a dead letter for each stray input")
    finally:
        await nc.close()
        daemon.close()
    records = await read_stream(nats_server.url)
    letters = [r.envelope.data for r in records if r.subject.startswith("recovery.dlq.") and isinstance(r, Record)]
    assert sorted(letter.subject for letter in letters) == sorted(STRAYS)  # once each, not once per partition
    assert {letter.code for letter in letters} == {"subject_mismatch"}
    # `verify` replays each partition as its daemon read it: the strays are partition 0's, and each partition's
    # replay agrees with its dead letters.
    for k in range(P):
        part = Partition(k, P)
        result = replay_log(partition_located(((f"seq {r.seq}", r) for r in records), part), Engine(part))
        assert first_divergence(result) is None and rejection_divergence(result) is None
        stray = sorted(r.subject for r in result.rejections)
        assert stray == (sorted(STRAYS) if k == subjects.STRAYS_PARTITION else [])


"""The nodes' beats and reports are heard once per process, however many partitions it serves
(`recovery.service.shared`), on a real nats-server: every member hears every message through one subscription, and
when the member that carries it leaves, another carries it on."""

from __future__ import annotations

from recovery.service.shared import SharedSubscription
from recovery.testing.nats import NatsServer
from tests.e2e_support import connect, wait_until


async def test_one_subscription_for_every_member_and_it_moves_when_its_member_leaves(nats_server: NatsServer) -> None:
    connections = [await connect(nats_server.url) for _ in range(3)]
    heard: list[list[str]] = [[], [], []]
    shared = SharedSubscription.of("t.beat.*")
    try:
        tokens = [await shared.join(nc, lambda subject, _data, mine=mine: mine.append(subject))
                  for nc, mine in zip(connections, heard, strict=True)]
        assert SharedSubscription.of("t.beat.*") is shared
        assert shared.owner == tokens[0]
        subscriptions = [len(nc._subs) for nc in connections]  # how many the server delivers to
        assert subscriptions == [1, 0, 0]
        sender = connections[2]
        await sender.publish("t.beat.n0", b"")
        await sender.flush()
        await wait_until(lambda: all(h == ["t.beat.n0"] for h in heard), 10, "every member to hear the beat")
        await shared.leave(tokens[0])  # the carrier's partition is given up: the next member carries it
        assert shared.owner == tokens[1] and len(connections[1]._subs) == 1
        await sender.publish("t.beat.n1", b"")
        await sender.flush()
        await wait_until(lambda: heard[1][-1:] == ["t.beat.n1"] and heard[2][-1:] == ["t.beat.n1"], 10,
                         "the others to hear the next beat")
        assert heard[0] == ["t.beat.n0"]  # a member that left hears nothing more
        for token in tokens[1:]:
            await shared.leave(token)
        assert SharedSubscription.of("t.beat.*") is not shared  # the last one gone: none kept for this loop
    finally:
        for nc in connections:
            await nc.close()

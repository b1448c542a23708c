"""The nodes' beats and reports are heard once per process, however many partitions it serves
(`recovery.service.shared`), on a real nats-server: every member hears every message through one subscription, and
when the member that carries it leaves, another carries it on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from recovery.service.shared import SharedSubscription
from recovery.testing.nats import NatsServer
from tests.e2e_support import connect


async def beat_until(sender: Any, subject: str, heard: list[list[str]], timeout: float = 10.0) -> None:
    """Beat on `subject` as an agent does, every 0.1 s, until every list of `heard` holds it (TimeoutError at the
    deadline): a beat may be lost, and the next says the same."""
    deadline = time.monotonic() + timeout
    while not all(subject in mine for mine in heard):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{subject} not heard by every member: {heard}")
        await sender.publish(subject, b"")
        await sender.flush()
        await asyncio.sleep(0.1)  # the beat's period


async def test_one_subscription_for_every_member_and_it_moves_when_its_member_leaves(nats_server: NatsServer) -> None:
    connections = [await connect(nats_server.url) for _ in range(3)]
    heard: list[list[str]] = [[], [], []]
    shared = SharedSubscription.of("t.beat.*")
    try:
        tokens = [await shared.join(nc, lambda subject, _data, mine=mine: mine.append(subject))
                  for nc, mine in zip(connections, heard, strict=True)]
        assert SharedSubscription.of("t.beat.*") is shared
        assert shared.owner == tokens[0]
        assert [len(nc._subs) for nc in connections] == [1, 0, 0]  # one the server delivers to, for all three
        sender = connections[2]
        await beat_until(sender, "t.beat.n0", heard)
        assert all(set(mine) == {"t.beat.n0"} for mine in heard)
        await shared.leave(tokens[0])  # the carrier's partition is given up: the next member carries it
        assert shared.owner == tokens[1] and [len(nc._subs) for nc in connections] == [0, 1, 0]
        await beat_until(sender, "t.beat.n1", heard[1:])
        assert set(heard[0]) == {"t.beat.n0"}  # a member that left hears nothing more
        for token in tokens[1:]:
            await shared.leave(token)
        assert SharedSubscription.of("t.beat.*") is not shared  # the last one gone: none kept for this loop
    finally:
        for nc in connections:
            await nc.close()



async def test_the_next_member_hears_the_subject_before_the_leaving_ones_subscription_goes(
        nats_server: NatsServer) -> None:
    """Never a moment with no subscription: the next member's is made (and the server has it) before the leaving
    one's is drained, so no beat or report published during the move reaches nobody."""
    connections = [await connect(nats_server.url) for _ in range(2)]
    shared = SharedSubscription.of("t.moving.*")
    try:
        tokens = [await shared.join(nc, lambda _subject, _data: None) for nc in connections]
        leaving = shared.subscription
        seen_when_removed: list[tuple[int | None, int]] = []
        for name in ("drain", "unsubscribe"):
            removal = getattr(leaving, name)

            async def removed(removal: Any = removal) -> None:
                # what carries the subject at the moment the leaving member's subscription goes
                seen_when_removed.append((shared.owner, len(connections[1]._subs)))
                await removal()
            setattr(leaving, name, removed)
        await shared.leave(tokens[0])
        assert seen_when_removed and seen_when_removed[0] == (tokens[1], 1), seen_when_removed
        assert [len(nc._subs) for nc in connections] == [0, 1]
        await shared.leave(tokens[1])
    finally:
        for nc in connections:
            await nc.close()

"""One core-NATS subscription per process for what every partition's daemon hears: the nodes' live beats
(`recovery.service.liveness`) and their periodic reports (`recovery.service.summaries`).

With `partitions` > 1 a process runs one `Daemon` per partition it owns, each on its own connection. A subscription
of each would have the fleet's every beat and report delivered once per partition, and a core-NATS message costs
the client far more than the dictionary write a beat is: four partitions made four times the beats' cost. Here the
first member subscribes, on its connection, and every message is handed to each member in the process; when that
member leaves (its partition given up), the next one subscribes on its own first, and only then is the old
subscription drained: no moment with none. Members of different event loops (tests that run several daemons in one
process, one after the other) never share one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from nats.aio.client import Client

logger = logging.getLogger("recovery.daemon")

Handler = Callable[[str, bytes], None]
DRAIN_S = 2.0
"""the longest a leaving member's subscription is drained before it is dropped"""


class SharedSubscription:
    """The subscription of this event loop to `subject`, handed to every member's handler."""

    _shared: ClassVar[dict[tuple[str, int], SharedSubscription]] = {}
    _tokens = itertools.count(1)

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.members: dict[int, tuple[Client, Handler]] = {}
        self.subscription: Any = None
        self.owner: int | None = None  # the member whose connection carries the subscription

    @classmethod
    def of(cls, subject: str) -> SharedSubscription:
        key = (subject, id(asyncio.get_running_loop()))
        shared = cls._shared.get(key)
        if shared is None:
            shared = cls._shared[key] = SharedSubscription(subject)
        return shared

    async def join(self, nc: Client, handler: Handler) -> int:
        """Hear `subject` with `handler` from now on, until `leave`; a token for that."""
        token = next(self._tokens)
        self.members[token] = (nc, handler)
        await self._subscribe()
        return token

    async def leave(self, token: int) -> None:
        self.members.pop(token, None)
        if token == self.owner:
            # The next member subscribes before the old subscription goes: in between, a message would reach
            # nobody (a beat or a report lost). A message both deliver is heard twice, which a beat and a report
            # (each the newest word of its node) bear.
            subscription, self.subscription, self.owner = self.subscription, None, None
            await self._subscribe()
            try:
                # drained, not dropped: what it received before the next one's interest reached the server is
                # handed on first (bounded: a connection closing with its partition may never answer)
                await asyncio.wait_for(subscription.drain(), DRAIN_S)
            except Exception:  # closed or slow: whatever it still held reached the next one's subscription too
                logger.info("the subscription to %s was dropped, not drained", self.subject, exc_info=True)
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        if not self.members:
            self._shared.pop((self.subject, id(asyncio.get_running_loop())), None)

    async def _subscribe(self) -> None:
        for token, (nc, _) in list(self.members.items()):
            if self.subscription is not None:
                return
            try:
                self.subscription = await nc.subscribe(self.subject, cb=self._deliver)
                self.owner = token
                await nc.flush()  # the server has the interest before the member counts on it
            except Exception:  # that connection is closed or closing: the next member's
                logger.warning("could not subscribe to %s on a partition's connection", self.subject, exc_info=True)

    async def _deliver(self, msg: Any) -> None:
        subject, data = msg.subject, msg.data
        for _, handler in list(self.members.values()):
            try:
                handler(subject, data)
            except Exception:  # one member's fault: the others hear the message all the same
                logger.exception("a member could not take a message of %s", subject)

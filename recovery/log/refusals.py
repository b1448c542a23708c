"""NATS's refusals of a publish or a subscription, said as what they are.

A server that refuses a client's publish for its permissions answers `-ERR 'Permissions Violation for Publish to
"<subject>"'` and drops the message; nats-py hands that to the connection's error callback only, while a JetStream
publish waiting for its acknowledgement just times out. An agent run with another node's credentials (or an
`auth.conf` written for other nodes) so logged `agent ready`, then nothing but `nats: timeout`, as if the network
were at fault. The agent and the daemon give each refusal to `Refusals`, which logs it as an error, once per subject
and operation (a refused heartbeat repeats every period), naming what was refused and the likely cause.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

ErrorCallback = Callable[[Exception], Awaitable[None]]

PERMISSIONS_VIOLATION = "permissions violation"
"""what the server's error says (nats-py's `PERMISSIONS_ERR`), in any case"""
_NUID = re.compile(r"\.[A-Za-z0-9]{22}(?=[.\"]|$)")
"""a consumer's or an inbox's random name in a refused subject: each retry has another, and is the same refusal"""


def is_refusal(exc: BaseException) -> bool:
    """Is `exc` the server refusing a publish or subscription for the user's permissions?"""
    return PERMISSIONS_VIOLATION in str(exc).lower()


class Refusals:
    """Logs the server's permission refusals of one client (`who`: the agent of a node, the daemon) as errors."""

    def __init__(self, logger: logging.Logger, who: str) -> None:
        self._logger = logger
        self._who = who
        self._seen: dict[str, int] = {}  # the server's message -> how many times it came
        self.count = 0

    def seen(self, exc: BaseException) -> bool:
        """Log `exc` if it is a refusal not logged yet; whether it is a refusal at all."""
        if not is_refusal(exc):
            return False
        self.count += 1
        text = str(exc).removeprefix("nats: ").strip("'")
        key = _NUID.sub(".*", text)
        times = self._seen.get(key, 0)
        self._seen[key] = times + 1
        if times == 0:
            self._logger.error("nats permissions violation", extra={"fields": {
                "who": self._who, "error": text,
                "hint": f"the NATS server refused this to {self._who} and dropped it: the user it connects as may not "
                        f"do this (another node's credentials, or an auth.conf written for other nodes or roles); "
                        f"what waits for an answer times out (nats: timeout) until the credentials are fixed"}})
        return True

    def around(self, other: ErrorCallback) -> ErrorCallback:
        """A connection's error callback: refusals are logged here, every other error goes to `other`."""
        async def on_error(exc: Exception) -> None:
            if not self.seen(exc):
                await other(exc)

        return on_error

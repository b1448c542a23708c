"""What a process says while it waits for NATS or for the streams it needs: the daemon and the agents alike.

nats-py retries a first connect with `max_reconnect_attempts=-1` inside `nats.connect`, reporting each failure only
to the error callback, so a process pointed at a dead address logged nothing at all; and an agent started before
any daemon created the streams crashed on `stream not found`. Both now wait, and say at INFO what they wait for
and how many times they have tried: the first attempts, then one line every `every_s` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from nats.js.errors import NotFoundError

T = TypeVar("T")


class Attempts:
    """Counts the failed attempts at one thing and logs them, rate-limited, with the count so far."""

    def __init__(self, log: logging.Logger, what: str, where: str, every_s: float = 10.0, first: int = 3) -> None:
        self.log = log
        self.what = what
        self.where = where
        self.every_s = every_s
        self.first = first
        self.count = 0
        self._last_logged = -every_s
        self._started = time.monotonic()

    def failed(self, exc: BaseException) -> None:
        self.count += 1
        elapsed = time.monotonic() - self._started
        if self.count <= self.first or elapsed - self._last_logged >= self.every_s:
            self._last_logged = elapsed
            self.log.info(f"waiting for {self.what}", extra={"fields": {
                "where": self.where, "attempts": self.count, "waiting_s": round(elapsed, 1), "error": repr(exc)}})

    def succeeded(self, what: str) -> None:
        if self.count:
            self.log.info(what, extra={"fields": {"where": self.where, "attempts": self.count + 1}})


async def until_streams_exist(call: Callable[[], Awaitable[T]], log: logging.Logger, streams: str,
                              retry_s: float = 1.0) -> T:
    """`call()` again and again while it raises "stream not found" (no daemon has created the streams yet)."""
    attempts = Attempts(log, f"the streams {streams}, which recovery-daemon creates", streams)
    while True:
        try:
            result = await call()
        except NotFoundError as exc:
            attempts.failed(exc)
            await anyio.sleep(retry_s)  # retry interval; cancelled with the process
            continue
        attempts.succeeded(f"the streams {streams} exist")
        return result

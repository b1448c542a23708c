"""The daemon's NATS connection: made with retries until a stop, closed (drained) within a budget with the
client's own tasks ended, and the event loop's executor that lets a snapshot fork safely between calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.errors
from nats.aio.client import Client

from recovery.log.jetstream import is_transient
from recovery.log.waiting import Attempts
from recovery.service.publisher import reraise_cancel

logger = logging.getLogger("recovery.daemon")

Callback = Callable[[], Awaitable[None]]


async def connect(url: str, on_disconnected: Callback, on_reconnected: Callback,
                  on_error: Callable[[Exception], Awaitable[None]]) -> Client:
    """A connection to the servers of `url` (comma-separated) that reconnects forever; until the first one
    succeeds, tried again with backoff (a stop request cancels the wait), saying so at INFO."""
    servers = [s.strip() for s in url.split(",") if s.strip()]
    attempts = Attempts(logger, "NATS: the daemon cannot start without its log", url)
    connected = False

    async def error(exc: Exception) -> None:
        if not connected:
            attempts.failed(exc)
        await on_error(exc)

    delay = 0.1
    while True:
        try:
            nc = await nats.connect(
                servers, name=f"recovery-daemon-{os.getpid()}", max_reconnect_attempts=-1,
                reconnect_time_wait=0.25, connect_timeout=2, allow_reconnect=True, ping_interval=5,
                max_outstanding_pings=2, pending_size=64 * 1024 * 1024,
                disconnected_cb=on_disconnected, reconnected_cb=on_reconnected, error_cb=error,
            )
            connected = True
            attempts.succeeded("NATS reached")
            return nc
        except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
            reraise_cancel(exc)
            attempts.failed(exc)
            await anyio.sleep(delay)  # connect retry backoff; a stop request cancels it
            delay = min(delay * 2, 2.0)


async def close(nc: Client, drain_s: float) -> None:
    """Drain the connection within `drain_s` (closed outright if that fails), then wait for the client's own
    tasks: it cancels them as it closes but does not wait for them, and none may outlive the daemon."""
    tasks = client_tasks(nc)
    with anyio.move_on_after(drain_s, shield=True):
        try:
            if not nc.is_closed:
                await nc.drain()
        except Exception:
            with contextlib.suppress(Exception):
                await nc.close()
    if not nc.is_closed:
        with anyio.move_on_after(1.0, shield=True), contextlib.suppress(Exception):
            await nc.close()
    pending = [task for task in tasks if not task.done()]
    if pending:
        with anyio.move_on_after(1.0, shield=True):
            await asyncio.wait(pending)


def client_tasks(nc: Client) -> list[asyncio.Task[Any]]:
    """The tasks nats-py runs for a connection (checked on nats-py 2.16): reading, pinging, flushing,
    reconnecting, and one per subscription with a callback."""
    candidates = [getattr(nc, name, None) for name in
                  ("_reading_task", "_ping_interval_task", "_flusher_task", "_reconnection_task")]
    candidates += [getattr(sub, "_wait_for_msgs_task", None) for sub in getattr(nc, "_subs", {}).values()]
    return [task for task in candidates if isinstance(task, asyncio.Task)]


class ShortLivedThreads(concurrent.futures.ThreadPoolExecutor):
    """The event loop's executor for what it must hand to a thread (looking up a host name): each call runs in a
    thread of its own that ends with it, so that between calls the daemon runs no thread but its own and a
    snapshot may fork (`recovery.service.snapshots`). A pool's idle workers would stay forever."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        threading.Thread(target=work, name="recovery-lookup", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # its threads end with their calls


async def retry(op: Callable[[], Awaitable[Any]], what: str, stopping: Callable[[], bool],
                limit_s: float = float("inf")) -> Any:
    """`op()`, tried again with a growing backoff while it fails the way an outage fails it (a 429 included),
    until `limit_s` or a stop; any other error at once."""
    deadline = time.monotonic() + limit_s
    delay = 0.05
    while True:
        try:
            return await op()
        except Exception as exc:
            if not is_transient(exc):
                raise
            reraise_cancel(exc)
            if time.monotonic() > deadline or stopping():
                raise
            logger.warning(f"{what}: retrying", extra={"fields": {"error": repr(exc)}})
            await anyio.sleep(delay)  # retry backoff through an outage
            delay = min(delay * 2, 1.0)

"""The agent's side of the SDK's local channel: one Unix socket per job, line-delimited JSON (see
`recovery.client._channel` for the messages). A process says which rank it is in every message."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

logger = logging.getLogger("recovery.agent")

MAX_LINE = 64 * 1024

Handler = Callable[[dict[str, Any]], Awaitable[None]]


class ProcessChannel:
    """The socket a job's processes connect to; `send(rank, message)` reaches the rank's latest connection."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._streams: dict[int, SocketStream] = {}

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.path.unlink(missing_ok=True)
        listener = await anyio.create_unix_listener(self.path)
        task_status.started()
        async with listener:
            await listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        rank: int | None = None
        async with stream:
            try:
                while True:
                    line = await reader.receive_until(b"\n", MAX_LINE)
                    try:
                        message = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        logger.warning("undecodable line from a process on %s", self.path)
                        continue
                    if not isinstance(message, dict) or not isinstance(message.get("rank"), int):
                        continue
                    if rank != message["rank"]:
                        rank = message["rank"]
                        self._streams[rank] = stream
                    await self.handler(message)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, anyio.DelimiterNotFound,
                    anyio.ClosedResourceError):
                pass
            finally:
                if rank is not None and self._streams.get(rank) is stream:
                    del self._streams[rank]

    def connected(self, rank: int) -> bool:
        """Does a connection of `rank` stay open (whose lines may not all have been handled yet)?"""
        return rank in self._streams

    async def send(self, rank: int, message: dict[str, Any]) -> bool:
        stream = self._streams.get(rank)
        if stream is None:
            return False
        try:
            await stream.send(orjson.dumps(message) + b"\n")
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False

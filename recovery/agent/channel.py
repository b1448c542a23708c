"""The agent's side of the SDK's local channel: one Unix socket per job, line-delimited JSON (see
`recovery.client._channel` for the messages). A process says which rank it is in every message."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
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
UNIX_PATH_MAX = 107
"""the longest path a Unix socket binds to on Linux (`sun_path` is 108 bytes, with its NUL)"""


def socket_path(wanted: Path) -> Path:
    """`wanted`, or, where it is too long to bind (a deep runtime directory), a short path that stands for it: in a
    directory of this user's under the temporary directory, named by a digest of `wanted` (the same for an agent
    started again on the node). The ranks read the path from their environment, whichever it is."""
    if len(os.fsencode(wanted)) <= UNIX_PATH_MAX:
        return wanted
    private = Path(tempfile.gettempdir()) / f"recovery-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    short = private / f"{hashlib.sha1(os.fsencode(wanted)).hexdigest()[:20]}.sock"
    logger.info("the channel %s is too long for a Unix socket: it is %s", wanted, short)
    return short


class ProcessChannel:
    """The socket a job's processes connect to; `send(rank, message)` reaches the rank's latest connection."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = socket_path(path)
        self.handler = handler
        self._streams: dict[int, SocketStream] = {}

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.path.unlink(missing_ok=True)
        listener = await anyio.create_unix_listener(self.path)
        bound = self.path.stat().st_ino
        task_status.started()
        try:
            async with listener:
                await listener.serve(self._connection)
        finally:
            # Removed once served (a short path's directory is shared by every job), unless a later agent's is there.
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == bound:
                    self.path.unlink()

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

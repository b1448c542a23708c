"""A client of torch's `TCPStore` in plain asyncio, for the agent, which never imports torch (seconds of import and
hundreds of megabytes, in a process that must start and react in milliseconds).

It speaks the few requests the agent needs (set, get, check, wait, queue push) of the store's wire protocol as
torch 2.13 speaks it: a request is a one-byte query type followed by its arguments, a string or a value as a 64-bit
little-endian length and its bytes, a count or an integer as 64 bits. Keys carry the leading `/` that torch's own
client adds, so that both see the same key space. `tests/test_torch_store.py` runs it against torch's server: a
change of the protocol in a new torch fails there first.
"""

from __future__ import annotations

import secrets
import struct
from types import TracebackType

import anyio
from anyio.abc import SocketStream

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = range(7)
CANCEL_WAIT, PING, QUEUE_PUSH = 12, 13, 14
MAGIC = 0x3C85F7CE
READY = 0
STOP_WAITING, WAIT_CANCELED = 0, 1
KEY_PREFIX = "/"  # torch's client prefixes every user key with it


class StoreError(Exception):
    """The store could not be reached, or answered what this client does not understand."""


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class TorchStore:
    """One connection to a TCPStore server. Not for concurrent use: one request at a time."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._buffer = b""

    @classmethod
    async def connect(cls, host: str, port: int, timeout_s: float = 5.0) -> TorchStore:
        """Connect and pass the server's handshake (the magic number, then a ping it echoes)."""
        try:
            with anyio.fail_after(timeout_s):
                stream = await anyio.connect_tcp(host, port)
                store = cls(stream)
                nonce = secrets.randbits(32)
                await stream.send(struct.pack("<BI", VALIDATE, MAGIC) + struct.pack("<BI", PING, nonce))
                echoed = struct.unpack("<I", await store._read(4))[0]
        except (OSError, TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise StoreError(f"no TCPStore at {host}:{port}: {exc or type(exc).__name__}") from None
        if echoed != nonce:
            await stream.aclose()
            raise StoreError(f"{host}:{port} is not a TCPStore this client understands (ping {echoed:#x})")
        return store

    async def __aenter__(self) -> TorchStore:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._buffer += await self._stream.receive()
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    async def _request(self, query: int, *parts: bytes) -> None:
        try:
            await self._stream.send(bytes([query]) + b"".join(parts))
        except (OSError, anyio.BrokenResourceError) as exc:
            raise StoreError(f"the TCPStore went away: {exc or type(exc).__name__}") from None

    async def _answer(self, size: int) -> bytes:
        try:
            return await self._read(size)
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise StoreError(f"the TCPStore went away: {exc or type(exc).__name__}") from None

    async def set(self, key: str, value: str) -> None:
        await self._request(SET, _string((KEY_PREFIX + key).encode()), _string(value.encode()))

    async def queue_push(self, key: str, value: str) -> None:
        await self._request(QUEUE_PUSH, _string((KEY_PREFIX + key).encode()), _string(value.encode()))

    async def check(self, *keys: str) -> bool:
        """Are all `keys` set?"""
        await self._request(CHECK, struct.pack("<Q", len(keys)), *(_string((KEY_PREFIX + k).encode()) for k in keys))
        return (await self._answer(1))[0] == READY

    async def wait(self, key: str, timeout_s: float) -> bool:
        """Wait until `key` is set: True, or False after `timeout_s` (the wait is then cancelled on the server)."""
        await self._request(WAIT, struct.pack("<Q", 1), _string((KEY_PREFIX + key).encode()))
        with anyio.move_on_after(timeout_s):
            return (await self._answer(1))[0] == STOP_WAITING
        await self._request(CANCEL_WAIT)
        # The key may have come just before the cancel: its STOP_WAITING then precedes WAIT_CANCELED.
        answers = []
        with anyio.fail_after(5.0):
            while not answers or answers[-1] != WAIT_CANCELED:
                answers.append((await self._answer(1))[0])
        return STOP_WAITING in answers[:-1]

    async def get(self, key: str) -> str:
        """The value of `key`, which must be set (see `wait`)."""
        await self._request(GET, _string((KEY_PREFIX + key).encode()))
        size = struct.unpack("<Q", await self._answer(8))[0]
        return (await self._answer(size)).decode()

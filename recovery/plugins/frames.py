"""The worker channel: pickled frames, each behind its 8-byte length, over a pipe.

Policy contexts hold read-only mappings (`types.MappingProxyType`), which pickle does not take: they travel as the
dicts they wrap, and arrive as read-only mappings again.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from types import MappingProxyType
from typing import Any, BinaryIO

HEADER = struct.Struct("!Q")


def _read_only(mapping: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(mapping)


def _reduce_proxy(proxy: MappingProxyType[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return _read_only, (dict(proxy),)


_TABLE = copyreg.dispatch_table.copy()
_TABLE[MappingProxyType] = _reduce_proxy


def dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _TABLE
    pickler.dump(value)
    return buffer.getvalue()


def frame(value: Any) -> bytes:
    data = dumps(value)
    return HEADER.pack(len(data)) + data


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's value from a blocking stream; None at its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)

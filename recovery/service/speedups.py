"""Process-wide tuning for the daemon's hot path, applied by `recovery-daemon` at start (never on import).

- nats-py parses every delivered message's header block in Python, checking each character of each header
  name with a generator: a fifth of the daemon's time per event at 20,000 events/s. `fast_header_lines` is the
  same function (same output for every input, including the odd cases its docstring names) with the
  whitespace check as one regular expression. It replaces nats-py's only if it agrees with it on a set of
  samples, so a nats-py that changes the function's contract keeps its own.
- The garbage collector: after start the engine's long-lived state is frozen out of the collector's view
  (`gc.freeze`), and young collections run less often, so a collection of the whole heap does not stall a
  decision for tens of milliseconds.
"""

from __future__ import annotations

import gc
import logging
import re

from nats.aio.client import Client

logger = logging.getLogger("recovery.speedups")  # the name operators filter on: kept since it moved

_NAME_SPACE = re.compile(r"[\s]")
_CRLF = b"\r\n"
_SAMPLES = (
    b"Nats-Msg-Id: abc-1\r\n\r\n",
    b"Nats-Msg-Id:abc\r\nNats-Expected-Stream:\tX \r\n\r\n",
    b"Bad Name: v\r\nOk: w\r\nno-colon\r\n\r\n",
    b"K\xe9y: v\r\nk: \xff\xfe\r\n: empty\r\n \tTrim \t: x \r\n",
    b"A\x1cB: v\r\nA\x85B: v\r\nA: 1\r\nA: 2\r\n",
)


def fast_header_lines(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _NAME_SPACE.search(key):
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def apply() -> list[str]:
    """Apply the tuning; returns what was applied."""
    applied = []
    try:
        original = Client.__dict__.get("_parse_header_lines")
        function = getattr(original, "__func__", None)
        if function is not None and all(function(s) == fast_header_lines(s) for s in _SAMPLES):
            Client._parse_header_lines = staticmethod(fast_header_lines)  # type: ignore[method-assign]
            applied.append("nats-headers")
    except Exception:  # a tuning, never a reason not to start
        logger.debug("nats header parser left as it is", exc_info=True)
    gc.set_threshold(50_000, 50, 100)
    applied.append("gc-threshold")
    return applied


def freeze() -> None:
    """After restoring state: keep what exists now out of every later collection."""
    gc.collect()
    gc.freeze()

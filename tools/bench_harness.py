"""What every bench of `python tools/bench.py` shares: where the checkout is, the JSON lines of the figures, notes on
stderr, the processes a bench starts seeing this checkout's code, and SIGTERM unwinding a bench as Ctrl-C does.

The harness is this module and the `bench_harness_*` modules beside it (the daemon and NATS, the launchers, the
fleet's agents, the end-to-end bench's phases, the engine's workload); a bench imports them and never another bench:
`tools/bench.py` puts the benches together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import orjson

ROOT = Path(__file__).resolve().parents[1]

Emit = Callable[[str, str, float, str], None]
"""a figure: (bench, metric, value, unit)"""


def emit(bench: str, metric: str, value: float, unit: str) -> None:
    """One figure, one JSON object on a line of stdout, flushed at once (a long bench's figures arrive as made)."""
    line = orjson.dumps({"bench": bench, "metric": metric, "value": value, "unit": unit})
    sys.stdout.write(line.decode() + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sig(value: float, digits: int = 4) -> float:
    """Round to a few significant digits: medians of noisy rates carry no more."""
    return float(f"{value:.{digits}g}")


def environment() -> dict[str, str]:
    """Every process started here imports this checkout's code."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a CI timeout, `kill`) ends the bench through its `finally` blocks, as Ctrl-C does, instead of
    leaving its processes running."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def unwind(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

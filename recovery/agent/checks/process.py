"""A check's own process: run to its end, its output's last lines kept, killed with its children when the check's
budget ends (the caller's cancellation)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

import anyio

TAIL_BYTES = 4096  # enough for the last lines a `node.checked` result keeps (1 KiB)


async def run_to_end(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(exit status, the end of its standard output and error together); a negative status is the signal that
    ended it. Started in a session of its own, so that a shell's children die with it when the budget ends."""
    process = await anyio.open_process(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, env=dict(env) if env is not None else None,
                                       start_new_session=True)
    try:
        tail = b""
        assert process.stdout is not None
        async for chunk in process.stdout:
            tail = (tail + chunk)[-TAIL_BYTES:]
        return await process.wait(), tail.decode(errors="replace")
    finally:
        if process.returncode is None:  # cancelled: past its budget, or the agent stops
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()


def last_lines(output: str, count: int = 3) -> str:
    """The last `count` non-empty lines of a check's output, joined by ' | ' (a `saw` is one line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return " | ".join(lines[-count:])

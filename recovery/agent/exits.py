"""Why the node's agent last stopped, kept in its runtime directory for the agent that starts after it.

An agent that dies of an exception looks, from the control plane, like any host that fell silent (`agent of n0
silent`): the record of the crash lives only in that agent's own log. So the agent writes why it stops (the
exception and where it was raised, or the signal that stopped it) into `agent-exit.json` as it goes, and the next
agent on the node says it in its first event (`node.ready` or `node.joined`, `last_exit`), where the postmortem
names it as the incident's root cause. An agent that could write nothing (SIGKILL, out of memory, its host down)
left the file saying it was running: that is said too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sysconfig
import time
import traceback
from pathlib import Path

import orjson

_STDLIB = sysconfig.get_paths()["stdlib"]
EXIT_FILE = "agent-exit.json"
ENDED_WITHOUT_A_WORD = "ended without saying why: killed (SIGKILL, out of memory) or its host went down"
MAX_REASON = 1024
"""the event field's bound (events.kinds.NodeReady.last_exit)"""
_UNSAYABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
"""what the event's free text refuses, and line breaks: one line, whatever the exception's message held"""


def crash_reason(exc: BaseException) -> str:
    """`RuntimeError: boom (agent.py:412 in _carry_out)`: the first exception that is not a group (anyio's task
    groups wrap what a task raised), and the innermost frame of ours it was raised in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    frames = traceback.extract_tb(exc.__traceback__)
    # the innermost frame outside the libraries: where our code (or a plugin's) went wrong, not where anyio or
    # nats-py passed the exception through
    ours = [f for f in frames if "site-packages" not in f.filename and not f.filename.startswith(_STDLIB)] or frames
    place = f" ({Path(ours[-1].filename).name}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    message = _UNSAYABLE.sub(" ", str(exc)).strip()
    what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"crashed: {what}{place}"[:MAX_REASON]


def record_exit(runtime_dir: Path, reason: str) -> None:
    """Keep why this agent stops, for the next one; a directory that cannot be written loses only this."""
    with contextlib.suppress(OSError):
        (runtime_dir / EXIT_FILE).write_bytes(orjson.dumps({"reason": reason[:MAX_REASON], "at_ns": time.time_ns(),
                                                            "pid": os.getpid()}))


def take_last_exit(runtime_dir: Path) -> str | None:
    """Why the previous agent on this node stopped (None: none ran here before), and this agent marked as running,
    so that if it dies unable to write, the next one says so."""
    path = runtime_dir / EXIT_FILE
    try:
        kept = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        kept = None
    except (OSError, orjson.JSONDecodeError):
        kept = {}  # cut short as it was written: the agent died writing it
    reason = None
    if isinstance(kept, dict):
        said = kept.get("reason")
        reason = _UNSAYABLE.sub(" ", said)[:MAX_REASON] if isinstance(said, str) and said else ENDED_WITHOUT_A_WORD
    with contextlib.suppress(OSError):
        runtime_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps({"running": True, "pid": os.getpid(), "since_ns": time.time_ns()}))
    return reason

"""A plugin's worker process: `python -m recovery.plugins.worker`, started by `recovery.plugins.PolicyWorkers`.

It reads the policy (pickled, as the daemon's snapshots hold it) from stdin, says it is ready, then answers calls
one at a time: (method, argument) in, ("answer", value) or ("raised", problem) out. Whatever the plugin prints goes
to stderr, never into the channel. It ends when its host closes stdin, or is killed when a call overruns.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from recovery.core.overruns import raised_problem
from recovery.plugins.frames import frame, read_frame


def serve() -> int:
    channel_in = sys.stdin.buffer
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    sys.stdout = sys.stderr  # a plugin's print must not corrupt the channel
    try:
        policy = read_frame(channel_in)
    except Exception as exc:  # the policy's class cannot be loaded here: the host says so for every call
        channel_out.write(frame(("broken", f"could not be loaded in its worker: {type(exc).__name__}: {exc}")))
        return 1
    channel_out.write(frame(("ready", None)))
    while True:
        request = read_frame(channel_in)
        if request is None:
            return 0
        method, argument = request
        reply: tuple[str, Any]
        try:
            reply = ("answer", getattr(policy, method)(argument))
        except Exception as exc:  # third-party code: its error travels back, named as it would be in-process
            reply = ("raised", raised_problem(exc))
        try:
            data = frame(reply)
        except Exception as exc:  # an answer that cannot travel is no answer the engine could take either
            data = frame(("raised", f"answered {reply[1]!r}, which cannot be sent back from its worker: "
                                    f"{type(exc).__name__}: {exc}"))
        channel_out.write(data)


if __name__ == "__main__":
    sys.exit(serve())

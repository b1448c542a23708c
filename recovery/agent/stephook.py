"""The ranks' step hook, from the agent's side: the environment that starts it in a rank's interpreter.

The hook itself is the client's (`recovery.client.steps`, run by `recovery/client/startup/sitecustomize.py`); the
agent shares no code with it, only this contract: the start-up directory first on `PYTHONPATH`, `RECOVERY_STEP_HOOK`
`1` to install it (a job's `0` keeps it off), and `RECOVERY_STEP_HOOK_PID`, which the hook sets to the pid of the
process it counts (a child interpreter inherits the environment, not the rank)."""

from __future__ import annotations

import os
from pathlib import Path

HOOK_ENV = "RECOVERY_STEP_HOOK"
OWNER_ENV = "RECOVERY_STEP_HOOK_PID"
STARTUP = str(Path(__file__).resolve().parents[1] / "client" / "startup")
"""the directory whose `sitecustomize` installs the hook"""


def with_step_hook(env: dict[str, str], enabled: bool) -> dict[str, str]:
    """`env` of a rank (or of a standby that becomes one) with the hook on, if `enabled` and the job did not turn it
    off; never with an owner of the agent's own environment (the process to be started is its own)."""
    env = {k: v for k, v in env.items() if k != OWNER_ENV}
    if enabled and env.get(HOOK_ENV) != "0":
        env[HOOK_ENV] = "1"
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = STARTUP + (os.pathsep + path if path else "")
    return env

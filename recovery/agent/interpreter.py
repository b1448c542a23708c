"""The warm interpreter of a standby (`recovery/agent/standby.py`): a Python process that imports what the job's
ranks will import, says so, and waits for the agent to hand it a rank. Standard library only: whatever this module
imports stays in the rank's process.

    python -m recovery.agent.interpreter torch torch.distributed torch._dynamo recovery.client.torch:warm_up

Each argument is a module to import, or `module:function` to import and call with no arguments (a warm-up: what a
new process pays once, paid before the rank needs it). It imports under `SCHED_IDLE`, on CPU time no other process
wants (unless `RECOVERY_STANDBY_IDLE=0`: a spare's, beside no rank), and writes `ready <seconds it took>` on its
standard output once they are done, then reads one JSON line on its standard input: `{"argv": [script, *args] or
["-m", module, *args], "cwd": ..., "env": {...},
"output": path}`. It then becomes the rank: its output goes to `output`, its standard input to /dev/null, its
environment and working directory are the rank's, and the script runs as `__main__` with the `sys.argv` and
`sys.path[0]` that `python script.py` (or `python -m module`) would have given it. The end of its standard input
before a hand-over (the agent is gone) ends it quietly.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import sys
import time
from collections.abc import Callable

IDLE_ENV = "RECOVERY_STANDBY_IDLE"
OWNER_ENV = "RECOVERY_STEP_HOOK_PID"  # `recovery.agent.stephook`'s, not imported: this runs with the rank's imports


def _scheduled(policy: str) -> None:
    """Every thread of this process under `policy` (`SCHED_IDLE`, `SCHED_OTHER`), where the platform has it. Idle
    while it imports and waits: it runs only on CPU time the node's ranks leave, so a job's standbys cost its
    training nothing; the rank it becomes runs as any process does (an unprivileged process may go back to
    `SCHED_OTHER` at its own nice value)."""
    if not hasattr(os, policy):
        return
    try:
        tasks = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    for tid in tasks:
        with contextlib.suppress(OSError):  # a thread gone meanwhile, or a platform that refuses: it runs as it was
            os.sched_setscheduler(tid, getattr(os, policy), os.sched_param(0))


def _taken() -> bool:
    """The agent's hand-over is on standard input already (or the agent is gone): this interpreter is a rank's."""
    try:
        return bool(select.select([sys.stdin], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _autogroup(nice: int, within_s: float = 2.0, unless: Callable[[], bool] | None = None) -> None:
    """This session's autogroup at `nice`, where the kernel groups by session (`kernel.sched_autogroup_enabled`).
    The standby runs in a session of its own, so the kernel schedules it as a group of its own, weighed against
    each rank's session as an equal: `SCHED_IDLE` inside a group nothing else is in yields to nobody, and four
    standbys importing torch took a third of a two-core node's training time. At 19 the group weighs 15 to a
    rank's 1,024. Raising the value is any process's right and so is bringing it back to 0 (only below 0 asks for
    privilege), so the rank it becomes weighs what a cold start's session does. The kernel takes one such change
    a tenth of a second from an unprivileged process, across the whole host (EAGAIN meanwhile): tried again until
    `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(f"{nice}\n")
            return
        except BlockingIOError:
            if time.monotonic() >= deadline or (unless is not None and unless()):
                return
            time.sleep(0.02)  # the kernel's rate limit: another session changed its group a moment ago
        except OSError:  # no autogroups (a kernel without them, or with them off): nothing to change
            return


def main() -> None:
    started = time.monotonic()
    if os.environ.get(IDLE_ENV, "1") != "0":  # a spare's standby runs beside no rank: it imports at full speed
        _scheduled("SCHED_IDLE")
        _autogroup(19, unless=_taken)
        if _taken():  # taken before it went idle: the agent's promotion came first and was undone just now
            _scheduled("SCHED_OTHER")
            _autogroup(0, within_s=1.0)
    for preload in sys.argv[1:]:
        module, _, function = preload.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    ready = f"ready {time.monotonic() - started:.3f}\n"
    sys.stderr.write(ready)  # for whoever reads the standby's log
    sys.stdout.write(ready)
    sys.stdout.flush()
    line = sys.stdin.buffer.readline()
    if not line:
        return
    become(json.loads(line))


def become(rank: dict[str, object]) -> None:
    _scheduled("SCHED_OTHER")  # the threads the imports started too
    if os.environ.get(IDLE_ENV, "1") != "0":
        _autogroup(0, within_s=1.0)  # before the rank's environment replaces this one's
    argv = [str(a) for a in rank["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in rank["env"].items()}  # type: ignore[attr-defined]
    output = os.open(str(rank["output"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(devnull)
    os.close(output)
    owner = os.environ.get(OWNER_ENV)
    os.environ.clear()  # through unsetenv/putenv: the C library (and torch's C++) sees the rank's environment too
    os.environ.update(env)
    if owner is not None:
        os.environ[OWNER_ENV] = owner  # the step hook this interpreter installed at its start counts the rank now
    cwd = rank.get("cwd")
    if cwd:
        os.chdir(str(cwd))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

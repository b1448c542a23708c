"""The warm interpreters of a job's standbys (`recovery/agent/standby.py`): one parent per job and node imports what
the job's ranks will import, once, then forks a standby each time the agent asks; a standby runs the warm-ups, says
so, and waits for the agent to hand it a rank. Standard library only: whatever this module imports stays in the
rank's process.

    python -m recovery.agent.interpreter torch torch.distributed torch._dynamo recovery.client.torch:warm_up

Each argument is a module to import, or `module:function` to import and call with no arguments (a warm-up: what a
new process pays once, paid before the rank needs it). The parent imports the modules; each standby, once forked,
calls the warm-ups (they may start thread pools or a GPU context, which a fork does not carry over). Both run under
`SCHED_IDLE`, in a scheduling group of the least weight, on CPU time no other process wants (unless
`RECOVERY_STANDBY_IDLE=0`: a spare's, beside no rank). Why one parent: a job whose faults restart every rank keeps
a standby for each rank on the node, and four interpreters importing torch each on a two-core node cost its
training a third of its time (1.43x torchrun's fault-free run); forked from one, they share its imports' pages and
its CPU time, paid once.

The parent's standard input is a Unix packet socket from the agent: each packet `fork` carries one descriptor, a
socket that becomes the new standby's standard input and output. The standby writes `pid <its pid>`, then `ready
<seconds>` once its warm-ups are done, then reads one JSON line: `{"argv": [script, *args] or ["-m", module, *args],
"cwd": ..., "env": {...}, "output": path}`. It then becomes the rank: its output goes to `output`, its standard input
to /dev/null, its environment and working directory are the rank's, it leads a session of its own (as a rank started
cold does), and the script runs as `__main__` with the `sys.argv` and `sys.path[0]` that `python script.py` (or
`python -m module`) would have given it. The parent waits for its standbys and writes `exited <status>` (a negative
status: the signal) on the standby's socket when one ends: the agent is not the rank's parent and learns its exit
status there. The end of a standby's socket before a hand-over (the agent let it go) ends it quietly; the end of the
parent's ends the parent once its standbys have ended.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
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


def _idle() -> bool:
    return os.environ.get(IDLE_ENV, "1") != "0"  # a spare's standbys run beside no rank: at full speed


def serve(control: socket.socket) -> int | None:
    """The parent's loop, its imports done: fork a standby for each `fork` packet, relay each standby's exit status,
    and return None once the agent's socket ended and no standby is left. In a standby, it returns the descriptor of
    the standby's socket (its stack unwinds to `main`, which makes it the standby). A standby's end wakes the loop
    through SIGCHLD and a pipe (`signal.set_wakeup_fd`), which every Linux has (pidfds need 5.3)."""
    children: dict[int, int] = {}  # pid -> the standby's socket
    woken, wake = os.pipe()
    os.set_blocking(woken, False)
    os.set_blocking(wake, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the signal writes to the wake-up pipe
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    listening = True
    while listening or children:
        try:
            readable, _, _ = select.select([woken, control.fileno()] if listening else [woken], [], [])
        except InterruptedError:
            continue
        if woken in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(woken, 512):
                    pass
            _reap(children)
        if control.fileno() not in readable:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, 64, 4)
        except OSError:
            message, fds = b"", []
        if not message:
            listening = False
        for given in fds if message.startswith(b"fork") else ():
            pid = os.fork()
            if pid == 0:  # the standby: nothing of the parent's but the imports
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (woken, wake, *children.values(), *(other for other in fds if other != given)):
                    os.close(fd)
                control.close()
                return given
            children[pid] = given
        for unused in fds if not message.startswith(b"fork") else ():
            os.close(unused)
    return None


def _reap(children: dict[int, int]) -> None:
    """Every standby that ended: its exit status on its socket, for the agent."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, None  # reaped elsewhere: its end, with no status to tell (the agent's is unknown)
        if done == 0:
            continue
        standby = children.pop(pid)
        if status is not None:
            with contextlib.suppress(OSError):  # nobody reads it (the agent let the standby go): nothing to tell
                os.write(standby, f"exited {os.waitstatus_to_exitcode(status)}\n".encode())
        os.close(standby)


def standby(fd: int, modules: list[str], imported_s: float) -> None:
    """A forked standby: its socket as standard input and output, a session of its own, the warm-ups, then the
    rank handed to it."""
    os.dup2(fd, 0)
    os.dup2(fd, 1)
    os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  # the process's own, as at a start
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    os.setsid()  # a session of its own: the agent signals it and all it starts as one, as a rank started cold
    if _idle():
        _scheduled("SCHED_IDLE")  # the parent may have been sped up for an earlier standby
        _autogroup(19, unless=_taken)  # the new session's group, which the kernel weighs as an equal
        if _taken():  # handed a rank already: the rank does not wait at the least weight
            _scheduled("SCHED_OTHER")
            _autogroup(0, within_s=1.0)
    _owned_by_this_process()
    _say(f"pid {os.getpid()}\n")
    started = time.monotonic()
    for preload in modules:
        module, _, function = preload.partition(":")
        if function:
            getattr(importlib.import_module(module), function)()
    ready = f"ready {imported_s + time.monotonic() - started:.3f}\n"
    sys.stderr.write(ready)  # for whoever reads the standby's log
    _say(ready)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    become(json.loads(line))


def _say(line: str) -> None:
    """A line to the agent; where the agent let this standby go before it was forked (its socket's other end is
    closed), the standby ends quietly, as at the end of its input."""
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except OSError:
        os._exit(0)  # nothing of a rank's to flush or clean up: the standby never became one


def _owned_by_this_process() -> None:
    """The step hook the parent installed at its start counts this process's steps now: it counts only the process
    it was installed in (a process a rank forks is not the rank), and a standby is a fork of that one."""
    steps = sys.modules.get("recovery.client.steps")
    if steps is not None and hasattr(steps, "adopt"):
        steps.adopt()


def main() -> None:
    started = time.monotonic()
    # CUDA cannot be used in a process forked after the driver was initialised, and torch's CUDA check
    # (`torch.cuda.is_available`) initialises it unless told to ask NVML: an import that checks must leave the
    # parent's forks able to use the GPU (the rank's own environment replaces this one at the hand-over)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if _idle():
        _scheduled("SCHED_IDLE")
        _autogroup(19)
    modules = sys.argv[1:]
    for preload in modules:  # a warm-up's module too: its function is each standby's to call
        importlib.import_module(preload.partition(":")[0])
    imported_s = time.monotonic() - started
    sys.stderr.write(f"imported {imported_s:.3f}\n")
    sys.stderr.flush()
    control = socket.socket(fileno=os.dup(0))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    fd = serve(control)
    if fd is not None:
        standby(fd, modules, imported_s)


def become(rank: dict[str, object]) -> None:
    _scheduled("SCHED_OTHER")  # the threads the imports started too
    if _idle():
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

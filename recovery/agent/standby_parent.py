"""A job's standby parent on this node and the standbys it forks, seen from the agent (`recovery.agent.interpreter`
is the other side): the parent imports what the job's ranks import, once, and forks a standby each time the agent
asks; a standby's socket carries its pid, its `ready`, the hand-over, and, from the parent, its exit status.

The agent is not a forked standby's parent, so the exit status of the rank it becomes comes from the standby
parent (`exited <status>` on the standby's socket). A parent that dies first leaves the status unknown: the rank's
end is then seen through a pidfd, as an adopted rank's is (`ForkedStandby.wait` returns None).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import anyio
from anyio.abc import Process, SocketStream

INTERPRETER = "recovery.agent.interpreter"


class StandbyLost(RuntimeError):
    """The standby ended, or its parent did before forking it: the rank starts cold."""


class StandbyParent:
    """One interpreter per job, node and thread settings that imported the job's modules and forks its standbys."""

    def __init__(self, process: Process, control: socket.socket, log: Path) -> None:
        self.process, self.control, self.log = process, control, log
        self.standbys: list[ForkedStandby] = []

    @classmethod
    async def start(cls, command: str, modules: list[str], cwd: str | None, env: dict[str, str],
                    log: Path) -> StandbyParent:
        """Start the parent in a session of its own, under the job's environment and working directory (what its
        imports read is what a cold start's would), its output to `log`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with log.open("ab") as output:
                process = await anyio.open_process([command, "-m", INTERPRETER, *modules], cwd=cwd, env=env,
                                                   stdin=theirs.fileno(), stdout=output, stderr=output,
                                                   start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours, log)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def fork(self) -> ForkedStandby:
        """Ask for one more standby; it is forked once the parent's imports are done (its pid comes then)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.control, [b"fork"], [theirs.fileno()])
        except OSError as exc:
            ours.close()
            raise StandbyLost(f"the standby parent (pid {self.process.pid}) is gone: {exc}") from exc
        finally:
            theirs.close()  # the parent holds it now; the standby's end is closed where the standby closes it
        standby = ForkedStandby(self, ours)
        # those whose end it told are forgotten: a job's parent forks a standby for every restart of its life
        self.standbys = [*(s for s in self.standbys if s.returncode is None), standby]
        return standby

    def promote(self) -> None:
        """Back to full speed: a rank waits on the rest of its imports (`interpreter._autogroup`)."""
        _full_speed(self.process.pid)

    async def close(self) -> bool:
        """Let the parent go: it ends once the standbys it forked have (a rank among them goes on to its end: the
        parent waits to tell its exit status), True then (the caller keeps this object until it has ended: the event
        loop kills a process whose handle is collected); one that forked no rank is killed, its imports maybe under
        way."""
        with contextlib.suppress(OSError):
            self.control.close()
        if any(standby.returncode is None and standby.handed_over for standby in self.standbys):
            return True  # it ends by itself after them, reaped by the event loop's child watcher
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.process.aclose()
        return False


class ForkedStandby:
    """A standby forked by a `StandbyParent`, through its socket: what `ranks` needs of a process (`pid`, `wait`,
    `returncode`) once it has become a rank."""

    def __init__(self, parent: StandbyParent, sock: socket.socket) -> None:
        self.parent = parent
        self.pid: int | None = None  # known once forked
        self.ready_s: float | None = None  # its imports and warm-ups, once it said `ready`
        self.returncode: int | None = None  # from its parent, once it ended
        self.handed_over = False
        self._socket = sock
        self._stream: SocketStream | None = None
        self._buffer = b""
        self._ended = False  # its socket ended: nothing more comes
        self._lock = anyio.Lock()

    async def _connection(self) -> SocketStream:
        if self._stream is None:
            self._stream = await SocketStream.from_socket(self._socket)
        return self._stream

    async def _next_line(self) -> None:
        """Read one line of the socket and keep what it says (lines come in this order: pid, ready, exited)."""
        stream = await self._connection()
        while b"\n" not in self._buffer:
            try:
                chunk = await stream.receive(4096)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                self._ended = True
                return
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        word, _, value = line.decode(errors="replace").partition(" ")
        with contextlib.suppress(ValueError):
            if word == "pid":
                self.pid = int(value)
            elif word == "ready":
                self.ready_s = float(value)
            elif word == "exited":
                self.returncode = int(value)

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done() and not self._ended:
            async with self._lock:  # one reader at a time; another's wait is re-checked after each line
                if done() or self._ended:
                    return
                await self._next_line()

    async def forked_or_ended(self) -> bool:
        """Until it is forked (True) or will never be (False)."""
        await self._until(lambda: self.pid is not None)
        return self.pid is not None

    async def forked(self) -> int:
        """Its pid, once forked; StandbyLost if it never will be (its parent is gone)."""
        if not await self.forked_or_ended() or self.pid is None:
            raise StandbyLost(f"the standby parent (pid {self.parent.process.pid}) ended before forking a standby "
                              f"(see {self.parent.log})")
        return self.pid

    @property
    def ended(self) -> bool:
        """Its socket ended: nothing more comes (it ended, or its parent did before forking it)."""
        return self._ended

    async def ready(self) -> bool:
        """Until it said `ready` (True) or ended (False)."""
        await self._until(lambda: self.ready_s is not None)
        return self.ready_s is not None

    async def hand_over(self, line: bytes) -> int:
        """Send the rank's line and end the standby's input; its pid."""
        stream = await self._connection()
        self.handed_over = True
        try:
            await stream.send(line)
            await stream.send_eof()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError) as exc:
            raise StandbyLost(f"the standby ended before its hand-over: {exc}") from exc
        return await self.forked()

    async def wait(self) -> int | None:
        """Its exit status, from its parent; None where the parent ended first (the rank's end then seen through a
        pidfd)."""
        await self._until(lambda: self.returncode is not None)
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.aclose()  # nothing more comes: the exit status was the last line
        if self.returncode is None and self.pid is not None:
            await until_gone(self.pid)
        return self.returncode

    def promote(self) -> None:
        if self.pid is not None:
            _full_speed(self.pid)

    async def aclose(self) -> None:
        """Let it go: a standby not yet handed a rank ends at the end of its input; one still warming is killed."""
        if self.pid is not None and not self.handed_over:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.aclose()
        else:
            self._socket.close()
        with contextlib.suppress(ValueError):
            self.parent.standbys.remove(self)


async def until_gone(pid: int, poll_s: float = 0.05) -> None:
    """Until `pid`, a process that is not this one's child, has exited: seen through a pidfd, readable then; on a
    kernel without pidfds (before 5.3), its /proc entry read every `poll_s` until it is gone or a zombie."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        return
    except OSError:
        while _running(pid):
            await anyio.sleep(poll_s)  # no pidfd to wait on: polling the process's state
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")  # the state, after the command name


def _full_speed(pid: int) -> None:
    """Every thread of `pid` back to `SCHED_OTHER`, and its session's scheduling group back to a rank's weight
    (tried once: the kernel takes one such change a tenth of a second from an unprivileged agent; the interpreter
    tries again itself)."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread gone meanwhile, or a platform that refuses
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text("0\n")


async def regroup(pid: int, within_s: float = 0.5) -> None:
    """`pid`'s session group back at nice 0, tried again while the kernel's rate limit refuses it (EAGAIN)."""
    with anyio.move_on_after(within_s):
        while True:
            try:
                Path(f"/proc/{pid}/autogroup").write_text("0\n")
                return
            except BlockingIOError:
                await anyio.sleep(0.02)  # another session changed its group a moment ago: the limit's tenth passes
            except OSError:  # no autogroups here, or the process is gone
                return


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


__all__ = ["INTERPRETER", "ForkedStandby", "StandbyLost", "StandbyParent", "regroup", "until_gone"]

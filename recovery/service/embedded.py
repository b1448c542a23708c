"""The embedded default: a local `nats-server -js` owned by the daemon when no NATS URL is configured.

The same `nats-server` process as the test fixture's (`recovery.log.nats_server`), plus what a service
needs. The server dies with the daemon even when the daemon is SIGKILLed (Linux parent-death
signal), a busy default port falls back to a free one, and the URL is written to `<data_dir>/nats.url`
so that `recovery-ctl` finds it.

The parent-death signal is set by a small exec shim (`python -c`, then `exec nats-server`), not by a
`preexec_fn`: Python code between fork and exec in a process that runs threads can deadlock on a lock another
thread held at the fork. And the daemon starts the server from its event loop's thread, which lives as long as
the daemon: the signal follows the thread that forked, so a worker thread that exits would take the server down.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from pathlib import Path
from typing import Any

from recovery.log.datadir import LOCK_FILE, URL_FILE
from recovery.log.nats_server import NatsProcess, free_port, port_free

logger = logging.getLogger("recovery.embedded")  # the name operators filter on: kept since it moved
__all__ = ["LOCK_FILE", "URL_FILE", "DataDirInUse", "DataDirLock", "EmbeddedNats"]


class DataDirInUse(RuntimeError):
    """Another process holds the data directory: two embedded nats-servers on one JetStream store would corrupt
    it, and the second would overwrite the first's `nats.url`."""


class DataDirLock:
    """A daemon's hold on its data directory: an advisory `flock` on `daemon.lock`, which the kernel drops when the
    process ends, however it ends, so a SIGKILLed daemon never leaves a stale lock behind."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the directory, or raise `DataDirInUse` naming the holder's pid."""
        if self._fd is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(f"data directory {self.data_dir} is in use by another recovery-daemon (pid "
                               f"{holder}), whose embedded nats-server owns the JetStream store there: give each "
                               f"daemon its own --data-dir, or point them all at one NATS with --nats-url") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, kept across the exec below
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the daemon died before the signal was set: nobody to serve
os.execv(sys.argv[2], sys.argv[2:])
"""
"""run by `python -I -S -c` with the daemon's pid and the server's command line"""


class EmbeddedNats(NatsProcess):
    """`nats-server -js` in `data_dir/jetstream`, logging to `data_dir/nats-server.log`."""

    name = "embedded nats-server"

    def __init__(self, data_dir: str | Path, port: int = 4222, host: str = "127.0.0.1") -> None:
        data = Path(data_dir)
        if port == 0 or not port_free(host, port):
            if port:
                logger.warning("port %d is busy: the embedded nats-server takes a free port", port)
            port = free_port(host)
        super().__init__(data / "jetstream", port=port, host=host, log_file=data / "nats-server.log")
        self.data_dir = data
        self.url_file = data / URL_FILE

    def command(self) -> list[str]:
        server = super().command()
        if not sys.platform.startswith("linux"):
            return server  # no parent-death signal elsewhere: a SIGKILLed daemon leaves its server running
        return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *server]

    def _popen_options(self) -> dict[str, Any]:
        # Its own session: a terminal's Ctrl-C goes to the daemon only, which stops the server in its turn.
        return {"start_new_session": True}

    def start(self, timeout: float = 15.0) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._start(timeout)
        self._started()

    async def start_async(self, timeout: float = 15.0) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        await super().start_async(timeout)
        self._started()

    def _started(self) -> None:
        self.url_file.write_text(self.url + "\n")
        logger.info("embedded nats-server ready", extra={"fields": {"url": self.url, "store": str(self.store_dir)}})

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        self._stopped()

    async def stop_async(self, timeout: float = 15.0) -> None:
        try:
            await super().stop_async(timeout)
        finally:
            self._stopped()

    def _stopped(self) -> None:
        with contextlib.suppress(OSError):
            if self.url_file.read_text().strip() == self.url:
                self.url_file.unlink()

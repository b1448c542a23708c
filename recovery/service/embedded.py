"""The embedded default: a local `nats-server -js` owned by the daemon when no NATS URL is configured.

The same `nats-server` process as the test fixture's (`recovery.log.nats_server`), plus what a service
needs. The server dies with the daemon even when the daemon is SIGKILLed (Linux parent-death
signal), and the URL is written to `<data_dir>/nats.url` so that `recovery-ctl` finds it.

Its URL is the deployment's: agents and `recovery-ctl` are configured with it, so a restarted daemon serves the same
one or does not start. `embedded_port` names the port; with 0 (any free port) the first start picks one and
`nats.url`, which outlives the daemon, keeps it for every later start. A port still held when the server starts
(the old server, which the parent-death signal stops a moment after a SIGKILLed daemon, is still shutting down) is
waited for, up to `PORT_WAIT_S`; then the start is refused, naming the port, rather than moved to another that no
client knows. A port whose old connections linger in TIME_WAIT is free: nats-server binds with SO_REUSEADDR, and so
does the check (`recovery.log.nats_server.port_free`).

The parent-death signal is set by a small exec shim (`python -c`, then `exec nats-server`), not by a
`preexec_fn`: Python code between fork and exec in a process that runs threads can deadlock on a lock another
thread held at the fork. And the daemon starts the server from its event loop's thread, which lives as long as
the daemon: the signal follows the thread that forked, so a worker thread that exits would take the server down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio

from recovery.log.datadir import URL_FILE
from recovery.log.nats_server import NatsProcess, free_port, port_free
from recovery.service.datadir import StartRefused

logger = logging.getLogger("recovery.embedded")  # the name operators filter on: kept since it moved
PORT_WAIT_S = 15.0
"""how long a start waits for its port to be released (an old server still shutting down) before it is refused"""
PORT_POLL_S = 0.05


class EmbeddedPortBusy(StartRefused):
    """The embedded server's port stayed held by another process: serving another would strand its clients."""


def remembered_port(url_file: Path, host: str) -> int | None:
    """The port of the URL an earlier start served on `host` (`nats.url`), if any."""
    with contextlib.suppress(OSError, ValueError):
        url = urlsplit(url_file.read_text().strip())
        if url.hostname == host and url.port:
            return url.port
    return None



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

    def __init__(self, data_dir: str | Path, port: int = 4222, host: str = "127.0.0.1",
                 port_wait_s: float = PORT_WAIT_S) -> None:
        data = Path(data_dir)
        url_file = data / URL_FILE
        remembered = remembered_port(url_file, host)
        if port == 0:
            port = remembered or free_port(host)  # any port the first time; the same one ever after
        elif remembered is not None and remembered != port:
            logger.warning("embedded_port is %d, but an earlier start served port %d: clients configured with %s "
                           "must be given the new URL", port, remembered, url_file.read_text().strip())
        super().__init__(data / "jetstream", port=port, host=host, log_file=data / "nats-server.log")
        self.data_dir = data
        self.url_file = url_file
        self.port_wait_s = port_wait_s
        self._port_waited = False

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
        deadline = time.monotonic() + self.port_wait_s
        while not port_free(self.host, self.port):
            self._check_port(deadline)
            time.sleep(PORT_POLL_S)  # polling interval of a deadline-bounded wait for the port
        self._start(timeout)
        self._started()

    async def start_async(self, timeout: float = 15.0) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.port_wait_s
        while not port_free(self.host, self.port):
            self._check_port(deadline)
            await anyio.sleep(PORT_POLL_S)  # polling interval of a deadline-bounded wait for the port
        await super().start_async(timeout)
        self._started()

    def _check_port(self, deadline: float) -> None:
        """Called while the port is held: refuse once the deadline has passed (said at the first call)."""
        if not self._port_waited:
            self._port_waited = True
            logger.info("port %d is held: waiting up to %gs for it (a server shutting down?)", self.port,
                        self.port_wait_s)
        if time.monotonic() >= deadline:
            raise EmbeddedPortBusy(
                f"port {self.port} of the embedded nats-server is held by another process after {self.port_wait_s:g}s: "
                f"it must serve {self.url}, the URL its clients use (kept in {self.url_file}); stop what holds the "
                f"port, or set embedded_port to another and give the clients the new URL")

    def _started(self) -> None:
        self.url_file.write_text(self.url + "\n")
        logger.info("embedded nats-server ready", extra={"fields": {"url": self.url, "store": str(self.store_dir)}})

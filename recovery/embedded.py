"""The embedded default: a local `nats-server -js` owned by the daemon when no NATS URL is configured.

The production twin of `recovery.testing.NatsServer`: same binary lookup and readiness check, plus what a
service needs. The server dies with the daemon even when the daemon is SIGKILLed (Linux parent-death
signal), a busy default port falls back to a free one, and the URL is written to `<data_dir>/nats.url`
so that `recovery-ctl` finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from recovery.testing import POLL_INTERVAL_S, NatsServer, free_port

logger = logging.getLogger(__name__)
URL_FILE = "nats.url"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedNats(NatsServer):
    """`nats-server -js` in `data_dir/jetstream`, logging to `data_dir/nats-server.log`."""

    def __init__(self, data_dir: str | Path, port: int = 4222, host: str = "127.0.0.1") -> None:
        data = Path(data_dir)
        if port == 0 or not port_free(host, port):
            if port:
                logger.warning("port %d is busy: the embedded nats-server takes a free port", port)
            port = free_port(host)
        super().__init__(data / "jetstream", port=port, host=host, log_file=data / "nats-server.log")
        self.data_dir = data
        self.url_file = data / URL_FILE

    def start(self, timeout: float = 15.0) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log = self.log_file.open("ab")
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent, start_new_session=True,  # a terminal's Ctrl-C goes to the daemon only
        )
        deadline = time.monotonic() + timeout
        while not self._ready():
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise RuntimeError(f"embedded nats-server exited with {code}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"embedded nats-server not ready within {timeout}s:\n{self.log_tail()}")
            time.sleep(POLL_INTERVAL_S)  # polling interval of a deadline-bounded wait
        self.url_file.write_text(self.url + "\n")
        logger.info("embedded nats-server ready", extra={"fields": {"url": self.url, "store": str(self.store_dir)}})

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        with contextlib.suppress(OSError):
            if self.url_file.read_text().strip() == self.url:
                self.url_file.unlink()

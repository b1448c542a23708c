"""The embedded default: a local `nats-server -js` owned by the daemon when no NATS URL is configured.

The same `nats-server` process as the test fixture's (`recovery.log.nats_server`), plus what a service
needs. The server dies with the daemon even when the daemon is SIGKILLed (Linux parent-death
signal), a busy default port falls back to a free one, and the URL is written to `<data_dir>/nats.url`
so that `recovery-ctl` finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from recovery.log.nats_server import NatsProcess, free_port, port_free

logger = logging.getLogger("recovery.embedded")  # the name operators filter on: kept since it moved
URL_FILE = "nats.url"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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

    def _popen_options(self) -> dict[str, Any]:
        # The server dies with the daemon; a terminal's Ctrl-C goes to the daemon only.
        return {"preexec_fn": _die_with_parent, "start_new_session": True}

    def start(self, timeout: float = 15.0) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._start(timeout)
        self.url_file.write_text(self.url + "\n")
        logger.info("embedded nats-server ready", extra={"fields": {"url": self.url, "store": str(self.store_dir)}})

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        with contextlib.suppress(OSError):
            if self.url_file.read_text().strip() == self.url:
                self.url_file.unlink()

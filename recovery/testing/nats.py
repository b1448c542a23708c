"""A real `nats-server` with JetStream, in a process, for tests (ours, policy authors', our tools').

    server = NatsServer(tmp_path / "nats")
    server.start()            # returns once JetStream answers on the monitoring port
    ... connect to server.url ...
    server.stop()             # graceful; server.kill() for a crash
    server.start()            # same port, same store: an outage and a recovery
"""

from __future__ import annotations

import os

from recovery.log.nats_server import NatsProcess, free_port

__all__ = ["NatsServer", "free_port"]


class NatsServer(NatsProcess):
    """One `nats-server -js` process on free ports (unless given) with its store in `store_dir`, so that it can be
    stopped and started again (a NATS outage) with its JetStream data intact."""

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        monitor_port: int | None = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        extra_args: list[str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(store_dir, port=port if port is not None else free_port(host), monitor_port=monitor_port,
                         host=host, binary=binary, extra_args=extra_args, log_file=log_file)
        # Ports we picked ourselves may be taken by someone else before the server binds them; until the server
        # first ran, another pair is as good. After that its clients know the port: a restart keeps it.
        self._may_move = port is None and monitor_port is None

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and return once JetStream is ready; raise with the server's log if it isn't
        ready by the deadline or exits first. Starting a running server is a no-op."""
        if self.running:
            return
        for _ in range(3 if self._may_move else 1):
            logged = self.log_file.stat().st_size if self.log_file.exists() else 0
            try:
                self._start(timeout)
            except RuntimeError:
                with self.log_file.open("rb") as log:
                    log.seek(logged)
                    taken = b"address already in use" in log.read()  # this attempt's own lines only
                if not (self._may_move and taken):
                    raise
                self.port, self.monitor_port = free_port(self.host), free_port(self.host)
                continue
            self._may_move = False
            return
        raise RuntimeError(f"nats-server found no free port:\n{self.log_tail()}")

    def __enter__(self) -> NatsServer:
        self.start()
        return self

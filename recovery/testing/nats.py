"""A real `nats-server` with JetStream, in a process, for tests (ours, policy authors', our tools'); and a cluster
of three routed on loopback.

    server = NatsServer(tmp_path / "nats")
    server.start()            # returns once JetStream answers on the monitoring port
    ... connect to server.url ...
    server.stop()             # graceful; server.kill() for a crash
    server.start()            # same port, same store: an outage and a recovery

    cluster = NatsCluster(tmp_path / "nats", size=3)
    cluster.start()           # every server up, and JetStream's meta group with a leader and every peer
    ... connect to cluster.url (all servers, comma-separated); create streams with num_replicas=3 ...
    cluster.servers[i].kill(); cluster.servers[i].start()
    cluster.stop()
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from recovery.log.nats_server import POLL_INTERVAL_S, NatsProcess, free_port

__all__ = ["NatsCluster", "NatsServer", "free_port"]


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


class NatsCluster:
    """`size` nats-servers with JetStream, routed to each other on loopback as one cluster (`recovery`), each with
    its own store under `root/s<i>`. Streams and buckets created with `num_replicas=size` live on all of them: one
    server lost (its leadership moves) loses nothing."""

    def __init__(self, root: str | os.PathLike[str], size: int = 3, host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        routes = [free_port(host) for _ in range(size)]
        self.names = [f"s{i}" for i in range(size)]
        self.servers = [
            NatsServer(self.root / f"s{i}", port=free_port(host), monitor_port=free_port(host), host=host,
                       extra_args=["--server_name", f"s{i}", "--cluster_name", "recovery",
                                   "--cluster", f"nats://{host}:{routes[i]}",
                                   "--routes", ",".join(f"nats://{host}:{r}" for j, r in enumerate(routes) if j != i)])
            for i in range(size)]

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated: a client that loses one goes on with another."""
        return ",".join(server.url for server in self.servers)

    def start(self, timeout: float = 60.0) -> None:
        """Start every server (each returns once its JetStream answers) and wait for the meta group: a leader, and
        every server a current peer of it (before that, a replicated stream cannot be placed)."""
        try:
            for server in self.servers:
                server.start(timeout)
            self.wait_formed(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_formed(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.formed():
            if time.monotonic() > deadline:
                raise TimeoutError("the JetStream meta group did not form:\n"
                                   + "\n".join(s.log_tail(10) for s in self.servers))
            time.sleep(POLL_INTERVAL_S * 10)  # polling interval of a deadline-bounded wait

    def formed(self) -> bool:
        """A meta leader that sees every other running server as a current peer."""
        running = [s for s in self.servers if s.running]
        for server in running:
            meta = self.jsz(server).get("meta_cluster") or {}
            if meta.get("leader") and len(meta.get("replicas") or []) == len(self.servers) - 1 and all(
                    r.get("current") for r in meta["replicas"]):
                return True
        return False

    @staticmethod
    def jsz(server: NatsServer, query: str = "") -> dict[str, Any]:
        """The server's JetStream monitoring report (empty if it does not answer)."""
        try:
            with urllib.request.urlopen(f"{server.monitor_url}/jsz{query}", timeout=2) as response:
                report: dict[str, Any] = json.loads(response.read())
                return report
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def leader_of(self, stream: str) -> NatsServer | None:
        """The server that leads `stream`'s replicas now, as a running server reports it."""
        for server in self.servers:
            if not server.running:
                continue
            for account in self.jsz(server, "?streams=true").get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    leader = (detail.get("cluster") or {}).get("leader")
                    if detail.get("name") == stream and leader in self.names:
                        return self.servers[self.names.index(leader)]
        return None

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

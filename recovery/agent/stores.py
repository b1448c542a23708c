"""The job stores an agent hosts (`rendezvous: agent`), one per port: jobs that name the same MASTER_PORT on the
same first node share one store process instead of racing for the port.

Sharing is safe because a job store keeps every job's keys under the job's run id (`recovery.client.torch`, and the
torch stores it serves per formation, `recovery.agent.rendezvous`): one store serves many jobs, as the platform's
`external` store does. Two stores on one port cannot both listen; before this, the second job's store died of
EADDRINUSE and its unhandled error took the agent, and with it every other job's ranks on the node.

A port another process holds is the job's problem only: `StoreUnavailable` names the port, and the agent reports the
job's failure to start, never crashes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import subprocess
import sys

import anyio
from anyio.abc import Process

logger = logging.getLogger("recovery.agent")

STORE_START_S = 60.0
"""how long a job store may take to listen (it imports torch, seconds on a busy host)"""
PORT_FREED_S = 10.0
"""how long a taken port is waited for: the store of the agent this one replaces ends when its stdin closes, and may
not have let go of the port yet"""
PORT_POLL_S = 0.2


class StoreUnavailable(Exception):
    """The job store of a job could not be served here: the job cannot start, the agent and its other jobs go on."""


class JobStores:
    """The job stores this agent serves, by port; each lives until the agent stops (its stdin closes with the agent,
    however the agent ends)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._stores: dict[int, Process] = {}
        self._jobs: dict[int, list[str]] = {}  # port -> the jobs that use its store, in the order they came
        self._lock = anyio.Lock()

    def jobs_on(self, port: int) -> list[str]:
        return list(self._jobs.get(port, []))

    async def serve(self, job: str, port: int, freed_s: float = 0.0) -> None:
        """Serve the store of `job` on `port`: the one already there for another job of this agent, or a new one;
        raise `StoreUnavailable` if none can listen there (within `freed_s`: a restarted agent waits for the old
        one's store to let go of the port)."""
        async with self._lock:  # two jobs submitted at once must not both start a store on the port
            running = self._stores.get(port)
            if running is not None and running.returncode is None:
                if job not in self._jobs[port]:
                    self._jobs[port].append(job)
                    logger.info("job store on port %d serves %s too (with %s)", port, job,
                                ", ".join(self._jobs[port][:-1]))
                return
            await self._until_free(job, port, freed_s)
            self._stores[port] = await self._start(job, port)
            self._jobs[port] = [job]

    async def _until_free(self, job: str, port: int, freed_s: float) -> None:
        # Said before torch is imported, and in words: a store that cannot bind only prints torch's trace and exits.
        deadline = anyio.current_time() + freed_s
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is free
                try:
                    probe.bind((self.host, port))
                    return
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise StoreUnavailable(f"the job store of {job} cannot listen on {self.host}:{port}: "
                                               f"{exc}") from None
            if anyio.current_time() >= deadline:
                raise StoreUnavailable(f"the job store of {job} cannot listen on {self.host}:{port}: another process "
                                       f"holds it (set the job's MASTER_PORT to a free port)")
            await anyio.sleep(PORT_POLL_S)  # polling the old owner's exit, within the deadline above

    async def _start(self, job: str, port: int) -> Process:
        try:
            store = await anyio.open_process(
                [sys.executable, "-m", "recovery.agent.rendezvous", "--host", self.host, "--port", str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        except OSError as exc:
            raise StoreUnavailable(f"the job store of {job} could not be started: {exc}") from None
        assert store.stdout is not None
        line = b""
        try:
            with anyio.fail_after(STORE_START_S):
                while not line.endswith(b"\n"):
                    line += await store.stdout.receive(1)
        except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await store.aclose()
            what = (f"did not listen within {STORE_START_S:g}s" if isinstance(exc, TimeoutError)
                    else f"exited ({store.returncode}) before it listened")
            raise StoreUnavailable(f"the job store of {job} on {self.host}:{port} {what}") from None
        logger.info("rendezvous store of %s: %s", job, line.decode().strip())
        return store

    async def aclose(self) -> None:
        for store in self._stores.values():
            with contextlib.suppress(Exception):
                await store.aclose()
        self._stores.clear()
        self._jobs.clear()

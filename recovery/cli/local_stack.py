"""What `recovery-run --standalone` starts on this host: a `recovery-daemon` on its embedded JetStream, a job store
off the agents (`python -m recovery.agent.rendezvous --serve`) and a `recovery-agent` per node (plus spares), each
a process in a session of its own (a terminal's Ctrl-C reaches `recovery-run` only, which stops them in order), its
output in the data directory. Every process started is stopped by its pid, however `recovery-run` ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from recovery.cli.ctl import CtlFailure, request
from recovery.log.nats_server import free_port
from recovery.service.embedded import URL_FILE

POLL_S = 0.05
START_TIMEOUT_S = 60.0


class StackFailed(Exception):
    """A process of the stack did not start."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalStack:
    """The daemon, the job store and the agents of a standalone run, under `data_dir`."""

    data_dir: Path
    nodes: list[str]
    spares: list[str]
    devices: int
    agent_flags: list[str] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    url: str = ""
    store_port: int = 0

    def runtime_dir(self, node: str) -> Path:
        return self.data_dir / "agents" / node

    def _start(self, name: str, args: list[str]) -> Child:
        log = self.data_dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    async def start(self, nc_factory: Any) -> Client:
        """Start everything and return a connection to the embedded NATS once the daemon answers and every agent
        has reported its node. `nc_factory(url)` connects."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        daemon_dir = self.data_dir / "daemon"
        url_file = daemon_dir / URL_FILE
        with contextlib.suppress(OSError):
            url_file.unlink()  # a previous run's
        # INFO: daemon.log tells what the daemon did (its server, its start, its stop, what it dead-lettered),
        # a line per change, never one per record
        daemon = self._start("daemon", ["-m", "recovery.cli.daemon", "--data-dir", str(daemon_dir),
                                        "--embedded-port", "0", "--http-port=-1", "--lease-ttl-s", "0",
                                        "--log-format", "text", "--log-level", "INFO"])
        self.store_port = free_port()
        store = self._start("job-store", ["-m", "recovery.agent.rendezvous", "--host", "127.0.0.1", "--port",
                                          str(self.store_port), "--serve"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (url_file.is_file() and url_file.read_text().strip()):
            self._check(daemon, deadline, "the daemon's embedded NATS")
            await asyncio.sleep(POLL_S)  # polling the daemon's start, within the deadline
        self.url = url_file.read_text().strip()
        while True:
            with contextlib.suppress(CtlFailure):
                reply = await request(self.url, "status", {}, 2.0)
                if reply.get("ok") and reply["status"].get("ready"):
                    break
            self._check(daemon, deadline, "the daemon to be ready")
            await asyncio.sleep(POLL_S)  # polling the daemon's readiness, within the deadline
        nc: Client = await nc_factory(self.url)
        reported: set[str] = set()

        async def on_node(msg: Msg) -> None:
            reported.add(msg.subject.split(".")[3])

        await nc.subscribe("recovery.ev.node.*.node.ready", cb=on_node)
        await nc.subscribe("recovery.ev.node.*.node.joined", cb=on_node)
        for node in [*self.nodes, *self.spares]:
            args = ["-m", "recovery.cli.agent", "--node", node, "--nats-url", self.url, "--runtime-dir",
                    str(self.runtime_dir(node)), "--devices", str(self.devices), "--store-host", "127.0.0.1",
                    "--preempt-linger-s", "0", "--log-level", "WARNING", *self.agent_flags]
            if node in self.spares:
                args.append("--spare")
            self._start(f"agent-{node}", args)
        while not reported >= {*self.nodes, *self.spares}:
            for child in self.children:
                self._check(child, deadline, "the agents to report their nodes")
            await asyncio.sleep(POLL_S)  # polling the agents' reports, within the deadline
        while "ready" not in store.log.read_text(errors="replace"):
            self._check(store, deadline, "the job store")
            await asyncio.sleep(POLL_S)  # polling the job store's start, within the deadline
        return nc

    @staticmethod
    def _check(child: Child, deadline: float, what: str) -> None:
        if child.proc.poll() is not None:
            raise StackFailed(f"{child.name} exited with {child.proc.returncode} while waiting for {what}:\n"
                              f"{child.tail()}")
        if time.monotonic() > deadline:
            raise StackFailed(f"timed out after {START_TIMEOUT_S:g}s waiting for {what}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """The agents first (they stop their ranks), then the job store and the daemon (and its NATS): SIGTERM,
        then SIGKILL to the session of what did not end in time."""
        agents = [c for c in self.children if c.name.startswith("agent-")]
        others = [c for c in self.children if c not in agents]
        for group in (agents, list(reversed(others))):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.proc.wait(timeout=5)

"""The local channel between a training process and its node's agent: line-delimited JSON on a Unix socket.

Messages from the process (`op`): `hello` (rank, pid, attempt), `heartbeat` (step), `step` (step; its compute time,
its loss and `skip`, the data named for it, if the script gave them), `checkpoint` (step, tier, shards, location),
`memory_saved` (step, shards, file: a checkpoint copied into the job's directory of the node's shared memory;
storage: where the agent persists it, or null; keep: how many of the rank's newest the agent keeps; held_for: the
rank of another node whose copy it is, kept here and never persisted), `joined` (the generation it re-formed its
process group in), `saved`/`save_failed` (answers to a save request), `join` (generation, pid: may this process join
that generation's process group?), `caps` (what the script wired up), `closing` (pid: the script is done), `exiting`
(pid: the interpreter exits, its status not known yet; no heartbeat comes while it ends). From the agent: `save`
(write a dying checkpoint at the next step boundary), `stop` (finish the step and exit), `join_ok`/`join_refused`
(generation). Nothing here blocks training for long: a send to an agent that is gone is dropped, and the channel
connects again at the next send.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

SOCKET_ENV = "RECOVERY_AGENT_SOCKET"
SEND_TIMEOUT_S = 1.0
"""the longest a send may block training when the agent does not read: then the message is dropped"""


class AgentChannel:
    """One connection to the agent, shared by the training thread and the heartbeat thread."""

    def __init__(self, path: str, on_message: Callable[[dict[str, Any]], None],
                 again: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        """`again()`: what to say first on every connection after the first (an agent restarted meanwhile knows
        nothing of what this process said to the one before: its capabilities)."""
        self.path = path
        self._on_message = on_message
        self._again = again
        self._connections = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._buffer = b""
        self.dropped = 0

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self._sock = sock
        self._buffer = b""
        self._connections += 1
        if self._connections > 1 and self._again is not None:
            try:
                for message in self._again():
                    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            except OSError:
                self._close_locked()
                return None
        return sock

    def send(self, message: dict[str, Any]) -> bool:
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            sock = self._connect()
            if sock is None:
                self.dropped += 1
                return False
            try:
                sock.sendall(line)
                return True
            except OSError:
                self._close_locked()
                self.dropped += 1
                return False

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for messages from the agent and hand each to `on_message`."""
        with self._lock:
            sock = self._sock
        if sock is None:
            # Not connected yet: the training thread's next send connects; until then there is nothing to read.
            threading.Event().wait(timeout)
            return
        try:
            readable, _, _ = select.select([sock], [], [], timeout)
            if not readable:
                return
            chunk = sock.recv(65536)
        except (OSError, ValueError):
            chunk = b""
        if not chunk:
            with self._lock:
                if self._sock is sock:
                    self._close_locked()
            return
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._on_message(message)

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

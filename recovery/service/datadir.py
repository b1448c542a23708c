"""A daemon's data directory: one daemon process holds it at a time, whatever its flags.

The directory holds the embedded nats-server's JetStream store and the URL it serves (`nats.url`), and it names the
daemon's default instance (`recovery.service.lease.default_instance`). Two daemons on it would share both: two
embedded servers on one store corrupt it, and two daemons of one instance name take each other's lease (the second
takes it back at once as "its own", the first stops and, with an embedded server, takes the log down with it). So the
first thing a daemon does, before it takes a port or connects anywhere, is to take the directory's lock, with an
embedded server or with `--nats-url` alike; a second daemon is refused, naming the first one's pid.

The lock is an advisory `flock` on `daemon.lock`, which the kernel drops when the process ends, however it ends, so a
SIGKILLed daemon never leaves a stale lock behind. Within one process the lock is shared: a partitioned daemon runs
one `Daemon` per partition it owns, all on the process's directory.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from recovery.log.datadir import LOCK_FILE

_held: dict[Path, tuple[int, int]] = {}
"""this process's locks: the directory, resolved -> (descriptor, holds)"""


class StartRefused(RuntimeError):
    """The daemon cannot start as configured, for a reason its message says in full: it exits 2 (a configuration
    error), and the refusal is logged without a traceback."""


class DataDirInUse(StartRefused):
    """Another daemon process holds the data directory."""


class DataDirLock:
    """A hold on a data directory: `acquire` before anything else, `release` at the end."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._key: Path | None = None

    def acquire(self) -> None:
        """Take the directory, or raise `DataDirInUse` naming the holder's pid."""
        if self._key is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        key = self.data_dir.resolve()
        if key in _held:  # another partition of this process: the process holds the lock already
            fd, holds = _held[key]
            _held[key] = (fd, holds + 1)
            self._key = key
            return
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"data directory {self.data_dir} is in use by another recovery-daemon (pid {holder}): a data "
                f"directory holds one daemon's embedded nats-server store and names its default instance, so each "
                f"daemon needs its own --data-dir, whether it runs an embedded server or connects with --nats-url"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = (fd, 1)
        self._key = key

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None or key not in _held:
            return
        fd, holds = _held[key]
        if holds > 1:
            _held[key] = (fd, holds - 1)
            return
        del _held[key]
        os.close(fd)  # closing the descriptor releases the flock

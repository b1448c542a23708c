"""A daemon's data directory as a log to read: what `recovery-replay` does with a finished run's directory.

    with served(Path("recovery-data"), "RECOVERY") as url:
        ... read the log at url (a JetStream log, as with --nats) ...

A daemon on its embedded JetStream keeps its log in `<data dir>/jetstream`, and `recovery-run --standalone` keeps
its daemon's data directory in `<run dir>/daemon`: either directory is accepted. Once the daemon has stopped nothing
serves that store, so a `nats-server` is started for the read, on a free port, over a copy of the log's stream (a
server writes into the store it serves: indexes, consumer states, a recovered block; the directory is evidence and
is never written). The server is stopped and the copy removed when the read ends, however it ends. A daemon that
still runs (it holds its data directory's lock) is read live, at the URL it wrote there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from recovery.log.nats_server import NatsProcess, free_port

URL_FILE = "nats.url"
"""where a daemon writes its embedded server's URL (for recovery-ctl, and for a live read)"""
LOCK_FILE = "daemon.lock"
"""the file a running daemon holds an exclusive flock on"""
STORE = "jetstream"
RUN_DAEMON = "daemon"
"""a standalone run's daemon data directory, inside the run's"""
START_TIMEOUT_S = 60.0
"""a server recovering a large store on a busy host takes seconds"""


class NoLogHere(OSError):
    """The directory holds no log this command can read; the message says what it holds and what to give."""


def daemon_dir(path: Path) -> Path:
    """The daemon's data directory at `path`: `path` itself, or a standalone run's `path/daemon`."""
    for candidate in (path, path / RUN_DAEMON):
        if (candidate / STORE).is_dir() or (candidate / LOCK_FILE).is_file():
            return candidate
    raise NoLogHere(f"{path}: not a daemon's or a `recovery-run --standalone` data directory (no {STORE}/ or "
                    f"{RUN_DAEMON}/{STORE}/ in it)")


def running_url(directory: Path) -> str | None:
    """The URL of the daemon that holds `directory` now, or None when no daemon holds it."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            with contextlib.suppress(OSError):
                return (directory / URL_FILE).read_text().strip() or None
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: released at once, a daemon may start meanwhile
        return None
    finally:
        os.close(fd)


def stream_dirs(store: Path, stream: str) -> list[Path]:
    """The stream's directories in a JetStream store (`<store>/jetstream/<account>/streams/<stream>`)."""
    return sorted(p for p in (store / STORE).glob(f"*/streams/{stream}") if p.is_dir())


def copy_stream(store: Path, stream: str, into: Path) -> None:
    """Copy the stream's directories of `store` into the store `into`, in the same layout; the other streams (the
    commands, the snapshots) are left: the log is what is read."""
    found = stream_dirs(store, stream)
    if not found:
        held = sorted({p.name for p in (store / STORE).glob("*/streams/*")})
        raise NoLogHere(f"{store}: no stream {stream!r} in this JetStream store"
                        + (f" (it holds {', '.join(held)}: give --stream)" if held else ""))
    for source in found:
        shutil.copytree(source, into / source.relative_to(store), symlinks=True)


@contextlib.contextmanager
def served(path: Path, stream: str) -> Iterator[str]:
    """The URL at which the log kept in the data directory `path` can be read while the context lasts."""
    directory = daemon_dir(path)
    live = running_url(directory)
    if live is not None:
        yield live
        return
    store = directory / STORE
    if not (store / STORE).is_dir() and any(store.glob("*/streams")):
        store = directory  # a nats-server's own store directory (its `-sd`, as a platform's server keeps it)
    if not store.is_dir():
        raise NoLogHere(f"{directory}: its daemon kept no log here (it used a NATS server of the platform's, "
                        f"--nats-url): give --nats URL")
    with tempfile.TemporaryDirectory(prefix="recovery-replay-") as scratch:
        copy = Path(scratch) / STORE
        copy_stream(store, stream, copy)
        server = NatsProcess(copy, port=free_port(), log_file=Path(scratch) / "nats-server.log")
        try:
            server.start(START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:  # start() has already stopped what it started
            raise NoLogHere(f"{path}: the nats-server to read its store did not start: {exc}") from None
        try:
            yield server.url
        finally:
            server.stop()

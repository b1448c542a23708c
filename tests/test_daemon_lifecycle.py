"""The daemon's parts in one anyio task group: a part that fails, or a SIGTERM, stops every part in order, and no
task of the daemon outlives it; the embedded server starts with no Python code between fork and exec; a snapshot
forks only from a process that runs no other thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from recovery.log.nats_server import NatsProcess
from recovery.service import config as config_mod
from recovery.service.daemon import Daemon, DaemonFailed
from recovery.service.embedded import EmbeddedNats, EmbeddedPortBusy
from recovery.service.process import run
from recovery.service.snapshots import capture
from recovery.service.timers import TimerService
from recovery.testing import NatsServer, Scenario
from tests.daemon_support import ROOT, async_wait_for

STOP_ORDER = ["processor", "lease", "control", "snapshots", "http"]
"""after the companion, the timer service, the liveness monitor and the watch of unserved jobs: what stops once the
batch under way is done, HTTP last"""


def stopped_parts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.fields["part"] for r in caplog.records if r.getMessage() == "part stopped"]  # type: ignore[attr-defined]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recovery.daemon"]


async def test_a_failing_part_stops_every_part_in_order_and_no_task_outlives_the_daemon(
        nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    broken = RuntimeError("the clock went backwards")

    def due(self: TimerService, now: int) -> list[object]:
        raise broken

    monkeypatch.setattr(TimerService, "due", due)
    caplog.set_level(logging.INFO)
    daemon = Daemon(config_mod.load(nats_url=nats_server.url, http_port=0, data_dir=tmp_path / "d",
                                    timers_enabled=True, lease_ttl_s=2))
    before = asyncio.all_tasks()
    with pytest.raises(DaemonFailed) as failed, anyio.fail_after(30):
        await daemon.run()
    assert failed.value.__cause__ is broken and daemon.failed
    assert stopped_parts(caplog) == ["timers", "liveness", "unserved", *STOP_ORDER]
    said = messages(caplog)
    assert said.index("timers failed: stopping") < said.index("lease released") < said.index("stopped")
    assert asyncio.all_tasks() - before == set(), "a task of the daemon outlived it"
    assert daemon.nc is not None and daemon.nc.is_closed
    assert not daemon.readiness()[0]


async def test_sigterm_stops_every_part_in_order(nats_server: NatsServer, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg = config_mod.load(nats_url=nats_server.url, http_port=0, data_dir=tmp_path / "d", timers_enabled=True,
                          lease_ttl_s=2)

    @contextlib.asynccontextmanager
    async def terminate(daemon: Daemon) -> AsyncIterator[None]:
        await async_wait_for(lambda: daemon.readiness()[0], 10, "the daemon to be ready")
        os.kill(os.getpid(), signal.SIGTERM)
        yield

    before = asyncio.all_tasks()
    with anyio.fail_after(30):
        assert await run(cfg, terminate) == 0
    assert stopped_parts(caplog) == ["companion", "timers", "liveness", "unserved", *STOP_ORDER]
    assert "lease released" in messages(caplog)
    assert asyncio.all_tasks() - before == set(), "a task of the daemon outlived it"


async def test_a_stop_while_standing_by_ends_the_wait_and_every_part(nats_server: NatsServer, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    def load(instance: str) -> config_mod.DaemonConfig:
        return config_mod.load(nats_url=nats_server.url, http_port=0, data_dir=tmp_path / instance,
                               instance=instance, lease_ttl_s=5)

    active, standby = Daemon(load("a")), Daemon(load("b"))
    before = asyncio.all_tasks()
    async with active.running():
        async with anyio.create_task_group() as group:
            group.start_soon(standby.run)
            await async_wait_for(lambda: standby.role == "standby", 10, "the second daemon to stand by")
            started = time.monotonic()
            standby.request_stop()
        assert time.monotonic() - started < 2
        assert standby.role == "standby" and active.role == "active"
    assert asyncio.all_tasks() - before == set()


def test_the_embedded_server_is_started_without_python_between_fork_and_exec(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path, port=0)
    assert server._popen_options() == {"start_new_session": True}  # no preexec_fn
    command = server.command()
    if sys.platform.startswith("linux"):  # a shim sets the parent-death signal, then execs the server
        assert command[:4] == [sys.executable, "-I", "-S", "-c"] and command[5] == str(os.getpid())
        assert command[6:] == NatsProcess.command(server)


async def test_an_embedded_port_another_process_holds_is_waited_for_then_refused(tmp_path: Path) -> None:
    """The port clients know stays held past the wait: the start is refused, naming it, rather than moved to a port
    no client knows (`tests/test_daemon_process.py` restarts a daemon on its own port)."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = EmbeddedNats(tmp_path, port=port, port_wait_s=0.3)
        started = time.monotonic()
        with pytest.raises(EmbeddedPortBusy, match=rf"port {port} of the embedded nats-server is held"):
            await server.start_async()
        assert 0.3 <= time.monotonic() - started < 10 and not server.running
        assert not (tmp_path / "nats.url").exists()


def test_a_snapshot_forks_only_while_the_process_runs_no_other_thread() -> None:
    s = Scenario()
    s.submit("j", ["a", "b"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        captured = capture(s.engine, s.engine.last_seq, s.now, fork=True)
    finally:
        release.set()
        other.join()
    assert not captured.forked and captured.blob


def test_a_snapshot_of_a_single_threaded_process_is_packed_in_a_forked_child() -> None:
    script = textwrap.dedent("""
        import anyio
        from recovery.log.snapshot import dump_snapshot
        from recovery.service.snapshots import capture, pack_now, packed
        from recovery.testing import Scenario

        s = Scenario()
        s.submit("j", ["a", "b"], ranks_per_node=2, dp=4)
        s.train("j", 3)
        captured = capture(s.engine, s.engine.last_seq, s.now, fork=True)
        assert captured.forked, "a process with one thread forks"
        got = anyio.run(packed, captured)
        want = pack_now(dump_snapshot(s.engine))
        assert (got.body, got.sha256, got.blob_bytes) == (want.body, want.sha256, want.blob_bytes)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_free_port_never_gives_a_port_it_gave_lately_though_the_kernel_picks_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A cluster's servers each take a client, a monitor and a route port before any of them listens: the kernel may
    # pick a port it just closed again, and one server's monitor port was another's client port.
    import socket

    from recovery.log import nats_server

    picks = iter([41001, 41001, 41002, 41001, 41002, 41003])

    class Socket:
        def __init__(self, *args: object) -> None:
            self.port = next(picks)

        def __enter__(self) -> Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, address: tuple[str, int]) -> None:
            return None

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(nats_server, "_HANDED_OUT", type(nats_server._HANDED_OUT)(maxlen=16))
    monkeypatch.setattr(socket, "socket", Socket)
    assert [nats_server.free_port() for _ in range(3)] == [41001, 41002, 41003]


def test_the_daemon_starts_without_the_websocket_transport_and_refuses_a_websocket_url() -> None:
    """nats-py imports aiohttp for websocket servers, a tenth of a second of every start (a restart after a crash
    included): the daemon's entry point leaves it out, anything else may still import it, and a websocket URL in
    the configuration is refused with why rather than failing at connect."""
    script = ("import sys; import recovery.cli.daemon; import nats.aio.transport as t; "
              "print('aiohttp' in sys.modules, t.aiohttp is None); import aiohttp; print(aiohttp.__name__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "aiohttp"]
    from recovery.service.config import DaemonConfig

    with pytest.raises(ValueError, match="not a websocket"):
        DaemonConfig(nats_url="nats://a:4222, wss://b:443")

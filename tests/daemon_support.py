"""Helpers for the daemon tests: a `recovery-daemon` subprocess, the log read back from JetStream, and
waits on conditions with deadlines (never a sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import orjson
from nats.aio.client import Client
from nats.js import JetStreamContext

from events import subjects
from events.envelope import RawRecord, Record
from events.outputs import Decision
from recovery.log import MSG_ID
from recovery.log.jetstream import JetStreamLog, surface_async_ack_errors
from recovery.log.recorder import Replay, replay
from recovery.service import config as config_mod
from recovery.service.daemon import Daemon, DaemonFailed
from recovery.testing.nats import free_port

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.01


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_S)  # polling interval of a deadline-bounded wait


async def async_wait_for(condition: Callable[[], Any] | Callable[[], Awaitable[Any]], timeout: float,
                         what: str, logs: Callable[[], str] = str) -> None:
    """Until `condition()` (awaited if it is a coroutine) is true, within `timeout`; on timeout `logs()` says why."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{logs()}".rstrip())
        await asyncio.sleep(POLL_S)  # polling interval of a deadline-bounded wait


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return orjson.dumps(str(value)).decode()


class DaemonProcess:
    """`python -m recovery.cli.daemon --config <toml>` with its HTTP port, its JSON logs and signals."""

    def __init__(self, workdir: Path, nats_url: str, **settings: Any) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.http_port = free_port()
        self.settings = {"nats_url": nats_url, "http_port": self.http_port, "data_dir": str(workdir / "data"),
                         "log_format": "json", "log_level": "INFO", **settings}
        self.config_path = workdir / "daemon.toml"
        self.config_path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in self.settings.items()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_paths: list[Path] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, **env: str) -> None:
        """Start (again); `env` adds RECOVERY_* overrides for this run."""
        self.starts += 1
        log_path = self.workdir / f"daemon-{self.starts}.log"
        self.log_paths.append(log_path)
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "recovery.cli.daemon", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env})

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=2) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def ready(self) -> bool:
        if not self.running():
            raise RuntimeError(f"the daemon exited with {self.proc.returncode if self.proc else None}:\n"
                               f"{self.log_tail()}")
        try:
            return self.get("/readyz")[0] == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_for(self.ready, timeout, "the daemon's /readyz")

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        result: dict[str, Any] = orjson.loads(body)
        return result

    def metrics(self) -> dict[str, float]:
        code, body = self.get("/metrics")
        assert code == 200
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def terminate(self, timeout: float = 10.0) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds it took)."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - started

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for path in self.log_paths:
            for line in path.read_bytes().splitlines():
                with contextlib.suppress(orjson.JSONDecodeError):
                    obj = orjson.loads(line)
                    if isinstance(obj, dict):
                        out.append(obj)
        return out

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_paths:
            return "(no log)"
        return "\n".join(self.log_paths[-1].read_text(errors="replace").splitlines()[-lines:])


CONNECT_TIMEOUT_S = 30.0


async def connect(url: str) -> tuple[Client, JetStreamContext]:
    """A connection that rides out outages once made (reconnects forever) but whose first connect fails after
    CONNECT_TIMEOUT_S: a server that never came up fails the test instead of hanging it. `url` may name several
    servers, comma-separated (a cluster's)."""
    nc = await asyncio.wait_for(
        nats.connect(url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.1, name="recovery-tests"),
        CONNECT_TIMEOUT_S)
    js = nc.jetstream(timeout=10)
    surface_async_ack_errors(js)  # a refused (429) publish_async fails its future rather than leaving it pending
    return nc, js


async def read_stream(url: str, stream: str = "RECOVERY") -> list[Record | RawRecord]:
    """Every record of a stream, as the JetStream log reads it (without creating or changing the stream)."""
    nc, js = await connect(url)
    try:
        log = JetStreamLog(nc, js, stream, owns_connection=False)
        return [record async for record in log.read()]
    finally:
        await nc.close()


async def stream_last_seq(url: str, stream: str = "RECOVERY") -> int:
    nc, js = await connect(url)
    try:
        return int((await js.stream_info(stream)).state.last_seq)
    finally:
        await nc.close()


def input_ids(records: list[Record | RawRecord]) -> list[str]:
    return [r.headers.get(MSG_ID, "") for r in records if not subjects.is_output(r.subject)]


def last_input_seq(records: list[Record | RawRecord]) -> int:
    return max((r.seq for r in records if not subjects.is_output(r.subject)), default=0)


def dumps(model: Any) -> bytes:
    return orjson.dumps(model.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def check_log(records: list[Record | RawRecord]) -> Replay:
    """The log's own consistency: every recorded decision and dead letter is what an offline replay of the
    inputs derives, in order, once each."""
    result = replay(records)
    recorded = [dumps(d) for d in result.recorded_decisions]
    derived = [dumps(d) for d in result.decisions]
    assert len(recorded) == len(set(recorded)), "a decision is recorded twice"
    for index, (rec, der) in enumerate(zip(recorded, derived, strict=False)):
        assert rec == der, f"decision #{index} differs:\n recorded {rec.decode()}\n replayed {der.decode()}"
    assert len(recorded) == len(derived), f"{len(recorded)} decisions recorded, {len(derived)} derived"
    assert [dumps(r) for r in result.recorded_rejections] == [dumps(r) for r in result.rejections]
    ids = [r.headers.get(MSG_ID) for r in records]
    assert len(ids) == len(set(ids)), "a message id is stored twice"
    return result


def command_count(result: Replay) -> list[str]:
    return [c.id for d in result.recorded_decisions if isinstance(d, Decision) for c in d.commands]


def state_view(snapshot: dict[str, Any]) -> dict[str, Any]:
    """An engine snapshot without `last_seq` (the daemon's counts only inputs, a replay every record)."""
    return {k: v for k, v in snapshot.items() if k != "last_seq"}


async def drain(daemon: Any, url: str) -> None:
    """Wait until the daemon has applied the log's last input, and that last input stays put: an ack or report
    still in flight from a stopped cluster can land after one read, and must be applied before the checks."""
    target = -1
    while True:
        latest = last_input_seq(await read_stream(url))
        if latest == target:
            return
        target = latest
        await async_wait_for(lambda t=target: daemon.status()["published_seq"] >= t, 30, "the daemon to drain")


@contextlib.asynccontextmanager
async def running_daemon(url: str, data_dir: Path, **settings: Any) -> AsyncIterator[Daemon]:
    """The daemon in-process on `url`, ready; stopped on the way out, also when the test fails.

    It runs in a task of its own: a pytest fixture's set-up and teardown run in different tasks, and the daemon's
    task group must be left by the task that entered it."""
    d = Daemon(config_mod.load(nats_url=url, http_port=0, data_dir=data_dir, **settings))
    started, release = asyncio.Event(), asyncio.Event()

    async def host() -> None:
        async with d.running():
            started.set()
            await release.wait()

    task = asyncio.create_task(host(), name="daemon-under-test")
    try:
        await async_wait_for(lambda: started.is_set() or task.done(), 30, "the daemon to start")
        if task.done():
            task.result()  # its start failed: say why
        await async_wait_for(lambda: d.readiness()[0], 10, "the daemon to be ready")
        yield d
    finally:
        release.set()
        await task


class Supervised:
    """The daemons of `supervised_daemon`: `daemon` is the one running now, `failures` why each earlier one
    stopped."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.failures: list[BaseException] = []


@contextlib.asynccontextmanager
async def supervised_daemon(url: str, data_dir: Path, **settings: Any) -> AsyncIterator[Supervised]:
    """The daemon in-process, ready, and started again on the same data directory whenever it stops failed (as a
    deposed daemon's supervisor starts it again); stopped on the way out, also when the test fails."""
    cfg = config_mod.load(nats_url=url, http_port=0, data_dir=data_dir, **settings)
    supervised = Supervised(Daemon(cfg))
    released = asyncio.Event()

    async def supervise() -> None:
        while True:
            try:
                await supervised.daemon.run()
                return  # stopped as asked
            except DaemonFailed as exc:
                supervised.failures.append(exc.__cause__ or exc)
            if released.is_set():
                return
            supervised.daemon = Daemon(cfg)

    task = asyncio.create_task(supervise(), name="supervised-daemon")
    try:
        await async_wait_for(lambda: supervised.daemon.readiness()[0] or task.done(), 30, "the daemon to be ready")
        if task.done():
            task.result()
        yield supervised
    finally:
        released.set()
        supervised.daemon.request_stop()
        await task

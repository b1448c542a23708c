"""Tools that must not hang: recovery-ctl gives up within --timeout with an exit code that says why; every
publisher survives a JetStream 429 (provoked for real: a nats-server with a tiny stream ingest buffer), and the
daemon's raises at once an error that no retry can cure; a daemon bench that fails stops the processes it
started."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from recovery.cli.ctl import EXIT_NO_DAEMON, EXIT_NO_NATS, build_parser
from recovery.log import MSG_ID
from recovery.log.jetstream import (
    JetStreamLog,
    ensure_stream,
    is_retryable,
    is_too_many_requests,
    is_transient,
    stream_config,
    surface_async_ack_errors,
)
from recovery.service.publisher import Outgoing, Publisher
from recovery.testing.nats import NatsServer, free_port
from tools import bench_daemon

ROOT = Path(__file__).resolve().parents[1]
CTL_TIMEOUT_S = 2.0
# What a run may take beyond --timeout: starting Python and importing nats on a loaded 2-core CI machine.
STARTUP_MARGIN_S = 3.0


def run_ctl(url: str, *args: str, timeout: float = CTL_TIMEOUT_S) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "recovery.cli.ctl", "--nats", url, "--timeout", str(timeout), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    return done, time.monotonic() - started


# -- recovery-ctl -------------------------------------------------------------------------------------------
def test_ctl_with_nothing_listening_fails_within_the_timeout_naming_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    done, elapsed = run_ctl(url, "status")
    assert done.returncode == EXIT_NO_NATS, done.stderr
    assert url in done.stderr and "cannot reach NATS" in done.stderr
    assert "Traceback" not in done.stderr  # nats-py's per-attempt tracebacks are not shown
    assert elapsed < CTL_TIMEOUT_S + STARTUP_MARGIN_S, elapsed


def test_ctl_against_a_server_that_never_speaks_gives_up_at_the_timeout() -> None:
    # A port that accepts TCP connections (the kernel's backlog) and never sends NATS's INFO: a hung server.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        done, elapsed = run_ctl(url, "jobs")
    assert done.returncode == EXIT_NO_NATS, done.stderr
    assert url in done.stderr and f"within {CTL_TIMEOUT_S:g}s" in done.stderr
    assert CTL_TIMEOUT_S <= elapsed < CTL_TIMEOUT_S + STARTUP_MARGIN_S, elapsed


def test_ctl_with_nats_but_no_daemon_exits_with_its_own_code(nats_server: NatsServer) -> None:
    done, elapsed = run_ctl(nats_server.url, "status")
    assert done.returncode == EXIT_NO_DAEMON, done.stderr
    assert "no recovery-daemon answered on recovery.ctl.status" in done.stderr
    assert nats_server.url in done.stderr
    assert elapsed < CTL_TIMEOUT_S + STARTUP_MARGIN_S, elapsed


async def test_ctl_with_a_daemon_that_does_not_answer_gives_up_at_the_timeout(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)

    async def ignore(msg: Any) -> None:
        pass  # subscribed, so NATS does not say "no responders", and never answers: a wedged daemon

    await nc.subscribe("recovery.ctl.>", cb=ignore)
    await nc.flush()
    try:
        done, elapsed = await asyncio.to_thread(run_ctl, nats_server.url, "jobs", timeout=1.5)
    finally:
        await nc.close()
    assert done.returncode == EXIT_NO_DAEMON, done.stderr
    assert "no recovery-daemon answered on recovery.ctl.jobs" in done.stderr and "within 1.5s" in done.stderr
    assert 1.5 <= elapsed < 1.5 + STARTUP_MARGIN_S, elapsed


def test_ctl_help_lists_the_exit_codes() -> None:
    text = build_parser().format_help()
    assert "exit status:" in text
    assert f"{EXIT_NO_NATS}  no NATS server could be reached" in text
    assert f"{EXIT_NO_DAEMON}  NATS is up but no recovery-daemon answered" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--timeout", "0", "jobs"])


# -- 429: a real one, from a server whose streams buffer almost nothing -------------------------------------
@pytest.fixture
def busy_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server whose streams queue at most 4 incoming messages: concurrent publishes get 429s."""
    config = tmp_path / "busy.conf"
    config.write_text("jetstream { max_buffered_msgs: 4 }\n")
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(config)])
    try:
        server.start()
        yield server
    finally:
        server.stop()


async def _connect(url: str) -> tuple[Client, JetStreamContext]:
    async def quiet(exc: Exception) -> None:
        pass  # nats-py logs a traceback for every refused publish_async otherwise (the bug worked around)

    nc = await nats.connect(url, error_cb=quiet)
    js = nc.jetstream(timeout=10, publish_async_max_pending=20_000)
    await ensure_stream(js, stream_config("BUSY", ["busy.>"]))
    return nc, js


async def test_a_real_429_is_what_the_retry_classifies(busy_server: NatsServer) -> None:
    nc, js = await _connect(busy_server.url)
    try:
        results = await asyncio.gather(*(js.publish("busy.x", b"x") for _ in range(200)), return_exceptions=True)
    finally:
        await nc.close()
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused, "the server never answered 429"
    for exc in refused:
        assert type(exc) is nats.js.errors.APIError and exc.code == 429 and exc.err_code == 10167, repr(exc)
        assert is_too_many_requests(exc)
        assert is_retryable(exc, idempotent=False)  # refused, so nothing was stored: safe without an id
    # A timeout may hide a stored publish: retried only when the id makes the repeat a duplicate.
    assert not is_retryable(nats.errors.TimeoutError(), idempotent=False)
    assert is_retryable(nats.errors.TimeoutError(), idempotent=True)
    assert not is_retryable(nats.js.errors.BadRequestError(code=400), idempotent=True)
    # The same id still being stored (a retry overtook its first send on a replicated stream): asked again, the
    # server says stored or duplicate; without an id there is no such answer.
    in_process = nats.js.errors.APIError(code=409, err_code=10158, description="duplicate message id is in process")
    assert is_retryable(in_process, idempotent=True) and not is_retryable(in_process, idempotent=False)


async def test_the_log_appends_without_ids_through_429s(busy_server: NatsServer) -> None:
    log = await JetStreamLog.connect(busy_server.url, stream="BUSY", subjects=["busy.>"], publish_retry=60)
    try:
        appended = await asyncio.gather(*(log.append("busy.x", f"{i}".encode()) for i in range(200)))
        assert sorted(a.seq for a in appended) == list(range(1, 201))  # each stored once: no id, no duplicate
        assert await log.last_seq() == 200
    finally:
        await log.close()
    assert "excessive stream ingest rate" in busy_server.log_file.read_text()  # the server did refuse some


async def test_async_publish_futures_fail_with_the_429_instead_of_hanging(busy_server: NatsServer) -> None:
    nc, js = await _connect(busy_server.url)
    try:
        assert surface_async_ack_errors(js)
        futures = [await js.publish_async("busy.x", b"x", headers={MSG_ID: f"a{i}"}) for i in range(300)]
        _, pending = await asyncio.wait(futures, timeout=30)
        assert not pending, f"{len(pending)} acknowledgements never resolved"
        errors = [f.exception() for f in futures if f.exception() is not None]
        assert errors and all(e is not None and is_too_many_requests(e) for e in errors)
    finally:
        await nc.close()


async def test_the_daemon_publisher_gets_every_effect_stored_through_429s(busy_server: NatsServer) -> None:
    nc, js = await _connect(busy_server.url)
    try:
        publisher = Publisher(js, timeout=30)
        sent = 0
        # Rounds of 200 until the server has refused some (how many it refuses depends on the machine's speed).
        for _ in range(10):
            items = [Outgoing(f"busy.cmd.{i}", b"effect", f"effect-{i}", "command") for i in range(sent, sent + 200)]
            # Were a refusal left pending (nats-py's bug), each retry round would wait out the 30 s timeout.
            acks = await publisher.publish(items, deadline=time.monotonic() + 120)
            assert sorted(a.seq for a in acks) == list(range(sent + 1, sent + 201))
            sent += 200
            if publisher.retries:
                break
        assert publisher.retries > 0, "the server never refused a publish: nothing was tested"
        assert publisher.duplicates == 0
        assert int((await js.stream_info("BUSY")).state.messages) == sent
    finally:
        await nc.close()


async def test_the_daemon_publisher_raises_at_once_what_sending_again_cannot_fix(nats_server: NatsServer) -> None:
    nc, js = await _connect(nats_server.url)
    try:
        config = stream_config("SMALL", ["small.>"])
        config.max_msg_size = 64
        await ensure_stream(js, config)
        publisher = Publisher(js, timeout=5)
        started = time.monotonic()
        with pytest.raises(nats.errors.MaxPayloadError):  # over the server's limit: refused before it is sent
            await publisher.publish([Outgoing("small.x", b"x" * (nc.max_payload + 1), "big-1", "decision")],
                                    deadline=time.monotonic() + 60)
        with pytest.raises(nats.js.errors.APIError) as refused:  # over the stream's: refused by JetStream
            await publisher.publish([Outgoing("small.x", b"x" * 1000, "big-2", "decision")],
                                    deadline=time.monotonic() + 60)
        assert refused.value.code != 429
        assert publisher.retries == 0 and time.monotonic() - started < 5
        acks = await publisher.publish([Outgoing("small.x", b"fits", "small-1", "decision")])
        assert [a.seq for a in acks] == [1]
    finally:
        await nc.close()


async def test_the_bench_publisher_gets_everything_stored_through_429s(busy_server: NatsServer) -> None:
    nc, js = await bench_daemon.connect(busy_server.url)
    try:
        await ensure_stream(js, stream_config("BUSY", ["busy.>"]))
        items = [(f"busy.{i % 7}", b"event", f"bench-{i}") for i in range(500)]
        assert await bench_daemon.publish_all(js, items, window=200) == 500
        assert int((await js.stream_info("BUSY")).state.messages) == 500
    finally:
        await nc.close()


# -- the daemon bench stops what it started ---------------------------------------------------------------
def _gone(pid: int) -> bool:
    """Neither the process nor anything left in its process group (a forked snapshot child) is running."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failing_bench_stops_its_daemon(nats_server: NatsServer, tmp_path: Path,
                                          failure: type[BaseException]) -> None:
    pid = 0
    with pytest.raises(failure), bench_daemon.Daemon(tmp_path / "d", nats_server.url) as daemon:
        daemon.start()
        daemon.wait_ready(timeout=60)
        assert daemon.proc is not None
        pid = daemon.proc.pid
        raise failure("forced")
    assert pid and _gone(pid)


def test_the_daemon_bench_stops_its_server_and_daemon_when_a_part_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    servers: list[int] = []
    daemons: list[int] = []

    class RecordedServer(NatsServer):
        def start(self, timeout: float = 15.0) -> None:
            super().start(timeout)
            assert self.pid is not None
            servers.append(self.pid)

    async def failing_throughput(url: str, daemon: bench_daemon.Daemon, jobs: int, events: int) -> Any:
        assert daemon.proc is not None and daemon.proc.poll() is None
        daemons.append(daemon.proc.pid)
        raise RuntimeError("forced failure in the middle of the bench")

    monkeypatch.setattr(bench_daemon, "NatsServer", RecordedServer)
    monkeypatch.setattr(bench_daemon, "throughput", failing_throughput)
    args = argparse.Namespace(events=2_000, rss_jobs=None, faults=None, quick=True, jobs=10, heartbeat_rate=100.0,
                              batch=1000, only=["throughput"])
    with pytest.raises(RuntimeError, match="forced failure"):
        bench_daemon.run(args, lambda *row: None)
    assert daemons and all(_gone(pid) for pid in daemons)
    for pid in servers:  # nats-server runs in the bench's own process group: the process itself must be gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_unwinds_the_bench_like_ctrl_c() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, bench_daemon.sigterm_unwinds():
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("SIGTERM did not unwind")
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_nats_server_whose_start_is_interrupted_does_not_outlive_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a test's timeout) while the server starts: the process it launched is stopped, not leaked."""
    server = NatsServer(tmp_path / "nats")
    started: list[subprocess.Popen[bytes]] = []

    def interrupted(self: NatsServer) -> bool:
        started.append(self._proc)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(NatsServer, "ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert started and started[0].poll() is not None, "the nats-server process outlived its interrupted start"
    assert not server.running


def test_an_api_error_without_a_code_is_no_429_and_no_crash() -> None:
    """nats-py raises some APIError subclasses with no `code` attribute at all (a key not found under a replicated
    bucket whose server restarts): classified as not transient, never an AttributeError that stops a daemon's start."""
    exc = nats.js.errors.KeyNotFoundError()
    assert not hasattr(exc, "code") or exc.code is None
    assert not is_too_many_requests(exc)
    assert not is_transient(exc)

"""The daemon as a process: graceful shutdown and restart from its snapshot, a NATS restart under it, and the
embedded nats-server it starts when no URL is configured."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import nats
import pytest

from events import subjects
from events.envelope import EnvelopeBase, Record, make_envelope
from events.values import JobSpec
from recovery.log import MSG_ID, iter_file
from recovery.log.jetstream import JetStreamLog
from recovery.report.whatif import whatif
from recovery.service.demo import BuiltinCluster, Bus
from recovery.testing.nats import NatsServer, free_port
from tests.daemon_support import (
    ROOT,
    DaemonProcess,
    async_wait_for,
    check_log,
    connect,
    drain,
    last_input_seq,
    read_stream,
    wait_for,
)
from tests.golden.scenarios import path
from tests.test_daemon_crash import FAST


async def publish(url: str, items: Sequence[tuple[str, EnvelopeBase]]) -> int:
    nc, js = await connect(url)
    log = JetStreamLog(nc, js, "RECOVERY", owns_connection=False)
    last = 0
    try:
        for subject, envelope in items:
            last = (await log.append(subject, envelope)).seq
    finally:
        await nc.close()
    return last


def golden_inputs(name: str) -> list[tuple[str, EnvelopeBase]]:
    return [(r.subject, r.envelope) for r in iter_file(path(name))
            if isinstance(r, Record) and not subjects.is_output(r.subject)]


def test_graceful_shutdown_leaves_a_snapshot_and_the_next_start_replays_only_the_tail(
        nats_server: NatsServer, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, nats_server.url, timers_enabled=False, snapshot_every_records=1_000_000,
                           snapshot_every_s=3600)
    daemon.start()
    try:
        daemon.wait_ready()
        last = asyncio.run(publish(nats_server.url, golden_inputs("recover_in_place_fallback")))
        wait_for(lambda: daemon.status()["published_seq"] >= last, 30, "the daemon to apply the scenario")
        code, seconds = daemon.terminate()  # SIGTERM: finish the batch, snapshot, drain
        assert code == 0 and seconds < 5
        final = [line for line in daemon.logs() if line.get("msg") == "snapshot written"]
        assert final and final[-1]["final"] is True and final[-1]["seq"] == last
        # while it is down, a new job arrives: the tail the next start must replay
        job_spec = JobSpec.model_validate({"nodes": ["t0"], "ranks_per_node": 2, "layout": {"dp": 2}}
                                          ).model_dump(mode="json")
        tail = [(subjects.job_event("tail", "job.submitted"),
                 make_envelope("job.submitted", {"spec": job_spec}, id="tail-submit", job="tail")),
                (subjects.job_event("tail", "job.started"), make_envelope("job.started", {}, id="tail-start",
                                                                          job="tail"))]
        tail += [(subjects.job_event("tail", "progress.step"),
                  make_envelope("progress.step", {"rank": r, "step": s}, id=f"tail-{s}-{r}", job="tail"))
                 for s in range(1, 6) for r in range(2)]
        tail_last = asyncio.run(publish(nats_server.url, tail))
        daemon.start()
        daemon.wait_ready()
        wait_for(lambda: daemon.status()["published_seq"] >= tail_last, 30, "the tail to be applied")
        metrics = daemon.metrics()
        assert metrics["recovery_restored_snapshot_seq"] == last
        assert metrics["recovery_startup_replayed_records"] == len(tail)
        caught_up = [line for line in daemon.logs() if line.get("msg") == "caught up"]
        assert [(c["restored_snapshot_seq"], c["replayed_records"]) for c in caught_up] == [(0, 0),
                                                                                            (last, len(tail))]
        assert daemon.status()["jobs"] == 2
        assert daemon.proc is not None
        daemon.proc.send_signal(2)  # SIGINT stops it the same way
        assert daemon.proc.wait(timeout=5) == 0
    finally:
        daemon.close()
    records = asyncio.run(read_stream(nats_server.url))
    check_log(records)


async def test_nats_restart_under_a_running_daemon_loses_nothing(nats_server: NatsServer, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, nats_server.url, batch_size=64, snapshot_every_s=0.5)
    daemon.start()
    nc, js = await connect(nats_server.url)
    bus = Bus(nc, js)
    cluster = BuiltinCluster(bus, FAST, prefix="outage")
    try:
        await asyncio.to_thread(daemon.wait_ready)
        pid = daemon.pid
        await bus.start(cluster)
        await async_wait_for(lambda: bus.published > 200, 30, "traffic before the outage")
        await asyncio.to_thread(nats_server.stop)
        await asyncio.to_thread(nats_server.start)
        before = bus.published
        await async_wait_for(lambda: bus.published > before + 200, 30, "traffic after the outage")
        records = await read_stream(nats_server.url)
        target = last_input_seq(records)
        await async_wait_for(lambda: daemon.status()["published_seq"] >= target, 30,
                             "the daemon to apply what came after the outage")
        assert daemon.pid == pid and daemon.running()  # the same process, reconnected
        assert daemon.metrics()["recovery_nats_reconnects_total"] >= 1
        cluster.stop()
        await bus.flush()
        code, seconds = daemon.terminate()
        assert code == 0 and seconds < 5
        daemon.start(RECOVERY_TIMERS_ENABLED="false")  # drain quietly for the checks
        await asyncio.to_thread(daemon.wait_ready)
        await drain(daemon, nats_server.url)
        assert daemon.terminate()[0] == 0
    finally:
        await bus.close()
        daemon.close()
        await nc.close()
    records = await read_stream(nats_server.url)
    result = check_log(records)
    stored = [r.headers.get(MSG_ID) for r in records if not subjects.is_output(r.subject)]
    assert set(bus.sent) <= set(stored), "an event published around the outage is missing"
    assert result.recorded_decisions


def _refuses(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_embedded_nats_server_starts_and_stops_with_the_daemon(how: str, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "", embedded_port=0, command_max_age_s=7200, duplicate_window_s=600)
    daemon.start()
    try:
        daemon.wait_ready()
        url_file = tmp_path / "data" / "nats.url"
        url = url_file.read_text().strip()
        port = int(url.rsplit(":", 1)[1])

        async def inspect() -> tuple[float, float, list[str]]:
            nc = await nats.connect(url)
            js = nc.jetstream()
            commands = await js.stream_info("RECOVERY_CMD")
            log = await js.stream_info("RECOVERY")
            kv = await js.key_value("RECOVERY_SNAPSHOTS")
            await nc.close()
            return commands.config.max_age or 0, log.config.duplicate_window or 0, [kv.__class__.__name__]

        max_age, window, _ = asyncio.run(inspect())
        assert (max_age, window) == (7200, 600)
        assert (tmp_path / "data" / "jetstream").is_dir()
        if how == "sigterm":
            code, seconds = daemon.terminate()
            assert code == 0 and seconds < 5
            assert url_file.read_text().strip() == url  # the URL the next start serves again
        else:
            daemon.kill()
        deadline = time.monotonic() + 10
        wait_for(lambda: _refuses(port), max(deadline - time.monotonic(), 0.1), "the embedded server to exit")
    finally:
        daemon.close()


@pytest.mark.parametrize("second_nats", ["embedded", "nats-url"])
def test_a_second_daemon_on_the_same_data_directory_is_refused_and_the_first_keeps_it(second_nats: str,
                                                                                   tmp_path: Path) -> None:
    """Refused whatever its flags: with `--nats-url` (the first one's server, say) it would take the same default
    instance name and so the first one's lease, and the first would stop, its embedded server with it."""
    first = DaemonProcess(tmp_path / "a", "", embedded_port=0)
    second: DaemonProcess | None = None
    first.start()
    try:
        first.wait_ready()
        url_file = Path(first.settings["data_dir"]) / "nats.url"
        url = url_file.read_text()
        second = DaemonProcess(tmp_path / "b", "" if second_nats == "embedded" else url.strip(), embedded_port=0,
                               data_dir=first.settings["data_dir"])
        second.start()
        assert second.proc is not None
        code = second.proc.wait(timeout=30)
        assert code == 2, second.log_tail()  # a configuration error: the supervisor must not just start it again
        refusal = [e for e in second.logs() if e.get("level") == "error"]
        assert refusal and "is in use by another recovery-daemon" in refusal[0]["msg"], second.log_tail()
        assert f"pid {first.pid}" in refusal[0]["msg"]
        assert "exc" not in refusal[0]  # the refusal says it all: no traceback
        assert not any(e.get("msg") in ("embedded nats-server ready", "connected") for e in second.logs())
        assert url_file.read_text() == url and first.ready() and first.status()["role"] == "active"
        if second_nats == "embedded":
            first.kill()  # the kernel drops a SIGKILLed holder's lock: the directory is free again at once
            second.start()
            second.wait_ready()
    finally:
        first.close()
        if second is not None:
            second.close()


def _client_across_a_stop(port: int) -> socket.socket:
    """A NATS client (an agent, say) connected to the server on `port`: the server closes its connection as it stops,
    which leaves the server's end in TIME_WAIT on the port."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.recv(4096)  # INFO
    sock.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
    assert b"PONG" in sock.recv(4096)
    return sock


def _closed_by_server(sock: socket.socket) -> None:
    with sock:
        while sock.recv(4096):  # until the server's FIN; then our close completes the handshake
            pass


@pytest.mark.parametrize("port", ["any", "configured"])
def test_a_restarted_daemon_serves_its_embedded_nats_on_the_same_url(port: str, tmp_path: Path) -> None:
    """Agents are configured with the embedded server's URL: a restart after SIGTERM (the server's old connections in
    TIME_WAIT on its port) or after SIGKILL (the old server still shutting down) serves the same one, whether the port
    was configured or picked free at the first start (then kept in nats.url)."""
    daemon = DaemonProcess(tmp_path, "", embedded_port=0 if port == "any" else free_port())
    url_file = tmp_path / "data" / "nats.url"
    daemon.start()
    try:
        daemon.wait_ready()
        url = url_file.read_text().strip()
        client = _client_across_a_stop(int(url.rsplit(":", 1)[1]))
        code, _ = daemon.terminate()
        assert code == 0, daemon.log_tail()
        _closed_by_server(client)
        daemon.start()
        daemon.wait_ready()
        assert url_file.read_text().strip() == url and daemon.status()["url"] == url
        daemon.kill()
        daemon.start()
        daemon.wait_ready(60)
        assert daemon.status()["url"] == url
        assert not [e for e in daemon.logs() if e.get("level") in ("warning", "error")], daemon.log_tail()
    finally:
        daemon.close()


def test_a_daemon_waiting_for_nats_says_so_at_info_with_its_attempts_then_starts(tmp_path: Path) -> None:
    port = free_port()
    daemon = DaemonProcess(tmp_path, f"nats://127.0.0.1:{port}", timers_enabled=False)
    daemon.start()
    try:
        def waits(at_least: int) -> bool:
            return any(e.get("level") == "info" and e.get("msg", "").startswith("waiting for NATS")
                       and e.get("attempts", 0) >= at_least and e.get("where") == f"nats://127.0.0.1:{port}"
                       for e in daemon.logs())

        wait_for(lambda: waits(2), 30, "the daemon to say it waits for NATS")
        with NatsServer(tmp_path / "nats", port=port):
            daemon.wait_ready(60)
            assert any(e.get("msg") == "NATS reached" and e.get("attempts", 0) >= 3 for e in daemon.logs())
    finally:
        daemon.close()


def test_demo_runs_a_cluster_live_and_stops_by_itself(tmp_path: Path) -> None:
    """The README's first command, shortened: daemon, embedded JetStream and simulated cluster, then a verified
    export of the log."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "recovery.cli.daemon", "--demo", "--duration", "8", "--demo-driver",
                           "builtin", "--data-dir", str(tmp_path / "demo")], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert "verify: ok" in done.stdout, done.stdout
    assert "incident(s) opened" in done.stdout
    assert max(len(line.rstrip()) for line in done.stdout.splitlines()) <= 80, done.stdout
    assert "--job job0" in done.stdout and "<job>" not in done.stdout  # commands to paste, naming the demo's jobs
    assert (tmp_path / "demo" / "demo.jsonl").is_file()
    # The postmortem's what-if under the recorded policies repeats the demo's night, as on the golden logs: the job
    # with the incidents, by default, with the same recovery decisions within the tolerance.
    result = whatif(tmp_path / "demo" / "demo.jsonl", [])
    reproduction = result["reproduction"]
    assert reproduction["recorded"] and reproduction["reproduced"], reproduction


def test_a_test_server_whose_picked_port_was_taken_meanwhile_picks_another(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    with socket.socket() as squatter:  # someone binds the picked port before the server does
        squatter.bind((server.host, server.port))
        squatter.listen()
        taken = server.port
        server.start()
        try:
            assert server.running and server.port != taken
            restarted_on = server.port
            server.stop()
            server.start()  # once clients know the port, a restart keeps it
            assert server.port == restarted_on
        finally:
            server.stop()

"""The recovery daemon as a process on a real nats-server, and the publishing a bench does to it: the harness of the
benches that run the daemon (`daemon`, `fleet`, `soak`, `e2e`).

Every process started here (nats-server, a daemon and what it forks) is stopped when the `with` around it ends,
however it ends. A publish the server refuses (429, its ingest buffer full) is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
import orjson
from bench_harness import ROOT
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec
from recovery.log import MSG_ID
from recovery.log.jetstream import is_retryable, publish_with_retry, surface_async_ack_errors
from recovery.testing.nats import NatsServer, free_port

RANKS = 8
"""ranks per job of `job_setup` and `progress`: one node of 8"""


# -- the daemon process -----------------------------------------------------------------------------------
PYCACHE = Path(tempfile.gettempdir()) / "recovery-bench-pycache"


def installed_like() -> dict[str, str]:
    """The environment a daemon process is timed under: its modules' bytecode cached as an installed package's is
    (pip compiles it at install), in a directory of the bench's own, whatever the shell says
    (PYTHONDONTWRITEBYTECODE would have every start compile the project's hundred modules again, 0.16-0.2 s)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    return env


class Daemon:
    def __init__(self, workdir: Path, url: str, **settings: Any) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "daemon.toml"
        values = {"nats_url": url, "http_port": self.port, "data_dir": str(workdir / "data"), "log_level": "INFO",
                  "log_file": str(workdir / "daemon.log"), **settings}
        self.config.write_text("".join(f"{k} = {orjson.dumps(v).decode()}\n" for k, v in values.items()))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        started = time.monotonic()
        # Its own process group: `close` stops the daemon and the snapshot children it forks together, and a
        # Ctrl-C in the terminal reaches the bench, which stops it, rather than racing it.
        self.proc = subprocess.Popen([sys.executable, "-m", "recovery.cli.daemon", "--config", str(self.config)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=ROOT, start_new_session=True, env=installed_like())
        return started

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""
        except (urllib.error.URLError, OSError):
            return 0, b""

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/readyz")[0] != 200:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited; see {self.workdir / 'daemon.log'}")
            if time.monotonic() > deadline:
                tail = "\n".join((self.workdir / "daemon.log").read_text(errors="replace").splitlines()[-30:])
                raise TimeoutError(f"daemon not ready within {timeout:g} s; /status {self.status()}; log:\n{tail}")
            time.sleep(0.02)  # polling interval of a deadline-bounded wait (each poll costs the daemon a request)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        result: dict[str, Any] = orjson.loads(body) if code == 200 else {}
        return result

    def published_seq(self) -> int:
        return int(self.status().get("published_seq", 0))

    def events_total(self) -> float | None:
        """Inputs applied so far, over every partition (`recovery_events_total`); None when /metrics does not
        answer."""
        code, body = self.get("/metrics")
        if code != 200:
            return None
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith("recovery_events_total{"):
                total += float(line.rpartition(" ")[2])
        return total

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the daemon process has used: unlike a rate, barely moved by other load on
        a shared machine, so it compares two builds run minutes apart."""
        assert self.proc is not None
        # /proc/<pid>/stat: fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, kill: bool = False) -> float:
        assert self.proc is not None
        started = time.monotonic()
        if kill:
            self._kill_group()  # a crashed host: a snapshot child in flight dies with the daemon
        else:
            self.proc.terminate()
        self.proc.wait(timeout=60)
        return time.monotonic() - started

    def _kill_group(self) -> None:
        # Only while the daemon is not reaped: until then its pid, which is its group's id, cannot name another
        # process group.
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the daemon (and anything it forked) if it still runs: the cleanup of a bench that failed."""
        if self.proc is None:
            return
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@contextlib.contextmanager
def nats_server(store_dir: Path, kind: type[NatsServer] = NatsServer) -> Iterator[NatsServer]:
    """A running nats-server (a `kind`), stopped on the way out whatever happens, a failed or interrupted start
    included (`NatsServer`'s own `with` does not stop a server whose start raised)."""
    server = kind(store_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()



def wait_seq(daemon: Daemon, seq: int, timeout: float = 3600.0) -> float:
    deadline = time.monotonic() + timeout
    while daemon.published_seq() < seq:
        if daemon.proc is None or daemon.proc.poll() is not None:
            raise RuntimeError(f"daemon exited before reaching {seq}; see {daemon.workdir / 'daemon.log'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon did not reach {seq}")
        time.sleep(0.002)  # polling interval of a deadline-bounded wait
    return time.monotonic()


# -- publishing -------------------------------------------------------------------------------------------
async def connect(url: str) -> tuple[Client, JetStreamContext]:
    nc = await nats.connect(url, max_reconnect_attempts=-1, pending_size=256 * 1024 * 1024)
    js = nc.jetstream(timeout=30, publish_async_max_pending=20_000)
    surface_async_ack_errors(js)  # else a refused publish's future never resolves (a nats-py bug)
    return nc, js


async def publish_all(js: JetStreamContext, items: list[tuple[str, bytes, str]], window: int = 8192,
                      ack_timeout: float = 30.0) -> int:
    """Pipelined JetStream publishes, at most `window` unacknowledged; the last stream sequence. One refused
    (429) or not acknowledged within `ack_timeout` is sent again on its own, with its id (so never twice)."""
    last = 0
    pending: list[tuple[tuple[str, bytes, str], asyncio.Future[PubAck]]] = []

    async def settle() -> None:
        nonlocal last
        if not pending:
            return
        # Bounded: an acknowledgement that never comes must not hold the bench forever.
        _, late = await asyncio.wait([future for _, future in pending], timeout=ack_timeout)
        for future in late:
            future.cancel()
        for (subject, data, ident), future in pending:
            error = None if future.cancelled() else future.exception()
            if future.cancelled() or error is not None:
                if error is not None and not is_retryable(error, idempotent=True):
                    raise error
                ack = await publish_with_retry(js, subject, data, {MSG_ID: ident}, retry_for=max(ack_timeout, 60))
            else:
                ack = future.result()
            last = max(last, ack.seq)
        pending.clear()

    for item in items:
        subject, data, ident = item
        pending.append((item, await js.publish_async(subject, data, headers={MSG_ID: ident})))
        if len(pending) >= window:
            await settle()
    await settle()
    return last


async def blast(nc: Client, js: JetStreamContext, stream: str, items: list[tuple[str, bytes, str]]) -> None:
    """Publish without waiting for each acknowledgement (what a fleet of agents looks like to the server)."""
    for n, (subject, data, ident) in enumerate(items, 1):
        await nc.publish(subject, data, headers={MSG_ID: ident})
        if n % 10_000 == 0:
            await nc.flush(timeout=60)
    await nc.flush(timeout=60)


def job_setup(jobs: int, prefix: str, watchdog_s: float = 2.0) -> list[tuple[str, bytes, str]]:
    items = []
    for j in range(jobs):
        job = f"{prefix}{j:05d}"
        spec = JobSpec.model_validate({"nodes": [f"{job}-n"], "ranks_per_node": RANKS, "layout": {"dp": RANKS},
                                       "watchdog_interval_s": watchdog_s})
        for type_, data in (("job.submitted", {"spec": spec.model_dump(mode="json")}), ("job.started", {})):
            env = make_envelope(type_, data, id=f"{job}-{type_}", job=job, source="bench")
            items.append((subjects.job_event(job, type_), encode_envelope(env), env.id))
    return items


def progress(jobs: int, prefix: str, count: int, start_step: int = 1, kind: str = "progress.step"
             ) -> list[tuple[str, bytes, str]]:
    """`count` progress reports, round-robin over every rank of every job, steps going up."""
    items = []
    per_round = jobs * RANKS
    for i in range(count):
        rnd, k = divmod(i, per_round)
        j, rank = divmod(k, RANKS)
        job = f"{prefix}{j:05d}"
        ident = f"{job}-{kind}-{rank}-{start_step + rnd}"
        data = {"id": ident, "type": kind, "job": job, "source": "bench",
                "data": {"rank": rank, "step": start_step + rnd, "attempt": 0}}
        items.append((subjects.job_event(job, kind), orjson.dumps(data), ident))
    return items

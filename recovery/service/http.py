"""The daemon's service face: Prometheus metrics and a tiny HTTP server for `/healthz`, `/readyz`, `/metrics`.

The HTTP server is an anyio listener with a few lines of HTTP/1.0: three read-only endpoints need no
framework, and it runs on the daemon's own event loop (a scrape sees a consistent state), each connection a task
of the server's own task group, so none outlives it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator

import anyio
import orjson
from anyio.abc import SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from recovery.core.engine import Engine
from recovery.service.processor import Processed

logger = logging.getLogger("recovery.service")  # the name operators filter on: kept since it moved

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every metric of one daemon, in its own registry (several daemons can live in one test process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.events = Counter("recovery_events", "input records applied, by event type", ["type"], registry=r)
        self.rejections = Counter("recovery_rejections", "inputs rejected to the dead-letter subject, by reason",
                                  ["reason"], registry=r)
        self.decisions = Counter("recovery_decisions", "decisions recorded, by kind", ["kind"], registry=r)
        self.commands = Counter("recovery_commands", "commands published, by kind", ["kind"], registry=r)
        self.timers_fired = Counter("recovery_timers_fired", "timer.fired events published by the timer service",
                                    registry=r)
        self.snapshots = Counter("recovery_snapshots", "snapshots written to the KV bucket", registry=r)
        self.reconnects = Counter("recovery_nats_reconnects", "reconnections to NATS", registry=r)
        self.prefetches = Counter("recovery_takeover_prefetches", "takeovers read ahead while their owner was "
                                  "suspected dead, by outcome: begun, taken (a worker got it), dropped", ["outcome"],
                                  registry=r)
        self.consumer_resets = Counter("recovery_consumer_resets",
                                       "input consumer re-created at the next sequence (gap, outage)", registry=r)
        self.open_incidents = Gauge("recovery_open_incidents", "jobs with an open incident", registry=r)
        self.jobs = Gauge("recovery_jobs", "jobs by state", ["state"], registry=r)
        self.consumer_lag = Gauge("recovery_consumer_lag", "input records in the stream not yet delivered",
                                  registry=r)
        self.last_seq = Gauge("recovery_last_applied_seq", "stream sequence of the last applied input", registry=r)
        self.timers_armed = Gauge("recovery_timers_armed", "outstanding engine timers", registry=r)
        self.snapshot_seq = Gauge("recovery_snapshot_seq", "stream sequence covered by the newest snapshot",
                                  registry=r)
        self.snapshot_age = Gauge("recovery_snapshot_age_seconds", "seconds since the newest snapshot was written",
                                  registry=r)
        self.snapshot_bytes = Gauge("recovery_snapshot_bytes", "size of the newest snapshot", registry=r)
        self.restored_seq = Gauge("recovery_restored_snapshot_seq",
                                  "sequence of the snapshot restored at start (0: none)", registry=r)
        self.replayed = Gauge("recovery_startup_replayed_records",
                              "input records applied at start to catch up from the restored snapshot", registry=r)
        self.ready = Gauge("recovery_ready", "1 when caught up and connected", registry=r)
        self.active = Gauge("recovery_active", "1 while this daemon holds its partition's lease (or runs without "
                                               "one), 0 while it stands by", registry=r)
        self.clock_offset = Gauge("recovery_server_clock_offset_seconds",
                                  "the NATS server's clock minus this host's, as the timer service estimates it",
                                  registry=r)
        self.latency = Histogram("recovery_decision_latency_seconds",
                                 "log time of an input to its effects acknowledged by JetStream",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("recovery_batch_records", "input records per processed batch",
                                    buckets=(1, 10, 100, 500, 1000, 2000, 5000, 10000), registry=r)

    def observe_batch(self, done: Processed, now_ns: int, last_seq: int, lag: int) -> None:
        """Count what one processed batch did, once its effects are published (`now_ns`: when)."""
        for ts in done.timed:
            self.latency.observe(max(now_ns - ts, 0) / 1e9)
        for key, n in done.types.items():
            self.events.labels(key).inc(n)
        for key, n in done.decisions.items():
            self.decisions.labels(key).inc(n)
        for key, n in done.rejections.items():
            self.rejections.labels(key).inc(n)
        for key, n in done.commands.items():
            self.commands.labels(key).inc(n)
        self.batch_size.observe(done.applied)
        self.last_seq.set(last_seq)
        self.consumer_lag.set(lag)

    def refresh(self, engine: Engine, active: bool, clock_offset_ns: int, snapshot_written: float | None,
                ready: bool, lag: int | None) -> None:
        """Set the gauges read from the engine's state, before a scrape."""
        states: Tally[str] = Tally()
        incidents = 0
        for job in engine.jobs.values():
            states[job.state] += 1
            incidents += job.incident is not None
        for state, n in states.items():
            self.jobs.labels(state).set(n)
        self.open_incidents.set(incidents)
        self.timers_armed.set(len(engine.timers))
        self.active.set(1 if active else 0)
        self.clock_offset.set(clock_offset_ns / 1e9)
        if snapshot_written is not None:
            self.snapshot_age.set(time.monotonic() - snapshot_written)
        self.ready.set(1 if ready else 0)
        if lag is not None:
            self.consumer_lag.set(lag)

    def render(self) -> bytes:
        return generate_latest(self.registry)


Readiness = Callable[[], tuple[bool, dict[str, object]]]


class HttpServer:
    """`/healthz` (the loop answers), `/readyz` (200 once caught up and connected, else 503 with why) and
    `/metrics` (Prometheus text format). `before_scrape` refreshes gauges computed on demand."""

    def __init__(self, host: str, port: int, metrics: Metrics, ready: Readiness,
                 before_scrape: Callable[[], None] | None = None,
                 status: Callable[[], Awaitable[dict[str, object]]] | None = None) -> None:
        self.host = host
        self.port = port
        self._metrics = metrics
        self._ready = ready
        self._before_scrape = before_scrape
        self._status = status
        self._listener: SocketListener | None = None

    async def listen(self) -> int:
        """Bind and listen (the port is taken once this returns: 0 picks a free one); returns the port."""
        # Bound here rather than by anyio's listener factory, whose name lookup would borrow a worker thread.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self._listener = await SocketListener.from_socket(sock)
        self.port = sock.getsockname()[1]
        return self.port

    async def serve(self) -> None:
        """Answer requests until cancelled; the listener is closed on the way out."""
        assert self._listener is not None, "listen() first"
        async with self._listener:
            await self._listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(5):
                    receive = BufferedByteReceiveStream(stream)
                    request = await receive.receive_until(b"\n", 8192)
                    while (await receive.receive_until(b"\n", 8192)).strip():
                        pass  # headers: nothing here needs them
                parts = request.decode("latin-1").split()
                method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
                status, ctype, body = await self._route(method, path)
                head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n").encode()
                await stream.send(head + (b"" if method == "HEAD" else body))
            except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound,
                    anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError, UnicodeDecodeError):
                pass
            except Exception:  # a scrape must never take the daemon down
                logger.exception("http handler failed")

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            ok, why = self._ready()
            body = orjson.dumps({"ready": ok, **why}) + b"\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            if self._before_scrape is not None:
                self._before_scrape()
            return "200 OK", CONTENT_TYPE_LATEST, self._metrics.render()
        if path == "/status" and self._status is not None:
            return "200 OK", "application/json", orjson.dumps(await self._status(), default=str) + b"\n"
        return "404 Not Found", "text/plain", b"not found\n"


PER_PROCESS = ("recovery_active", "recovery_ready")
"""a partitioned process's own families; a partition's are named `recovery_partition_active` and `_ready`"""


class PartitionMetrics:
    """A partitioned daemon process's `/metrics` beside its own: every metric of each partition it serves (events,
    lag, decision latency, incidents, snapshots...), the partition's index as the `partition` label, one family per
    name across partitions. Each partition's daemon keeps its own registry; this reads them at scrape time, after
    refreshing their gauges (`sources` gives (index, metrics, refresh) for the partitions running now)."""

    def __init__(self, sources: Callable[[], list[tuple[int, Metrics, Callable[[], None]]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for index, metrics, refresh in self._sources():
            refresh()
            for family in metrics.registry.collect():
                name = family.name
                if name in PER_PROCESS:
                    name = name.replace("recovery_", "recovery_partition_", 1)
                merged = families.get(name)
                if merged is None:
                    merged = families[name] = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    merged.samples.append(sample._replace(
                        name=sample.name.replace(family.name, name, 1),
                        labels={**sample.labels, "partition": str(index)}))
        yield from families.values()

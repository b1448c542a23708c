"""Engine snapshots for the daemon: captured at a batch boundary, packed (zlib, sha256) and kept in a KV bucket.

Pickling thousands of jobs takes tens of milliseconds or more, so a running daemon captures its state in a forked
child (copy-on-write: the state as of the fork) that pickles, compresses and hashes it while the loop goes on
deciding. A child forked from a process that runs threads inherits their locks in whatever state they were: so the
daemon forks only while it runs no thread but its own (it starts none; a host name lookup borrows one for a moment),
and otherwise, like a platform without fork, it pickles in the loop and packs in slices between other work.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import signal
import struct
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import nats.js.errors
import orjson
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from recovery.core.engine import Engine
from recovery.log.snapshot import dump_snapshot
from recovery.service.http import Metrics

logger = logging.getLogger("recovery.daemon")

SNAPSHOT_FORMAT = 2  # of the KV layout (manifest and chunks); the engine's blob has its own
SLICE = 1 << 20
"""bytes compressed or hashed between two looks at the event loop, when packing in the loop"""
_HEADER = struct.Struct("!Q32s")  # what a child writes before the packed body: the blob's length, its sha256


@dataclass(frozen=True, slots=True)
class Packed:
    """A snapshot as stored: the engine's blob compressed, the sha256 of what is stored, and the blob's length."""

    body: bytes
    sha256: str
    blob_bytes: int


def pack_now(blob: bytes) -> Packed:
    body = zlib.compress(blob, 1)
    return Packed(body, hashlib.sha256(body).hexdigest(), len(blob))


async def pack(blob: bytes) -> Packed:
    """`pack_now`, a slice at a time, letting the loop run between slices."""
    compressor = zlib.compressobj(1)
    parts = []
    for start in range(0, len(blob), SLICE):
        parts.append(compressor.compress(blob[start:start + SLICE]))
        await anyio.lowlevel.checkpoint()
    parts.append(compressor.flush())
    body = b"".join(parts)
    digest = hashlib.sha256()
    for start in range(0, len(body), SLICE):
        digest.update(body[start:start + SLICE])
        await anyio.lowlevel.checkpoint()
    return Packed(body, digest.hexdigest(), len(blob))


def threads_running() -> int:
    """The threads of this process, those no Python code started included (Linux), else Python's own."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


@dataclass(frozen=True, slots=True)
class Capture:
    """The engine's state as of one batch boundary (input `seq`, log time `ts`), on its way to the bucket: in a
    forked child (`child`: its pid and the read end of its pipe), or pickled already (`blob`)."""

    seq: int
    ts: int
    blob: bytes = b""
    child: tuple[int, int] | None = None
    blocked_s: float = 0.0
    """how long capturing held the loop"""

    @property
    def forked(self) -> bool:
        return self.child is not None


def capture(engine: Engine, seq: int, ts: int, fork: bool) -> Capture:
    """Capture the engine's state now: in a forked child if `fork` and this process runs no other thread, else
    pickled here."""
    started = time.monotonic()
    if fork and hasattr(os, "fork") and threads_running() == 1:
        try:
            child = _fork_pack(engine)
        except OSError:
            logger.warning("fork failed: snapshot pickled in the loop", exc_info=True)
        else:
            return Capture(seq, ts, child=child, blocked_s=time.monotonic() - started)
    blob = dump_snapshot(engine)
    return Capture(seq, ts, blob=blob, blocked_s=time.monotonic() - started)


async def packed(captured: Capture) -> Packed:
    """The captured state, packed: read from the child's pipe as the loop goes on, or packed here in slices."""
    if captured.child is None:
        return await pack(captured.blob)
    pid, read_fd = captured.child
    chunks = []
    try:
        os.set_blocking(read_fd, False)
        while True:
            await anyio.wait_readable(read_fd)
            try:
                chunk = os.read(read_fd, SLICE)
            except BlockingIOError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        status = _reap(pid)
    if status != 0:
        raise RuntimeError(f"snapshot child exited with status {status}")
    data = b"".join(chunks)
    blob_bytes, digest = _HEADER.unpack_from(data)
    return Packed(data[_HEADER.size:], digest.hex(), blob_bytes)


CHILD_NICENESS = 10
"""the pickling child's niceness: it yields the cores to the daemons' loops and the servers (a snapshot may take
longer, a decision must not: captures pickling beside the loops made faults 1-2 s late on a busy host)"""


def _fork_pack(engine: Engine) -> tuple[int, int]:
    """Fork a child that writes the packed `dump_snapshot(engine)` to a pipe and exits; (pid, read end)."""
    import fcntl  # POSIX, as fork is

    read_fd, write_fd = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # fewer, larger reads for the loop; the default pipe holds 64 KiB
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, SLICE)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: pack, write, leave without running any cleanup of the parent's
        code = 1
        try:
            os.close(read_fd)
            with contextlib.suppress(OSError):
                os.nice(CHILD_NICENESS)
            done = pack_now(dump_snapshot(engine))
            view = memoryview(_HEADER.pack(done.blob_bytes, bytes.fromhex(done.sha256)) + done.body)
            while view:
                view = view[os.write(write_fd, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, read_fd


def _reap(pid: int) -> int:
    """The child's exit status. It has closed its end of the pipe by exiting, so this does not wait for long; a
    child still running (the pipe was closed early by a cancellation) is stopped first."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return status


class SnapshotStore:
    """Engine snapshots in a KV bucket: the value is split into chunks (a snapshot of thousands of jobs is
    far above NATS's max_payload) under `<partition>.<slot>.<n>`, then the manifest `<partition>` names the
    slot, the chunk count and their checksum. Snapshots alternate between slots `a` and `b` and the manifest is
    written last, so a crash mid-write leaves the previous snapshot intact and in force, and the bucket (one
    revision per key) stays bounded: two snapshots' chunks and a manifest."""

    def __init__(self, js: JetStreamContext, bucket: str, partition: str, chunk_bytes: int, replicas: int) -> None:
        self.js = js
        self.bucket = bucket
        self.partition = partition
        self.chunk_bytes = chunk_bytes
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def ensure(self) -> None:
        try:
            self._kv = await self.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            self._kv = await self.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, history=1, storage=StorageType.FILE, replicas=self.replicas,
                description="recovery-daemon engine snapshots"))

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "ensure() first"
        return self._kv

    async def manifest(self) -> dict[str, Any] | None:
        try:
            entry = await self.kv.get(self.partition)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            manifest: dict[str, Any] = orjson.loads(entry.value)
        except orjson.JSONDecodeError:
            return None
        return manifest if manifest.get("format") == SNAPSHOT_FORMAT else None

    async def load(self, manifest: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]] | None:
        """The blob of the snapshot `manifest` names (by default the newest's, read now) and that manifest."""
        manifest = manifest or await self.manifest()
        if manifest is None:
            return None
        try:
            return await self._load(manifest)
        except (KeyError, TypeError, ValueError, zlib.error) as exc:  # a damaged manifest: no snapshot, never a crash
            logger.warning("unreadable snapshot: ignoring it", extra={"fields": {"error": repr(exc)}})
            return None

    async def _load(self, manifest: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
        parts = []
        for n in range(int(manifest["chunks"])):
            try:
                entry = await self.kv.get(f"{self.partition}.{manifest['slot']}.{n}")
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                logger.warning("snapshot chunk missing: ignoring the snapshot",
                               extra={"fields": {"id": manifest["id"], "n": n}})
                return None
            parts.append(entry.value or b"")
        body = b"".join(parts)
        if hashlib.sha256(body).hexdigest() != manifest["sha256"]:
            logger.warning("snapshot checksum mismatch: ignoring the snapshot",
                           extra={"fields": {"id": manifest["id"]}})
            return None
        if manifest.get("compression") == "zlib":
            body = zlib.decompress(body)
        return body, manifest

    async def save(self, snapshot: bytes | Packed, seq: int, ts: int) -> dict[str, Any]:
        """Store a snapshot (the engine's blob, or packed already) covering the inputs up to `seq`."""
        done = snapshot if isinstance(snapshot, Packed) else await pack(snapshot)
        previous = await self.manifest()
        slot = "b" if previous is not None and previous.get("slot") == "a" else "a"
        body = done.body
        chunks = [body[i:i + self.chunk_bytes] for i in range(0, len(body), self.chunk_bytes)] or [b""]
        for n, chunk in enumerate(chunks):
            await self.kv.put(f"{self.partition}.{slot}.{n}", chunk)
        manifest = {"format": SNAPSHOT_FORMAT, "id": f"{seq}-{secrets.token_hex(4)}", "slot": slot, "seq": seq,
                    "ts": ts, "chunks": len(chunks), "bytes": done.blob_bytes, "stored_bytes": len(body),
                    "compression": "zlib", "sha256": done.sha256, "written_ns": time.time_ns(), "pid": os.getpid()}
        await self.kv.put(self.partition, orjson.dumps(manifest))
        return manifest


Retry = Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]]
"""how the daemon retries a NATS operation through an outage: `retry(op, what)`"""


BURST_SHARE = 10
"""a snapshot is due after this share of `every_records` once this share of `every_s` went by since the last"""
TAKEOVER_HOLD_S = 20.0
"""the longest a partition's takeover holds back the other partitions' snapshots in its process"""


class CaptureGate:
    """What the snapshots of one process's partitions share (`GATE`). A capture is a forked child pickling a whole
    engine, up to seconds of a core on a busy host, and a fleet's snapshots fall due together (its partitions
    started together): none is captured while another partition of the process is being taken over (from its lease
    to caught up, at most `TAKEOVER_HOLD_S`), which is the fleet's failover: four captures at once held two
    takeovers back by 1.5 s in a run of the fleet bench. A snapshot due waits a few seconds. (One capture at a time
    in every case spread the same work over four times as long, and more faults waited behind it.)"""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._taking: dict[int, float] = {}  # snapshotter -> until when its partition's takeover holds the others

    def taking_over(self, who: object) -> None:
        self._taking[id(who)] = self.clock() + TAKEOVER_HOLD_S

    def release(self, who: object) -> None:
        """`who` caught up, or stopped: it holds nothing back any more."""
        self._taking.pop(id(who), None)

    def open(self, who: object) -> bool:
        """May `who` capture now? (Asked after every batch of every partition: no takeover, no work.)"""
        if not self._taking:
            return True
        now = self.clock()
        for key in [k for k, until in self._taking.items() if until <= now]:
            del self._taking[key]
        return not (self._taking.keys() - {id(who)})


GATE = CaptureGate()


class Snapshotter:
    """When the daemon takes a snapshot, and the upload beside the processing.

    The processor asks `maybe` between two batches; a snapshot is due after `every_records` inputs or `every_s`
    seconds, or after a tenth of the records once a tenth of the period went by (a burst). It is captured there
    (with every effect acknowledged, by the active daemon only) and handed to the `uploads` part, one at a time:
    while one uploads, none is captured. `final` writes the last one at shutdown, in the loop, since nothing else
    runs then."""

    def __init__(self, store: SnapshotStore, every_records: int, every_s: float, fork: bool, metrics: Metrics,
                 retry: Retry, started: float, gate: CaptureGate = GATE) -> None:
        self.store = store
        self.gate = gate
        self.every_records = every_records
        self.every_s = every_s
        self.fork = fork
        self.metrics = metrics
        self.retry = retry
        self.started = started
        self.seq = 0
        """the input sequence the newest snapshot covers"""
        self.written: float | None = None
        """monotonic time the newest snapshot was written (for a restored one, as long ago as it was written)"""
        self.manifest: dict[str, Any] | None = None
        self.records_since = 0
        self._send, self._receive = anyio.create_memory_object_stream[Capture](1)
        self._uploading = False

    def taking_over(self, held: bool) -> None:
        """This partition is being taken over (`held`: the others' captures wait), or no more."""
        if held:
            self.gate.taking_over(self)
        else:
            self.gate.release(self)

    def restored(self, seq: int, manifest: dict[str, Any]) -> None:
        self.seq = seq
        self.manifest = manifest
        self.written = time.monotonic() - max(0.0, (time.time_ns() - int(
            manifest.get("written_ns", time.time_ns()))) / 1e9)
        self.metrics.snapshot_seq.set(seq)
        self.metrics.snapshot_bytes.set(int(manifest.get("bytes", 0)))

    def maybe(self, engine: Engine, clean_seq: int, last_ts: int, active: bool) -> None:
        """Capture a snapshot now if one is due and none is uploading."""
        if self.records_since == 0 or clean_seq <= self.seq or self._uploading or not self.gate.open(self):
            return
        age = time.monotonic() - (self.written or self.started)
        # A burst (a fleet's first words: every node's mode and first report, tens of thousands of records) is
        # seconds of a takeover's replay: past a tenth of the records, a tenth of the period is enough.
        if (self.records_since >= self.every_records or age >= self.every_s
                or (self.records_since >= self.every_records // BURST_SHARE and age >= self.every_s / BURST_SHARE)):
            captured = self._capture(engine, clean_seq, last_ts, active, self.fork)
            if captured is not None:
                self._uploading = True
                self._send.send_nowait(captured)

    def _capture(self, engine: Engine, clean_seq: int, last_ts: int, active: bool, fork: bool) -> Capture | None:
        """The state now, between two batches with every effect acknowledged; None if there is nothing new to
        save, or if this daemon is not the one that saves (a standby, or one that lost its lease)."""
        if clean_seq != engine.last_seq or engine.last_seq <= self.seq or not active:
            return None
        self.records_since = 0
        return capture(engine, engine.last_seq, last_ts, fork)

    async def uploads(self) -> None:
        """The part that uploads what `maybe` captured, until `close`."""
        async with self._receive:
            async for captured in self._receive:
                try:
                    await self._upload(captured, final=False)
                finally:
                    self._uploading = False

    def close(self) -> None:
        """No more captures: the upload under way finishes, then `uploads` returns."""
        self._send.close()

    async def final(self, engine: Engine, clean_seq: int, last_ts: int, active: bool) -> None:
        captured = self._capture(engine, clean_seq, last_ts, active, fork=False)  # nothing else runs now
        if captured is not None:
            await self._upload(captured, final=True)

    async def _upload(self, captured: Capture, final: bool) -> None:
        store = self.store
        t0 = time.monotonic() - captured.blocked_s
        try:
            snapshot = await packed(captured)
            manifest = await self.retry(lambda: store.save(snapshot, captured.seq, captured.ts), "snapshot")
        except Exception:
            logger.exception("snapshot failed")
            return
        self.seq = max(self.seq, captured.seq)
        self.written = time.monotonic()
        self.manifest = manifest
        self.metrics.snapshots.inc()
        self.metrics.snapshot_seq.set(captured.seq)
        self.metrics.snapshot_bytes.set(snapshot.blob_bytes)
        logger.info("snapshot written", extra={"fields": {
            "seq": captured.seq, "bytes": snapshot.blob_bytes, "stored_bytes": manifest["stored_bytes"],
            "chunks": manifest["chunks"], "forked": captured.forked, "loop_blocked_s": round(captured.blocked_s, 4),
            "total_s": round(time.monotonic() - t0, 3), "final": final}})

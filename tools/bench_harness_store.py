"""Simulated ranks forming a generation on a TCPStore: the store requests `init_process_group` makes, byte for byte as
torch 2.13's client sends them (`recovery/agent/tcpstore.py` has the wire format), thousands of ranks per process on
one asyncio loop: the harness of `tools/bench_formation.py`, which says what the traffic is and why.

Run as a script it is one client process of the bench:

    python tools/bench_harness_store.py --port P --world 16384 --backend nccl --part 0 --parts 2

It raises its soft RLIMIT_NOFILE to the hard limit (one socket per simulated rank), connects nothing until it reads
`go` on stdin (so that its interpreter's start is not timed), runs the ranks `part`, `part + parts`, ... of the world
at once, and prints one JSON object: when its first request went out, when its last rank finished each phase
(`time.monotonic()`, one clock for every process of the machine), how many ranks formed and the first errors.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import resource
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from recovery.agent.tcpstore import ADD, GET, KEY_PREFIX, MAGIC, PING, SET, VALIDATE, WAIT

MULTI_GET = 10
NCCL_UNIQUE_ID_BYTES = 128
NCCL_RANKS_PER_ROOT = 128
"""TORCH_NCCL_RANKS_PER_ROOT's default: above it NCCL's id is allgathered from one root per 128 ranks"""
GLOO_ADDRESS_BYTES = 154
"""a gloo rank's published key without its per-peer sequence numbers (host name and listening address), measured"""
PREFIX = "default_pg/0/"
"""`init_process_group`'s key space: PrefixStore("default_pg") then the group's name "0" (each joins with `/`)"""
PHASES = ("connect", "set", "get", "barrier")
BACKENDS = ("nccl", "gloo")


class Reply:
    """What the server answers a request with: nothing (set), 4 bytes (ping), 8 (add), 1 (wait), a value (get) or
    `count` values (multi-get)."""

    NONE, U32, I64, BYTE, VALUE = 0, 4, 8, 1, -1


@dataclass(frozen=True)
class Request:
    data: bytes
    reply: int
    values: int = 0  # multi-get: how many values come back
    if_last: bytes = b""  # an add: sent when its answer is the world (the last rank in), before the next request


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _key(key: str) -> bytes:
    return _string(KEY_PREFIX + key)


def connect() -> Request:
    return Request(struct.pack("<BI", VALIDATE, MAGIC) + struct.pack("<BI", PING, 0x5EED), Reply.U32)


def add(key: str, by: int) -> Request:
    return Request(bytes([ADD]) + _key(key) + struct.pack("<q", by), Reply.I64)


def set_(key: str, value: bytes) -> Request:
    return Request(bytes([SET]) + _key(key) + _string(value), Reply.NONE)


def wait(*keys: str) -> Request:
    return Request(bytes([WAIT]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys), Reply.BYTE)


def get(key: str) -> list[Request]:
    """torch's `TCPStore::get` waits for the key first: two requests on the wire."""
    return [wait(key), Request(bytes([GET]) + _key(key), Reply.VALUE)]


def multi_get(*keys: str) -> list[Request]:
    return [wait(*keys), Request(bytes([MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys),
                                 Reply.VALUE, len(keys))]


@dataclass
class Script:
    """One rank's requests, phase by phase, in the order its `init_process_group` makes them."""

    phases: list[tuple[str, list[Request]]] = field(default_factory=list)

    def add(self, phase: str, *requests: Request | list[Request]) -> None:
        flat = [r for item in requests for r in (item if isinstance(item, list) else [item])]
        self.phases.append((phase, flat))


def nccl_keys(world: int) -> list[str]:
    """The keys NCCL's unique id comes under: rank 0's alone, or one per root when the world exceeds a root's."""
    if world <= NCCL_RANKS_PER_ROOT:
        return [f"{PREFIX}/cuda//0"]
    return [f"{PREFIX}/cuda//UniqueNCCLID:{r}" for r in range(math.ceil(world / NCCL_RANKS_PER_ROOT))]


def script(backend: str, rank: int, world: int, barrier: bool) -> Script:
    """What rank `rank` of `world` sends (see `tools/bench_formation.py` for where each request comes from)."""
    s = Script()
    s.add("connect", connect())
    s.add("set", add("init/", 1))  # the client's constructor: `wait_for_workers` counts it in
    if backend == "gloo":
        # Every rank publishes its listening address and one sequence number per peer, then reads every rank's.
        own = f"{PREFIX}/cpu//0/{rank}"
        s.add("set", set_(own, bytes(GLOO_ADDRESS_BYTES + 8 * world)))
        s.add("get", *[r for peer in range(world) for r in (wait(f"{PREFIX}/cpu//0/{peer}"),
                                                            *get(f"{PREFIX}/cpu//0/{peer}"))])
    if barrier:  # `_store_based_barrier`: count in, read the count, the last one in sets the key all wait for
        key = "default_pg/store_based_barrier_key:0"
        count = add(key, 0)
        s.add("barrier", add(key, 1), Request(count.data, count.reply, if_last=set_(f"{key}:last_worker", b"1").data),
              wait(f"{key}:last_worker"))
    if backend == "nccl":  # at the first collective (or in init with `device_id`): the unique id's broadcast
        keys = nccl_keys(world)
        if rank % NCCL_RANKS_PER_ROOT == 0 and (world > NCCL_RANKS_PER_ROOT or rank == 0):
            s.add("set", set_(keys[rank // NCCL_RANKS_PER_ROOT if world > NCCL_RANKS_PER_ROOT else 0],
                              bytes(NCCL_UNIQUE_ID_BYTES)))
        if world > NCCL_RANKS_PER_ROOT:
            s.add("get", multi_get(*keys))
        elif rank != 0:
            s.add("get", get(keys[0]))
    return s


class Rank(asyncio.Protocol):
    """One simulated rank: its connection, sending one request at a time as torch's client does, and the time each
    phase ended."""

    def __init__(self, script: Script, world: int, done: asyncio.Future[None]) -> None:
        self.requests: Iterator[tuple[str, Request]] = ((p, r) for p, rs in script.phases for r in rs)
        self.world = world
        self.done = done
        self.ended: dict[str, float] = {}
        self.buffer = bytearray()
        self.phase = ""
        self.current: Request | None = None
        self.values_left = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._next()

    def _next(self) -> None:
        assert self.transport is not None
        while True:
            step = next(self.requests, None)
            if step is None:
                self.ended[self.phase] = time.monotonic()
                self.transport.close()
                if not self.done.done():
                    self.done.set_result(None)
                return
            phase, request = step
            if phase != self.phase:
                if self.phase:
                    self.ended[self.phase] = time.monotonic()
                self.phase = phase
            self.transport.write(request.data)
            if request.reply != Reply.NONE:  # a set has no answer: the next request goes out behind it
                self.current, self.values_left = request, request.values or 1
                return

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.current is not None:
            reply = self.current.reply
            if reply == Reply.VALUE:
                if len(self.buffer) < 8:
                    return
                size = 8 + struct.unpack_from("<Q", self.buffer)[0]
            else:
                size = reply
            if len(self.buffer) < size:
                return
            answer = bytes(self.buffer[:size])
            del self.buffer[:size]
            self.values_left -= 1
            if self.values_left:
                continue
            request, self.current = self.current, None
            if request.if_last and struct.unpack("<q", answer)[0] == self.world:
                assert self.transport is not None
                self.transport.write(request.if_last)
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"the store closed the connection in {self.phase}: {exc}"))


async def run_ranks(host: str, port: int, backend: str, world: int, ranks: list[int], barrier: bool,
                    timeout_s: float) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    scripts = {rank: script(backend, rank, world, barrier) for rank in ranks}  # built before the clock starts
    started = time.monotonic()
    protocols: list[Rank] = []

    async def one(rank: int) -> None:
        done: asyncio.Future[None] = loop.create_future()
        protocol = Rank(scripts[rank], world, done)
        protocols.append(protocol)
        await loop.create_connection(lambda: protocol, host, port)
        await done

    results = await asyncio.gather(*(asyncio.wait_for(one(r), timeout_s) for r in ranks), return_exceptions=True)
    errors = [f"{type(e).__name__}: {e}" for e in results if isinstance(e, BaseException)]
    ended = {phase: max((p.ended[phase] for p in protocols if phase in p.ended), default=None) for phase in PHASES}
    return {"started": started, "ended": {k: v for k, v in ended.items() if v is not None},
            "formed": len(ranks) - len(errors), "errors": errors[:5]}


def raise_open_files() -> int:
    """Soft RLIMIT_NOFILE to the hard limit: every simulated rank holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench_harness_store.py")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=BACKENDS, default="nccl")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--part", type=int, default=0)
    parser.add_argument("--parts", type=int, default=1)
    parser.add_argument("--barrier", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    ranks = list(range(args.part, args.world, args.parts))
    limit = raise_open_files()
    if len(ranks) + 64 > limit:
        raise SystemExit(f"{len(ranks)} ranks need more open files than the hard limit {limit}: use more --parts")
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    result = asyncio.run(run_ranks(args.host, args.port, args.backend, args.world, ranks, args.barrier,
                                   args.timeout_s))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

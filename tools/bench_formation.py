"""Forming a generation at scale: the store requests of 16,384 ranks' `init_process_group`, simulated, against the
job's torch store as the agent serves it and against torch's own `TCPStore(is_master=True)` server, in one run.

What a rank sends (torch 2.13, read from `torch/distributed` and recorded on the wire with a proxy before a real
server; `tools/bench_harness_store.py` replays it byte for byte, keys under `default_pg/0/` as PrefixStore makes them):

- connect: TCP connect, then VALIDATE (magic) and PING (echoed): one round trip.
- set: `ADD init/ 1` (the client's constructor: `env://` passes the world size, so `wait_for_workers` counts every
  client in; only a master would wait on it), then the backend's own key:
  - gloo (eager, the default): `SET <rank>` = its listening address (154 bytes) plus one 8-byte sequence number per
    peer: 154 + 8N bytes.
  - NCCL: nothing in `init_process_group` (its communicator is made lazily, at the first collective, or there with
    `device_id`); then rank 0 `SET 0` its 128-byte unique id, or, above TORCH_NCCL_RANKS_PER_ROOT (128) ranks, the
    scalable init: one root per 128 ranks sets `UniqueNCCLID:<root>`.
- get/wait: gloo: for every rank j, itself included, `WAIT j` (gloo's own) then torch's `get`, which is `WAIT j` and
  `GET j` on the wire: 3N requests and N(154 + 8N) bytes read per rank, 3N^2 requests in all (805 million for 16,384
  ranks, 35 TB read: gloo's eager full mesh does not form at that size through any store; GLOO_ENABLE_STORE_V2_API=1
  makes it one WAIT and one MULTI_GET of N keys, GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1 constant 154-byte keys, and
  TORCH_GLOO_LAZY_INIT=1 leaves only the SET, each measured with the proxy). NCCL: `WAIT` and `GET 0`, or the
  scalable init's `WAIT` on the 128 roots' keys and one `MULTI_GET` of them (16 KB): 2 requests per rank.
- barrier: none by default in 2.13; with TORCH_DIST_INIT_BARRIER=1, `_store_based_barrier`: `ADD key 1`,
  `ADD key 0` (the count; the rank that reads N sets `key:last_worker`) and `WAIT key:last_worker`. Timed here
  (`--no-barrier` leaves it out) because it is the one point where the store itself sees the generation formed.

So an NCCL formation of 16,384 ranks is 7 requests per rank (115,000 in all). Measured here (both servers alike), the
time goes to: the connections, half or more of it (16,384 connects at once overflow the listen queue, 4,096 here, and
the dropped SYNs come back after 1, 3, 7 s; and torch 2.13's server looks up the peer's name of every accepted
connection on its one loop thread: this machine's resolver made that 45 s for 512 connects); the scalable init's
multi-get, a third (16 KB to each rank, 268 MB in all); the `init/` and barrier counters, a second or two.
A "rank table" (the control plane publishing the generation's addresses once) cannot remove any of it while ranks
use torch's client: NCCL's ids are made by the root ranks' own processes (their bootstrap sockets), gloo's addresses
by each rank's listening socket, and the counters by the client's constructor and torch's barrier; and the job's
torch store is torch's own server (`TCPStore(is_master=True)`, libuv), so the ratio measures the same server twice:
its spread from run to run (10 s to 29 s on this shared machine) is the connect storm's, not the store's.

Metrics (medians over `--repeat`, both stores alternating which goes first):
- `formation_16384_s`: from the first rank's connect to the last rank done, on the job's torch store as the agent
  serves it (`JobStores` starts `python -m recovery.agent.rendezvous`; an agent's request gives the formation's store).
- `formation_16384_torch_store_s`, `formation_16384_ratio_to_torch_store` (median of per-run ratios; goal <= 1).
- `formation_16384_<phase>_done_s` and `..._torch_store_<phase>_done_s`: when the last rank finished the phase.
- `formation_16384_ranks_formed`: the fewest ranks that formed in a run (every one, or the run failed).
gloo (`--backend gloo`) names its figures `formation_gloo_<N>_...`.

The clients are `--clients` processes (two: this machine has two cores) of thousands of asyncio connections each;
they raise their soft RLIMIT_NOFILE to the hard limit, and so does this bench for the servers it starts (16,384
sockets). This machine's resolver answers reverse lookups slowly in bursts (5 s stalls: 45 s for 512 connects), so
the servers run where `/etc/hosts` names the loopback's IPv4-mapped address (`unshare -rm` and a bind mount, both
servers alike; `--system-resolver` keeps the machine's). Every process started here is stopped when the bench ends.

    python tools/bench.py formation [--ranks 16384] [--backend nccl|gloo] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
from bench_harness import ROOT, Emit, environment, note, sig
from bench_harness_store import BACKENDS, PHASES, raise_open_files, script

from recovery.agent.jobs import torch_store_port
from recovery.agent.stores import JobStores

CLIENT = ROOT / "tools" / "bench_harness_store.py"
HOST = "127.0.0.1"
TORCH_SERVER = ("import sys; from torch.distributed import TCPStore\n"
                "store = TCPStore(sys.argv[1], 0, is_master=True)\n"  # torch's defaults: libuv, 300 s timeout
                "print(store.port, flush=True); sys.stdin.read()")
HOSTS = "127.0.0.1 localhost\n::ffff:127.0.0.1 localhost\n"
INSIDE = "RECOVERY_BENCH_FORMATION_NAMESPACE"


def add_arguments(parser: argparse.ArgumentParser, shared: bool = True) -> None:
    """The bench's options; `shared=False` leaves out `--repeat` and `--quick`, which a bench run with it defines."""
    if shared:
        parser.add_argument("--repeat", type=int, default=3)
        parser.add_argument("--quick", action="store_true", help="256 ranks, one run (the smoke test)")
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--backend", choices=BACKENDS, default="nccl")
    parser.add_argument("--clients", type=int, default=2, help="client processes the ranks are spread over")
    parser.add_argument("--no-barrier", action="store_true", help="leave out TORCH_DIST_INIT_BARRIER's barrier")
    parser.add_argument("--system-resolver", action="store_true",
                        help="keep this machine's resolver for the servers' reverse lookups of every connection")


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def form(port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One formation of `args.ranks` simulated ranks on the store at `port`: the clients start, then go together."""
    env = environment()
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(started(
            [sys.executable, str(CLIENT), "--host", HOST, "--port", str(port), "--backend", args.backend,
             "--world", str(args.ranks), "--part", str(part), "--parts", str(args.clients),
             *([] if args.no_barrier else ["--barrier"])], env)) for part in range(args.clients)]
        for client in clients:
            assert client.stdout is not None and client.stdout.readline().strip() == "ready", "a client did not start"
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        results = []
        for client in clients:
            assert client.stdout is not None
            line = client.stdout.readline()
            if not line:
                raise RuntimeError(f"a client process exited ({client.wait()}) before it reported")
            results.append(orjson.loads(line))
    start = min(r["started"] for r in results)
    ended = {phase: max(r["ended"][phase] for r in results if phase in r["ended"]) - start
             for phase in PHASES if any(phase in r["ended"] for r in results)}
    errors = [e for r in results for e in r["errors"]]
    if errors:
        note(f"formation errors: {errors[:3]}")
    return {"s": max(ended.values()), "phases": ended, "formed": sum(r["formed"] for r in results)}


async def ours(stores: JobStores, port: int, generation: int, args: argparse.Namespace) -> dict[str, Any]:
    """A formation on the job's torch store of `generation`, which an agent's request makes (as a job restart)."""
    formation = await torch_store_port(HOST, port, "bench-job", generation, True, 60.0)
    if formation is None:
        raise RuntimeError("the job store served no torch store")
    return await anyio.to_thread.run_sync(form, formation, args)


def theirs(args: argparse.Namespace) -> dict[str, Any]:
    """A formation on torch's own server, started fresh for it with its defaults."""
    with started([sys.executable, "-c", TORCH_SERVER, HOST], environment()) as server:
        assert server.stdout is not None
        return form(int(server.stdout.readline()), args)


async def compare(args: argparse.Namespace) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    runs = []
    stores = JobStores(HOST)
    port = free_port()
    try:
        await stores.serve("bench-job", port)
        for index in range(args.repeat):
            if index % 2:  # alternate which store goes first: a warmer machine favours neither
                torch_run = await anyio.to_thread.run_sync(theirs, args)
                our_run = await ours(stores, port, index, args)
            else:
                our_run = await ours(stores, port, index, args)
                torch_run = await anyio.to_thread.run_sync(theirs, args)
            note(f"run {index + 1}: ours {our_run['s']:.3f}s {our_run['phases']}, torch's {torch_run['s']:.3f}s "
                 f"{torch_run['phases']}")
            runs.append((our_run, torch_run))
    finally:
        await stores.aclose()
    return runs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def in_named_loopback(args: argparse.Namespace) -> bool:
    """Run this bench again where `/etc/hosts` names the loopback's mapped address; False where that cannot be."""
    if os.environ.get(INSIDE) or not shutil.which("unshare"):
        return False
    hosts = Path(tempfile.mkdtemp(prefix="bench-formation-")) / "hosts"
    hosts.write_text(HOSTS)
    try:
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {hosts} /etc/hosts"],
                               capture_output=True, check=False)
        if probe.returncode != 0:
            note("the servers keep this machine's resolver: no mount namespace here")
            return False
        command = f"mount --bind {hosts} /etc/hosts && exec \"$@\""
        argv = [str(Path(__file__)), "--ranks", str(args.ranks), "--backend", args.backend, "--repeat",
                str(args.repeat), "--clients", str(args.clients), *(["--quick"] if args.quick else []),
                *(["--no-barrier"] if args.no_barrier else [])]
        done = subprocess.run(["unshare", "-rm", "sh", "-c", command, "sh", sys.executable, *argv],
                              env={**os.environ, INSIDE: "1"}, check=False)
        if done.returncode:
            raise SystemExit(done.returncode)
        return True
    finally:
        shutil.rmtree(hosts.parent, ignore_errors=True)


def measure(args: argparse.Namespace, emit: Emit) -> None:
    if not args.system_resolver and in_named_loopback(args):
        return  # measured again in the namespace, whose figures went to the same stdout
    if args.quick:
        args.ranks, args.repeat = min(args.ranks, 256), 1
    raise_open_files()  # the servers started here inherit it: one socket per rank
    name = f"formation_{args.ranks}" if args.backend == "nccl" else f"formation_{args.backend}_{args.ranks}"
    per_rank = sum(len(r) for _, r in script(args.backend, 1, args.ranks, not args.no_barrier).phases)
    note(f"{args.ranks} ranks ({args.backend}), {per_rank} requests for a rank that is no root, "
         f"{args.clients} client processes")
    runs = anyio.run(compare, args)
    bench = "formation"
    ours_s = [o["s"] for o, _ in runs]
    torch_s = [t["s"] for _, t in runs]
    emit(bench, f"{name}_s", sig(statistics.median(ours_s)), "s")
    emit(bench, f"{name}_torch_store_s", sig(statistics.median(torch_s)), "s")
    emit(bench, f"{name}_ratio_to_torch_store", sig(statistics.median(o / t for o, t in zip(ours_s, torch_s,
                                                                                                strict=True))), "x")
    for phase in PHASES:
        if all(phase in o["phases"] for o, _ in runs):
            emit(bench, f"{name}_{phase}_done_s", sig(statistics.median(o["phases"][phase] for o, _ in runs)), "s")
            emit(bench, f"{name}_torch_store_{phase}_done_s",
                 sig(statistics.median(t["phases"][phase] for _, t in runs)), "s")
    emit(bench, f"{name}_ranks_formed", min(min(o["formed"], t["formed"]) for o, t in runs), "ranks")
    emit(bench, f"{name}_requests_per_rank", per_rank, "requests")


def main() -> None:
    from bench_harness import emit

    parser = argparse.ArgumentParser(prog="python tools/bench_formation.py")
    add_arguments(parser)
    measure(parser.parse_args(), emit)


if __name__ == "__main__":
    main()

"""`recovery-run`: run a torchrun script under the recovery control plane, with torchrun's flags.

    recovery-run --standalone --nproc-per-node 4 train.py --epochs 10
    recovery-run --standalone --nnodes 2 --nproc-per-node 2 --spares 1 --max-restarts 3 train.py
    recovery-run --nats-url nats://nats-0:4222 --nodes gpu-1,gpu-2 --nproc-per-node 8 \\
        --rdzv-endpoint store-0:29400 --rdzv-id llama-7b train.py
    sbatch -N 2 --requeue --wrap 'recovery-run --nats-url nats://nats-0:4222 --nproc-per-node 8 train.py'

`--standalone` starts everything on this host: a `recovery-daemon` on its embedded JetStream, a job store and one
`recovery-agent` per node of `--nnodes` (plus `--spares`), all under `--data-dir`. With `--nats-url` it submits the
job to the daemon of that cluster, whose agents run on `--nodes`; inside a Slurm allocation (`sbatch`, `salloc`)
the nodes default to the allocation's, and the job names the allocation (docs/slurm.md). Either way it follows the
job, printing its recoveries (and, standalone, its ranks' output, prefixed `[rank<r>]:`), and exits with the job's
end: the exit status below. Ctrl-C or SIGTERM cancels the job: its ranks get the signal (Ctrl-C: SIGINT, as torchrun
passes it on) and `--stop-grace` seconds to save and end by themselves before they are killed (a second Ctrl-C ends
the wait), then every process it started is stopped.
docs/recovery-run.md has the details: every flag, the ranks' environment, and how torchrun's flags map to the job
spec.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from events.subjects import check_token
from recovery.cli.ctl import CtlFailure, load_spec, request
from recovery.cli.follow import JobFollower, RankOutput, follow
from recovery.cli.local_stack import LocalStack, StackFailed
from recovery.slurm.allocation import Allocation, AllocationError, from_environment

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's own code for a bad command line; also a spec the daemon refused
EXIT_CANCELLED = 3
EXIT_NO_CONTROL_PLANE = 4
EXIT_SIGNAL_BASE = 128  # + the signal's number: 130 after Ctrl-C, 143 after SIGTERM
DEFAULT_STORE_PORT = 29500
CANCEL_WAIT_S = 20.0
"""how long the cancel's decision is waited for"""
STOP_GRACE_S = 30.0
"""a cancelled job's ranks' time to end by themselves after the signal, as torchrun gives its workers"""
STOPPED_MARGIN_S = 15.0
"""beyond the grace: the agents' kill and their reports of the exits"""

EXIT_CODES = f"""exit status:
  {EXIT_COMPLETED}    the job completed
  {EXIT_FAILED}    the job failed (its restarts used up, or nothing could recover it)
  {EXIT_USAGE}    bad usage, or the daemon refused the job's spec
  {EXIT_CANCELLED}    the job was cancelled (recovery-ctl cancel)
  {EXIT_NO_CONTROL_PLANE}    the control plane could not be started (standalone) or reached (--nats-url)
  130  interrupted by Ctrl-C (SIGINT), 143 by SIGTERM: the job was cancelled"""

ENDS = {"completed": EXIT_COMPLETED, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """A flag under torchrun's two spellings: `--a-b` and `--a_b`."""
    names = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    parser.add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-run", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    torchrun = parser.add_argument_group("torchrun's flags")
    _flag(torchrun, "nnodes", default=None, help="number of nodes (an integer, or MIN:MAX with MIN = MAX); "
                                                 "standalone: agents started on this host (default 1)")
    _flag(torchrun, "nproc-per-node", default="1", help="ranks per node: an integer, or `cpu` (this host's CPUs)")
    _flag(torchrun, "max-restarts", type=int, default=None,
          help="the job's restart budget (the spec's max_restarts); default: the rescheduling policy's own")
    _flag(torchrun, "rdzv-endpoint", default="", help="HOST:PORT of a job store the platform runs "
                                                      "(`python -m recovery.agent.rendezvous --serve`): the job's "
                                                      "rendezvous is `external`; ignored with --standalone")
    _flag(torchrun, "rdzv-id", default="", help="the job's id (default: run-<random>)")
    _flag(torchrun, "rdzv-backend", default="c10d", help="accepted for torchrun's command lines; ignored")
    _flag(torchrun, "rdzv-conf", default="", help="accepted for torchrun's command lines; ignored")
    _flag(torchrun, "standalone", action="store_true",
          help="start a daemon (on an embedded JetStream), a job store and the agents on this host")
    _flag(torchrun, "master-addr", default="", help="without --rdzv-endpoint: the address of the job's first "
                                                    "node, whose agent serves the job store (default: that node's "
                                                    "name)")
    _flag(torchrun, "master-port", type=int, default=DEFAULT_STORE_PORT,
          help=f"the job store's port there (default {DEFAULT_STORE_PORT})")
    _flag(torchrun, "node-rank", type=int, default=0, help="accepted for torchrun's command lines; ignored: "
                                                           "recovery-run runs once per job, not once per node")
    _flag(torchrun, "monitor-interval", default="", help="accepted for torchrun's command lines; ignored")
    torchrun.add_argument("-m", "--module", action="store_true", help="the script is a module: `python -m`")
    _flag(torchrun, "no-python", action="store_true", help="run the script itself, not `python script`")
    _flag(torchrun, "log-dir", default="", help="standalone: the data directory (--data-dir)")
    ours = parser.add_argument_group("recovery-run's own")
    _flag(ours, "nats-url", default="", help="the cluster's NATS: submit to its daemon instead of --standalone")
    _flag(ours, "nodes", default="", help="with --nats-url: the job's nodes, comma-separated (their agents run); "
                                         "default inside a Slurm allocation: its nodes (SLURM_JOB_NODELIST)")
    _flag(ours, "spares", type=int, default=0, help="standalone: spare agents to start beside the job's")
    _flag(ours, "shards", type=int, default=0,
          help="ranks of distinct model state in one replica: FSDP's shard dimension (the world on a 1-D mesh), "
               "tensor x pipeline parallel; the layout's tp x pp (default 1: every rank a replica, as in DDP)")
    _flag(ours, "data-dir", default="", help="standalone: where the daemon, the agents and the ranks' output "
                                             "live (default: a new temporary directory, kept)")
    _flag(ours, "spec", default="", help="a job spec file (JSON or TOML) whose fields the flags complete: "
                                         "policies, watchdog_interval_s, spares, layout's tp and pp...")
    ours.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="set in the ranks' environment (repeatable); standalone ranks also inherit this one")
    ours.add_argument("--quiet", action="store_true", help="standalone: do not print the ranks' output")
    _flag(ours, "stop-grace", type=float, default=STOP_GRACE_S,
          help="after Ctrl-C or SIGTERM: the seconds the ranks get to save and end by themselves after the signal, "
               f"before they are killed (default {STOP_GRACE_S:g}; 0 kills them at once)")
    parser.add_argument("script", help="the training script (or module, or program)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


class UsageError(Exception):
    pass


def nodes_count(args: argparse.Namespace) -> int | None:
    if args.nnodes is None:
        return None
    low, _, high = str(args.nnodes).partition(":")
    try:
        count, top = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"--nnodes {args.nnodes!r}: an integer, or MIN:MAX") from None
    if count != top or count < 1:
        raise UsageError(f"--nnodes {args.nnodes}: an elastic range is the spec's `elastic` (give it with --spec), "
                         f"not a node count")
    return count


def ranks_per_node(args: argparse.Namespace) -> int:
    value = str(args.nproc_per_node)
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        count = int(value)
    except ValueError:
        raise UsageError(f"--nproc-per-node {value!r}: an integer or `cpu`") from None
    if count < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    return count


def build_spec(args: argparse.Namespace, nodes: list[str], store: tuple[str, int], rendezvous: str,
               allocation: Allocation | None = None) -> dict[str, Any]:
    """The job spec: the --spec file's fields, completed by the flags (which win)."""
    spec: dict[str, Any] = dict(load_spec(args.spec)) if args.spec else {}
    spec.pop("job", None)
    rpn = ranks_per_node(args)
    layout = dict(spec.get("layout") or {})
    if args.shards:
        pp = int(layout.get("pp", 1))
        if args.shards % pp or ("tp" in layout and int(layout["tp"]) * pp != args.shards):
            raise UsageError(f"--shards {args.shards} disagrees with the spec's layout (tp {layout.get('tp', 1)} x "
                             f"pp {pp})")
        layout["tp"] = args.shards // pp  # the engine counts distinct state as tp x pp, tensor parallel fastest
    shards = int(layout.get("tp", 1)) * int(layout.get("pp", 1))
    world = len(nodes) * rpn
    if world % shards:
        raise UsageError(f"{world} ranks are not a multiple of the layout's tp x pp = {shards}")
    layout["dp"] = world // shards
    if args.no_python:
        command, arguments = args.script, list(args.script_args)
    elif args.module:
        command, arguments = sys.executable, ["-m", args.script, *args.script_args]
    else:
        command, arguments = sys.executable, [args.script, *args.script_args]
    entrypoint = dict(spec.get("entrypoint") or {})
    env = dict(entrypoint.get("env") or {})
    env.update({"MASTER_ADDR": store[0], "MASTER_PORT": str(store[1])})
    if rpn > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks per node
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: KEY=VALUE")
        env[key] = value
    entrypoint.update(command=command, args=arguments, cwd=entrypoint.get("cwd") or os.getcwd(), env=env,
                      rendezvous=rendezvous)
    spec.update(nodes=nodes, ranks_per_node=rpn, layout=layout, entrypoint=entrypoint)
    if args.max_restarts is not None:
        spec["max_restarts"] = args.max_restarts
    if allocation is not None:
        spec["scheduler_job"] = {"scheduler": "slurm", "id": allocation.job_id, "restarts": allocation.restarts}
    return spec


def slurm_allocation(args: argparse.Namespace) -> Allocation | None:
    """The Slurm allocation recovery-run runs in, when the job runs on a cluster (not --standalone)."""
    if args.standalone:
        return None
    try:
        return from_environment(os.environ)
    except AllocationError as exc:
        raise UsageError(str(exc)) from None


async def _connect(url: str) -> Client:
    async def quietly(exc: Exception) -> None:
        del exc  # nats-py's default prints a traceback for every failed reconnection; it reconnects by itself

    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, name="recovery-run",
                              error_cb=quietly)


async def _job_state(url: str, job: str) -> str | None:
    with contextlib.suppress(CtlFailure, KeyError):
        reply = await request(url, "job", {"job": job}, 5.0)
        if reply.get("ok"):
            return str(reply["job"]["state"])
    return None


def check_usage(args: argparse.Namespace) -> None:
    """What can be checked before anything starts, so that a mistake costs no stack, no job and no restarts: the
    flags' values and the spec file (the script: `check_script`). Raises UsageError with what to fix."""
    nodes_count(args)
    ranks_per_node(args)
    for item in args.env:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: KEY=VALUE")
    if args.spares < 0:
        raise UsageError(f"--spares {args.spares}: 0 or more")
    if args.shards < 0:
        raise UsageError(f"--shards {args.shards}: 1 or more (0: the spec's layout)")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: 0 or more")
    if not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port {args.master_port}: a TCP port, 1..65535")
    if args.spec:
        try:
            load_spec(args.spec)  # a file that is missing or not a spec: its own error, before anything starts
        except CtlFailure as exc:
            raise UsageError(f"--spec {args.spec}: {exc}") from None


def check_script(args: argparse.Namespace) -> None:
    """The script is there to run (checked once the flags are: a bad flag is the first thing to fix)."""
    if args.module:
        return  # found by the ranks' `python -m`, on their sys.path: nothing to look at here
    if args.no_python:
        if args.standalone and shutil.which(args.script) is None:
            raise UsageError(f"{args.script}: no such program (with --no-python the script is run as a program)")
        return
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"{args.script}: no such script in {os.getcwd()}" if not script.exists()
                         else f"{args.script}: not a file")


def usable_data_dir(data_dir: Path) -> None:
    """The data directory exists, or can be made, and takes files: checked before anything starts, so that a
    directory the daemon could not write is said as such rather than as a daemon that died at start."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if not data_dir.is_dir():
        raise NotADirectoryError(20, "not a directory", str(data_dir))
    tempfile.TemporaryFile(dir=data_dir).close()


async def run(args: argparse.Namespace) -> int:
    check_usage(args)
    allocation = slurm_allocation(args)
    job = args.rdzv_id or (allocation.run_name if allocation is not None else f"run-{secrets.token_hex(4)}")
    try:
        check_token(job)
    except ValueError as exc:
        raise UsageError(f"--rdzv-id {job!r}: {exc}") from None
    count = nodes_count(args)
    stack: LocalStack | None = None
    nc: Client | None = None
    interrupted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(
            signum, lambda s=signum: interrupted.done() or interrupted.set_result(s))
    follower = JobFollower(job, defer_verdict=bool(args.standalone))  # standalone: said last, after the stop
    postmortem = ""
    try:
        if args.standalone:
            check_script(args)
            data_dir = Path(args.data_dir or args.log_dir or tempfile.mkdtemp(prefix="recovery-run-")).resolve()
            try:
                usable_data_dir(data_dir)
            except OSError as exc:
                follower.say(f"the control plane cannot start: --data-dir {data_dir}: {exc.strerror or exc}")
                return EXIT_NO_CONTROL_PLANE
            nodes = [f"node{i}" for i in range(count or 1)]
            stack = LocalStack(data_dir, nodes, [f"spare{i}" for i in range(args.spares)], ranks_per_node(args))
            follower.say(f"starting a daemon, a job store and {len(nodes) + args.spares} agent(s) in {data_dir}")
            starting = asyncio.ensure_future(stack.start(_connect))
            await asyncio.wait([starting, interrupted], return_when=asyncio.FIRST_COMPLETED)
            if interrupted.done():
                starting.cancel()
                return EXIT_SIGNAL_BASE + interrupted.result()
            nc = starting.result()
            url = stack.url
            spec = build_spec(args, nodes, ("127.0.0.1", stack.store_port), "external")
            output = None if args.quiet else RankOutput([stack.runtime_dir(n) for n in [*nodes, *stack.spares]], job)
        else:
            if not args.nats_url:
                raise UsageError("give --standalone, or --nats-url of a cluster (with --nodes)")
            nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
            if not nodes and allocation is not None:
                nodes = allocation.nodes  # the scheduler placed the job: its nodes are the allocation's
                follower.say(f"Slurm job {allocation.job_id}: {len(nodes)} node(s) allocated")
            if not nodes:
                raise UsageError("--nats-url needs --nodes (or a Slurm allocation): the nodes whose agents run the job")
            if count is not None and count != len(nodes):
                raise UsageError(f"--nnodes {count} but {len(nodes)} --nodes")
            if args.rdzv_endpoint:
                host, _, port = args.rdzv_endpoint.rpartition(":")
                if not host or not port.isdigit():
                    raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: HOST:PORT")
                store, rendezvous = (host, int(port)), "external"
            else:
                store, rendezvous = (args.master_addr or nodes[0], args.master_port), "agent"
            check_script(args)  # the nodes run it at the same path (a shared image or file system)
            url = args.nats_url
            spec = build_spec(args, nodes, store, rendezvous, allocation)
            try:
                nc = await asyncio.wait_for(_connect(url), 10.0)
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                follower.say(f"cannot reach NATS at {url}: {exc or type(exc).__name__}")
                return EXIT_NO_CONTROL_PLANE
            output = None
        await follower.subscribe(nc)
        reply = await request(url, "submit", {"job": job, "spec": spec, "id": f"{job}:submitted"}, 10.0)
        if not reply.get("ok") or reply.get("rejections"):
            why = reply.get("error") or "; ".join(r["reason"] for r in reply.get("rejections", []))
            follower.say(f"the daemon refused {job}: {why}")
            return EXIT_USAGE
        ranks = len(nodes) * spec["ranks_per_node"]
        follower.say(f"submitted {job}: {ranks} rank(s) on {', '.join(nodes)}")
        postmortem = (f"recovery-replay report {shlex.quote(str(stack.data_dir))}" if stack is not None else
                      f"recovery-replay report --nats {shlex.quote(url)} --job {job}")
        following = asyncio.ensure_future(follow(follower, output, lambda: _job_state(url, job)))
        await asyncio.wait([following, interrupted], return_when=asyncio.FIRST_COMPLETED)
        if not interrupted.done():
            if stack is None:
                follower.say(f"postmortem: {postmortem}")  # the last line: where to read what happened
            return ENDS.get(following.result(), EXIT_FAILED)
        signum = interrupted.result()
        await cancel(url, job, follower, following, signum, max(0.0, args.stop_grace), output)
        return EXIT_SIGNAL_BASE + signum
    except StackFailed as exc:
        follower.say(f"the control plane did not start: {exc}")
        return EXIT_NO_CONTROL_PLANE
    except CtlFailure as exc:
        follower.say(str(exc))
        return EXIT_NO_CONTROL_PLANE
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
        if stack is not None:
            follower.say("stopping the agents, the job store and the daemon")
            await asyncio.to_thread(stack.stop)
            follower.say(f"logs: {stack.data_dir} (the daemon's in daemon.log, each agent's in agent-<node>.log)")
            if follower.ended.is_set():
                follower.say(follower.verdict())  # how the job ended, and why: said here only (`defer_verdict`)
            if postmortem:
                # the last line: the log stays in the data directory, which recovery-replay reads as it is
                follower.say(f"postmortem: {postmortem}")


async def cancel(url: str, job: str, follower: JobFollower, following: asyncio.Future[str], signum: int,
                 grace_s: float, output: RankOutput | None) -> None:
    """Cancel the job, its ranks sent `signum` (SIGINT or SIGTERM) and `grace_s` to end by themselves, and wait for
    its decision, then for every rank to end (their handlers may be saving); a second interrupt ends the wait."""
    name = signal.Signals(signum).name
    follower.say(f"{name}: cancelling {job}" + (f"; its ranks get {name} and {grace_s:g}s to save and end "
                                                "(Ctrl-C again: stop waiting)" if grace_s > 0 else ""))
    again = asyncio.Event()
    loop = asyncio.get_running_loop()
    for each in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(each, again.set)
    body: dict[str, object] = {"job": job, "reason": f"recovery-run got {name}", "grace_s": float(grace_s),
                               "signal": name if name in ("SIGINT", "SIGTERM") else "SIGTERM"}
    with contextlib.suppress(CtlFailure):
        await request(url, "cancel", body, 5.0)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(following), CANCEL_WAIT_S)
    following.cancel()
    deadline = time.monotonic() + grace_s + STOPPED_MARGIN_S
    while grace_s > 0 and follower.live and not again.is_set() and time.monotonic() < deadline:
        if output is not None:
            output.poll()  # what the ranks print on their way out (their handlers' saves)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(follower.stopped.wait(), 0.1)
    if output is not None:
        output.poll(final=True)
    if grace_s > 0 and follower.live:
        follower.say(f"ranks {sorted(rank for rank, _ in follower.live)} still running: stopping without them"
                     if not again.is_set() else "not waiting for the ranks any more")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except (UsageError, OSError, ValueError) as exc:
        print(f"recovery-run: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

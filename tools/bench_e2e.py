"""`python tools/bench.py e2e`: a rank's fault on real processes, from the SIGKILL until the job again completes the
step it was on, on our stack and under torchrun, in the same run.

    python tools/bench.py e2e               # 3 repeats of every case, medians
    python tools/bench.py e2e --quick       # one of each, shorter job (the smoke test)
    python tools/bench.py e2e --only torchrun cold --repeat 5
    python tools/bench.py e2e --only memory

The job is `examples/dp-training/train.py`: 4 data-parallel ranks on gloo (two nodes of two ranks), a step of
`--step-time` (0.1 s of sleep standing in for compute, plus the small model's own step), a checkpoint every 20
steps, the same seed everywhere. The fault is a SIGKILL of rank 2 once the job has completed `--fault-at` steps
(default 50: half way between two checkpoints, torchrun's expected loss). Cases, interleaved in every repeat:

- `cold`: nats-server, `recovery-daemon` and a `recovery-agent` per node, each a process of its own; the agent
  restarts the dead rank alone with a new interpreter, the three others keep their processes and hand it their
  state (the resume plan's `peer` tier).
- `warm`: the same with the job's warm standby (`RECOVERY_STANDBY=1` in the entrypoint's environment): the agent
  hands the rank to an interpreter that has already imported torch (`recovery/agent/standby.py`).
- `torchrun`: `torchrun --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d` with
  `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, without which torchrun cannot restart a gloo job at all
  (pytorch/pytorch#135712); its other settings are its defaults (a monitor interval of 0.1 s). On a failure it
  stops every worker and starts four new ones, which resume from the newest periodic checkpoint. The workers run
  the same script through `tools/torchrun_rank.py`, and their SDK reports to a socket this bench serves.
- `sigstop`: rank 1 of a `cold` job SIGSTOPped: until the engine's `fault.confirmed` (the job's spec: watchdog
  every 1 s, `hang_min_silence_s` 5 s, heartbeats every 0.5 s); once recovered the job is cancelled.
- `stock`: an unmodified torchrun script (`examples/ddp-tutorial/stock.py`: DDP, rank 0's snapshot every epoch,
  nothing of `recovery`) on 4 ranks of this host under `recovery-run --standalone` (as the agents come, cold: `--env
  RECOVERY_STANDBY=0`, and with a warm standby per rank the kill waits for: `--env RECOVERY_STANDBY=all`) and under
  torchrun, rank 1 SIGKILLed after step 20, and after step 5 (`tools/bench_stock.py`): `stock_ratio_to_torchrun`
  (the default), `stock_cold_ratio_to_torchrun`, `stock_warm_ratio_to_torchrun`, `stock_early_kill_ratio_to_torchrun`.
- `ddp`: the same tutorial script converted to the SDK (`with_sdk.py`, group timeout 60 s) under `recovery-run`
  against `original.py` under torchrun, rank 1 SIGKILLed after step 20, and two ranks killed together
  (`tools/bench_ddp.py`): `ddp_sdk_ratio_to_torchrun` (as recovery-run starts it: a warm standby per node),
  `ddp_sdk_cold_ratio_to_torchrun` (`RECOVERY_STANDBY=0`), `ddp_double_fault_processes_restarted`.
- `memory`: the in-memory checkpoint tier (`tools/bench_memory.py`): the training stall of `client.save_async`
  against a synchronous `torch.save` + fsync of the same 150 MB state in the same process
  (`memory_ckpt_stall_ratio_to_torch_save`, goal 0.1), and a restarted process's time until its state is loaded from
  its node's memory against from storage (`memory_restore_ratio_to_storage`); the agent's part is played by the
  agent's own channel and memory tier.
- `faultfree`: nothing fails (`tools/bench_faultfree.py`): `stock.py` under both launchers and `with_sdk.py` under
  `recovery-run` (warm standbys on, as by default) against `original.py` under torchrun, run to their end in
  alternating pairs; `fault_free_ratio_to_torchrun` is the worse script's median ratio of wall times (goal 1.05).
- `overhead`: the SDK's cost in a loop of 100 ms steps (single-threaded torch matmuls), in pairs of ten-step
  blocks, one with the SDK (a client connected to a socket, heartbeats every second, `report_step` every step)
  and one without, in alternating order; CPU time of the process (its heartbeat thread included), so that other
  processes' load is not counted. `sdk_overhead_pct` is 100 x (the median of the pairs' ratios - 1): on a shared
  machine a block's CPU time moves by a few percent, so it says "below a few percent", no finer;
  `sdk_report_step_us` times one `report_step` directly, and `sdk_cost_pct` is what one per step and one
  heartbeat a second (the same send) cost as a share of the step.

Figures (per case, the median over `--repeat`). `recovered_s`: from the SIGKILL until the first report of a
step past the one the job had completed when it struck (a process restarted after the fault reporting it), so
that recomputed steps count. Its phases, each ending where the next begins:

- ours (times are the log's: JetStream timestamps of the records, the SIGKILL on the same host's clock):
  `detect` until the agent's `process.exited` of the rank (waitpid); `decide` until the restart command is in
  the command stream the agents read (the engine decided, the daemon published it); `stop` until the
  replacement's `process.started` (the command reaches the agent, which makes sure the rank's session is gone and
  starts the replacement or hands the rank to the standby); `restart` until the process group of the new
  generation is formed (the last survivor's first report in it: the replacement's interpreter, imports, model,
  rendezvous); `catch_up` the steps trained after that until the recovered step, times the job's median step
  time before the fault; `load_state` the rest (agreeing on the step, receiving a live replica's state, and what
  the replacement's first step costs beyond a step: its first backward pass, for one).
- torchrun (times are this bench's, when the SDK's messages and disconnections reach its socket): `stop` until
  the last worker of the failed group is gone (torchrun notices the exit, SIGTERMs the others, they exit:
  detection and decision are inside); `restart` until the first worker of the new group says hello (the
  rendezvous, new interpreters); `load_state` until its first completed step, less one step time (imports, model,
  process group, checkpoint read); `catch_up` the steps from the checkpoint to the recovered one, that first
  step included, times the median step time.

`processes_restarted` counts the processes started after the fault; `ratio_<case>_to_torchrun` is the median of
the per-repeat ratios of `recovered_s` (each repeat runs the cases back to back). Every run's final parameters
are compared with the first run's (same seed): a difference is a warning on stderr.

Every process started (nats-server, the daemon, the agents, the ranks, torchrun and its workers, standbys) is
stopped when the bench ends, however it ends: process groups are killed in `finally` blocks, and SIGTERM unwinds
through them as Ctrl-C does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from bench_harness import ROOT, Emit, environment, note, sig
from bench_harness_daemon import Daemon, nats_server
from bench_harness_phases import WORLD, Outcome, confirmed_after, phases_of_ours
from nats.aio.msg import Msg

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from recovery.log.jetstream import JetStreamLog
from recovery.testing.nats import free_port

TRAIN = ROOT / "examples" / "dp-training" / "train.py"
TORCHRUN_RANK = Path(__file__).resolve().parent / "torchrun_rank.py"
NODES = ["n0", "n1"]
VICTIM = 2
STOPPED = 1
CHECKPOINT_EVERY = 20
MAX_RESTARTS = 3
TORCHRUN_SETTING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
HEARTBEAT_S = 0.5
HANG_MIN_SILENCE_S = 5.0
ENDING_SILENCE_S = 15.0
"""the SIGKILL jobs' `hang_min_silence_s`: their ranks fall silent when their SDK closes, and on a loaded machine an
interpreter with torch loaded can take more than 5 s to exit after that (the SIGSTOPped job is cancelled instead)"""
WATCHDOG_S = 1.0
POLL_S = 0.01
CASES = ("cold", "warm", "torchrun", "sigstop", "overhead", "stock", "ddp", "memory", "faultfree", "frameworks",
         "fsdp")
BENCH = "e2e"


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(POLL_S)  # polling interval of a deadline-bounded wait


def kill_sessions(pids: set[int]) -> None:
    """Every rank runs in a session of its own (ours and torchrun's): kill each whole."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM (an agent stops its ranks on it), then SIGKILL of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    if proc.returncode is None or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- the job ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobShape:
    steps: int
    step_time: float
    fault_at: int

    def args(self, out: Path, checkpoints: Path) -> list[str]:
        return ["--steps", str(self.steps), "--step-time", str(self.step_time), "--out", str(out),
                "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-dir", str(checkpoints)]


# -- our stack -------------------------------------------------------------------------------------------------
@dataclass
class Stack:
    """nats-server, recovery-daemon and an agent per node, with the pids of every rank they started."""

    url: str
    workdir: Path
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    rank_pids: set[int] = field(default_factory=set)


@contextlib.contextmanager
def stack(workdir: Path) -> Iterator[Stack]:
    with nats_server(workdir / "nats") as server, \
            Daemon(workdir / "daemon", server.url, lease_ttl_s=0, snapshot_fork=False) as daemon:
        daemon.start()
        daemon.wait_ready(120)
        state = Stack(server.url, workdir)
        try:
            asyncio.run(_start_agents(state))
            yield state
        finally:
            for agent in state.agents:
                stop_process(agent)
            kill_sessions(state.rank_pids)


async def _start_agents(state: Stack) -> None:
    nc = await nats.connect(state.url)
    try:
        ready: set[str] = set()

        async def on_node(msg: Msg) -> None:
            ready.add(msg.subject.split(".")[3])

        await nc.subscribe("recovery.ev.node.>", cb=on_node)
        for node in NODES:
            runtime = state.workdir / node
            runtime.mkdir(parents=True, exist_ok=True)
            with (runtime / "agent.log").open("ab") as log:
                state.agents.append(subprocess.Popen(
                    [sys.executable, "-m", "recovery.cli.agent", "--node", node, "--nats-url", state.url,
                     "--runtime-dir", str(runtime), "--heartbeat-s", str(HEARTBEAT_S), "--kill-grace-s", "3"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=environment(),
                    start_new_session=True))
        await wait_until(lambda: ready >= set(NODES), 120, "the agents to report their nodes")
    finally:
        await nc.close()


def job_spec(shape: JobShape, out: Path, checkpoints: Path, master_port: int, warm: bool,
             hang_min_silence_s: float) -> dict[str, Any]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "PYTHONPATH": environment()["PYTHONPATH"],
           "OMP_NUM_THREADS": "1"}  # what torchrun sets for its workers: the same job on both
    env["RECOVERY_STANDBY"] = "1" if warm else "0"  # cold: none, whatever the agents' default
    return {
        "nodes": NODES, "ranks_per_node": 2, "layout": {"dp": WORLD}, "watchdog_interval_s": WATCHDOG_S,
        "policies": {"detection": {"name": "default", "params": {"hang_min_silence_s": hang_min_silence_s}}},
        "entrypoint": {"command": sys.executable, "args": [str(TRAIN), *shape.args(out, checkpoints)],
                       "cwd": str(ROOT), "env": env},
    }


@dataclass
class Watch:
    """A job's events and decisions as they arrive (core NATS, for the bench's triggers)."""

    steps: dict[int, int] = field(default_factory=dict)
    pids: dict[int, list[int]] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)
    recovered_at: int | None = None  # the first report past `target` from a restarted process (time.time_ns)
    target: int | None = None
    generations: dict[int, int] = field(default_factory=dict)  # the generation each rank's newest process started in
    exited: set[tuple[int, int]] = field(default_factory=set)  # (rank, generation)

    def on_event(self, msg: Msg) -> None:
        envelope = json.loads(msg.data)
        data = envelope.get("data", {})
        if envelope["type"] in ("progress.step", "progress.report"):
            # an agent folds its ranks' steps into one report per period (and sends a rank's first step of a
            # generation at once); an older one sends each step on its own
            for word in data["ranks"] if envelope["type"] == "progress.report" else [data]:
                rank, step = word["rank"], word.get("step")
                if step is None:
                    continue
                self.steps[rank] = max(self.steps.get(rank, -1), step)
                if self.target is not None and self.recovered_at is None and word.get("attempt", 0) >= 1 \
                        and step > self.target:
                    self.recovered_at = time.time_ns()
        elif envelope["type"] == "process.started":
            self.pids.setdefault(data["rank"], []).append(data["pid"])
            self.generations[data["rank"]] = data["attempt"]
        elif envelope["type"] == "process.exited":
            self.exited.add((data["rank"], data["attempt"]))

    def all_exited(self) -> bool:
        return all((rank, attempt) in self.exited for rank, attempt in self.generations.items())

    def on_decision(self, msg: Msg) -> None:
        self.kinds.append(json.loads(msg.data)["data"]["kind"])

    def job_step(self) -> int:
        return min(self.steps.get(r, -1) for r in range(WORLD))


async def run_ours(stack_: Stack, job: str, shape: JobShape, warm: bool, fault: str) -> tuple[Outcome, float]:
    """Submit the job, strike at `shape.fault_at`, wait for it to complete; the outcome and, for a SIGSTOP, the
    seconds until the fault was confirmed."""
    workdir = stack_.workdir / job
    workdir.mkdir(parents=True)
    out = workdir / "final.pt"
    nc = await nats.connect(stack_.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream(timeout=10.0)
        log = JetStreamLog(nc, js, "RECOVERY", owns_connection=False)
        commands = JetStreamLog(nc, js, "RECOVERY_CMD", owns_connection=False)
        start_seq = await log.last_seq() + 1
        command_seq = await commands.last_seq() + 1
        w = Watch()
        await nc.subscribe(f"{subjects.PREFIX}.ev.job.{job}.>", cb=_async(w.on_event))
        await nc.subscribe(subjects.decision(job), cb=_async(w.on_decision))
        spec = job_spec(shape, out, workdir / "checkpoints", free_port(), warm,
                        HANG_MIN_SILENCE_S if fault == "stop" else ENDING_SILENCE_S)
        envelope = make_envelope("job.submitted", {"spec": spec}, id=f"{job}:submitted", job=job, source="bench")
        await js.publish(subjects.job_event(job, "job.submitted"), encode_envelope(envelope),
                         headers={"Nats-Msg-Id": envelope.id})
        try:
            if warm:
                await wait_until(lambda: _standby_ready(stack_.workdir, job), 120, f"{job}'s standbys")
            await wait_until(lambda: max(w.steps.values(), default=-1) >= shape.fault_at, 180,
                             f"{job} to train {shape.fault_at} steps")
            victim = VICTIM if fault == "kill" else STOPPED
            pid = w.pids[victim][-1]
            w.target = max(w.steps.values())
            struck = time.time_ns()
            os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            await wait_until(lambda: w.recovered_at is not None, 120, f"{job} to recover")
            if fault == "stop":
                cancel = make_envelope("operator.cancel", {"reason": "measured"}, id=f"{job}:cancel", job=job,
                                       source="bench")
                await js.publish(subjects.job_event(job, "operator.cancel"), encode_envelope(cancel),
                                 headers={"Nats-Msg-Id": cancel.id})
                await wait_until(w.all_exited, 120, f"{job}'s processes to end after its cancellation")
            else:
                await wait_until(lambda: "job.completed" in w.kinds and out.exists(), 180, f"{job} to complete")
        finally:
            stack_.rank_pids.update(pid for pids in w.pids.values() for pid in pids)
        records = [r async for r in log.read(start_seq) if isinstance(r, Record) and r.envelope.job == job]
        # When each command reached the stream the agents read (`recovery.cmd.<node>.<job>.<kind>`).
        sent = [(r.ts, r.subject.split(".")[-1]) async for r in commands.read(command_seq)
                if r.subject.split(".")[3] == job]
    finally:
        await nc.close()
    confirmed = confirmed_after(records, struck)
    if fault == "stop":  # its phases are not this bench's subject: how soon the silence is a fault is
        assert w.recovered_at is not None
        return Outcome((w.recovered_at - struck) / 1e9, {}, 0, 0, out), confirmed
    return phases_of_ours(records, sent, struck, w.target, victim, out), confirmed


def _standby_ready(workdir: Path, job: str) -> bool:
    """Each node's agent keeps one standby per warm job; it says `ready` in its log once its imports are done."""
    return all(any(line.startswith("ready") for p in (workdir / node).glob(f"{job}.standby*.log")
                   for line in p.read_text(errors="replace").splitlines()) for node in NODES)


def _async(fn: Callable[[Msg], None]) -> Callable[[Msg], Any]:
    async def cb(msg: Msg) -> None:
        fn(msg)

    return cb


# -- torchrun --------------------------------------------------------------------------------------------------
@dataclass
class SdkSocket:
    """The socket the torchrun workers' SDK reports to: what the agent's channel is to ours, timestamped here."""

    path: Path
    hellos: list[tuple[int, int, int, int]] = field(default_factory=list)  # (ns, rank, generation, pid)
    steps: list[tuple[int, int, int, int]] = field(default_factory=list)  # (ns, rank, generation, step)
    gone: list[tuple[int, int, int]] = field(default_factory=list)  # (ns, rank, generation) at disconnection

    async def serve(self) -> asyncio.Server:
        return await asyncio.start_unix_server(self._connection, str(self.path))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = generation = -1
        try:
            while line := await reader.readline():
                now = time.time_ns()
                message = json.loads(line)
                rank, generation = message.get("rank", rank), message.get("attempt", generation)
                if message.get("op") == "hello":
                    self.hellos.append((now, rank, generation, message["pid"]))
                elif message.get("op") == "step":
                    self.steps.append((now, rank, generation, message["step"]))
        except (ConnectionError, ValueError):
            pass
        finally:
            self.gone.append((time.time_ns(), rank, generation))
            writer.close()

    def step(self) -> int:
        return max((s for _, _, _, s in self.steps), default=-1)


async def run_torchrun(workdir: Path, job: str, shape: JobShape, pids: set[int]) -> Outcome:
    workdir = workdir / job
    workdir.mkdir(parents=True)
    out = workdir / "final.pt"
    sdk = SdkSocket(workdir / "sdk.sock")
    server = await sdk.serve()
    env = {**environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "RECOVERY_AGENT_SOCKET": str(sdk.path),
           "RECOVERY_HEARTBEAT_S": str(HEARTBEAT_S)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--max-restarts", str(MAX_RESTARTS), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(TORCHRUN_RANK),
               *shape.args(out, workdir / "checkpoints")]
    with (workdir / "torchrun.log").open("ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=workdir, env=env, start_new_session=True)
    try:
        await wait_until(lambda: sdk.step() >= shape.fault_at, 180, f"{job} to train {shape.fault_at} steps")
        target = sdk.step()
        victim = next(pid for _, rank, gen, pid in sdk.hellos if rank == VICTIM and gen == 0)
        struck = time.time_ns()
        os.kill(victim, signal.SIGKILL)

        def recovered() -> bool:
            return any(gen >= 1 and step > target for _, _, gen, step in sdk.steps)

        await wait_until(recovered, 120, f"{job} to recover")
        await wait_until(lambda: proc.poll() is not None, 180, f"{job} to complete")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun exited {proc.returncode}; see {workdir / 'torchrun.log'}")
    finally:
        pids.update(pid for _, _, _, pid in sdk.hellos)
        stop_process(proc, timeout=10)
        kill_sessions(pids)
        server.close()
    old_gone = max(ns for ns, _, gen in sdk.gone if gen == 0 and ns >= struck)
    hello = min(ns for ns, _, gen, _ in sdk.hellos if gen >= 1)
    new_steps = sorted((ns, step) for ns, _, gen, step in sdk.steps if gen >= 1)
    first_ns, first_step = new_steps[0]
    done_ns, done_step = next((ns, step) for ns, step in new_steps if step > target)
    before = sorted(ns for ns, rank, gen, _ in sdk.steps if gen == 0 and rank == 0 and ns < struck)
    step_s = statistics.median([b - a for a, b in itertools.pairwise(before)][-20:]) / 1e9
    recomputed = done_step - first_step + 1
    load_end = first_ns - step_s * 1e9
    phases = {"stop": old_gone - struck, "restart": hello - old_gone, "load_state": load_end - hello,
              "catch_up": done_ns - load_end}
    restarted = len({pid for _, _, gen, pid in sdk.hellos if gen >= 1})
    return Outcome((done_ns - struck) / 1e9, {k: v / 1e9 for k, v in phases.items()}, restarted, recomputed, out)


# -- the bench -------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one repeat of a shorter job (the smoke test)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every case; medians are reported")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of sleep per step (the compute)")
    parser.add_argument("--fault-at", type=int, default=50, help="the step completed when rank 2 is killed")
    parser.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it (every process's log) instead of a temporary directory")


def resolve(args: argparse.Namespace) -> None:
    """`--quick`: one repeat of a shorter job, for every case (`args.repeat` is theirs too)."""
    if args.quick:
        args.repeat, args.fault_at = 1, 25


@contextlib.contextmanager
def workspace(args: argparse.Namespace) -> Iterator[Path]:
    """Where every case works: a temporary directory, or `--keep`'s, kept with every process's log."""
    with tempfile.TemporaryDirectory(prefix="recovery-bench-e2e-") as tmp:
        if args.keep is None:
            yield Path(tmp)
            return
        kept = args.keep.resolve()
        kept.mkdir(parents=True, exist_ok=True)
        yield kept


@dataclass
class Recoveries:
    """The cases on the example job: each run's outcome by case, and the SIGSTOPs' seconds to a confirmed fault."""

    outcomes: dict[str, list[Outcome]] = field(default_factory=lambda: {c: [] for c in ("cold", "warm", "torchrun")})
    detections: list[float] = field(default_factory=list)


def measure(args: argparse.Namespace, workdir: Path) -> Recoveries:
    """`cold`, `warm`, `torchrun` and `sigstop` of `args.only`, interleaved in every repeat; `report` emits them."""
    shape = JobShape(steps=args.fault_at + 15, step_time=args.step_time, fault_at=args.fault_at)
    found = Recoveries()
    outcomes, detections = found.outcomes, found.detections
    torchrun_pids: set[int] = set()
    try:
        needs_stack = any(c in args.only for c in ("cold", "warm", "sigstop"))
        with stack(workdir) if needs_stack else contextlib.nullcontext() as stack_:
            for repeat in range(args.repeat):
                for case in ("cold", "warm", "torchrun", "sigstop"):
                    if case not in args.only:
                        continue
                    job = f"{case}-{repeat}"
                    started = time.monotonic()
                    if case == "torchrun":
                        outcome = asyncio.run(run_torchrun(workdir, job, shape, torchrun_pids))
                    else:
                        assert stack_ is not None
                        outcome, confirmed = asyncio.run(run_ours(stack_, job, shape, case == "warm",
                                                                  "stop" if case == "sigstop" else "kill"))
                        if case == "sigstop":
                            detections.append(confirmed)
                            note(f"{job}: SIGSTOP confirmed after {confirmed:.2f}s, recovered after "
                                 f"{outcome.recovered_s:.2f}s ({time.monotonic() - started:.0f}s)")
                            continue
                    outcomes[case].append(outcome)
                    note(f"{job}: recovered {outcome.recovered_s:.3f}s, "
                         f"{', '.join(f'{k} {v:.3f}' for k, v in outcome.phases.items())}; "
                         f"{outcome.processes_restarted} processes restarted, {outcome.recomputed_steps} steps "
                         f"recomputed ({time.monotonic() - started:.0f}s)")
            _compare_parameters([o.out for runs in outcomes.values() for o in runs])
    finally:
        kill_sessions(torchrun_pids)
    return found


def _compare_parameters(outs: list[Path]) -> None:
    if len(outs) < 2:
        return
    import torch

    reference = torch.load(outs[0])
    for out in outs[1:]:
        params = torch.load(out)
        if params.keys() != reference.keys() or not all(torch.equal(params[k], reference[k]) for k in params):
            note(f"warning: the final parameters of {out.parent.name} differ from those of {outs[0].parent.name}")


def report(emit: Emit, found: Recoveries) -> None:
    outcomes, detections = found.outcomes, found.detections
    for case, runs in outcomes.items():
        if not runs:
            continue
        unit = "s" if case != "torchrun" else \
            f"s (torchrun --max-restarts {MAX_RESTARTS}, {TORCHRUN_SETTING}, checkpoint every {CHECKPOINT_EVERY})"
        emit(BENCH, f"{case}_recovered_s", sig(statistics.median(o.recovered_s for o in runs)), unit)
        for phase in runs[0].phases:
            emit(BENCH, f"{case}_{phase}_s", sig(statistics.median(o.phases[phase] for o in runs), 3), "s")
        emit(BENCH, f"{case}_processes_restarted", statistics.median(o.processes_restarted for o in runs),
             "processes per fault")
        emit(BENCH, f"{case}_recomputed_steps", statistics.median(o.recomputed_steps for o in runs), "steps")
    torchrun = outcomes["torchrun"]
    for case in ("cold", "warm"):
        runs = outcomes[case]
        if runs and len(runs) == len(torchrun):
            ratios = [o.recovered_s / t.recovered_s for o, t in zip(runs, torchrun, strict=True)]
            emit(BENCH, f"ratio_{case}_to_torchrun", sig(statistics.median(ratios), 3), "x (lower is faster)")
    if detections:
        emit(BENCH, "sigstop_detected_s", sig(statistics.median(detections), 3),
             f"s (heartbeats every {HEARTBEAT_S:g} s, watchdog {WATCHDOG_S:g} s, "
             f"hang_min_silence_s {HANG_MIN_SILENCE_S:g})")


__all__ = ["add_arguments", "measure", "report", "resolve", "workspace"]

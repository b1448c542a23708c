"""Real processes for the end-to-end tests: a nats-server, a `recovery-daemon`, `recovery-agent`s and the training
job of `examples/dp-training`, with what the tests watch them through (the job's events and decisions)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.names import DecisionKind
from events.outputs import Decision
from recovery.testing.nats import free_port

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "dp-training" / "train.py"
POLL_S = 0.01


STAND_IN = '''
import signal, sys, time
import recovery.client as recovery
client = recovery.connect()
client.announce("reform")  # it forms no group: a peer restarted alone never waits on it
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
step = 0
while not client.should_stop():
    step += 1
    client.report_step(step)
    time.sleep(0.05)
client.close()
'''
"""a rank of a job that trains nothing: it reports a step every 50 ms until asked to stop (SIGTERM ends it as 143)"""


async def node_heard(nc: Any, subject: str) -> list[str]:
    """The subjects of the node events on `subject` from now on (an agent's `node.ready` says it is up)."""
    heard: list[str] = []

    async def on_node(msg: Any) -> None:
        heard.append(msg.subject)

    await nc.subscribe(subject, cb=on_node)
    return heard


def environment() -> dict[str, str]:
    """Every process a test starts imports this checkout's code."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


class AgentProcess:
    """`python -m recovery.cli.agent` for one node (inside network namespace `namespace`, when given)."""

    def __init__(self, workdir: Path, node: str, nats_url: str, spare: bool = False, *extra: str,
                 namespace: str | None = None, env: dict[str, str] | None = None,
                 linger_s: float | None = 0.0) -> None:
        """`linger_s`: the agent's `preempt_linger_s`, None for its default. A test's agent ends as soon as its ranks
        are stopped: the linger waits for the engine's commands about them, which only a preemption test expects
        (the shared cluster's agents keep it), and every stop with a rank running spent it (10 s)."""
        self.node = node
        self.workdir = workdir / node
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "agent.log"
        args = [sys.executable, "-m", "recovery.cli.agent", "--node", node, "--nats-url", nats_url,
                "--runtime-dir", str(self.workdir), "--heartbeat-s", "0.5", "--kill-grace-s", "3"]
        if spare:
            args.append("--spare")
        if linger_s is not None and "--preempt-linger-s" not in extra:
            args.extend(["--preempt-linger-s", str(linger_s)])
        args.extend(extra)
        if namespace is not None:
            args = ["ip", "netns", "exec", namespace, *args]
        # Warm standbys (on by default) only where a test asks for them, by the job's RECOVERY_STANDBY or the
        # agent's setting: every other job would import torch once more per node, on a 2-core machine.
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, env={"RECOVERY_AGENT_STANDBY": "0", **environment(), **(env or {})})
        self._terminated = False

    def terminate(self) -> None:
        """SIGTERM, once: the agent's graceful stop (a second one would end it at once)."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class RendezvousProcess:
    """A rendezvous store run off the training nodes (`python -m recovery.agent.rendezvous --serve`), as a platform
    runs it for jobs that must survive the loss of any node."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = workdir / "rendezvous.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "recovery.agent.rendezvous", "--host", "127.0.0.1",
                                          "--port", str(self.port), "--serve"], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=environment())

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "ready" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rendezvous store did not start:\n{self.log_path.read_text()}")
            time.sleep(POLL_S)  # polling interval of a deadline-bounded wait

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class JobWatch:
    """A job's events and decisions as they arrive (a core NATS subscription beside the streams)."""

    job: str
    events: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    started_at: dict[str, float] = field(default_factory=dict)

    def on_event(self, msg: Msg) -> None:
        envelope = orjson.loads(msg.data)
        envelope["_seen"] = time.monotonic()
        self.events.append(envelope)
        if envelope["type"] == "progress.report":
            # The agent folds its ranks' words into one report per period: each entry counts as the rank's own
            # heartbeat or step would (`of("progress.step")`), as the engine applies it.
            for entry in envelope["data"]["ranks"]:
                type_ = "process.heartbeat" if entry.get("step") is None else "progress.step"
                self.events.append({"type": type_, "data": entry, "source": envelope.get("source"),
                                    "_seen": envelope["_seen"], "_folded": True})

    def on_decision(self, msg: Msg) -> None:
        decision = orjson.loads(msg.data)
        decision["_seen"] = time.monotonic()
        self.decisions.append(decision)

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_]

    def pids(self) -> dict[int, list[int]]:
        """Every process started per rank, in order."""
        out: dict[int, list[int]] = {}
        for e in self.of("process.started"):
            out.setdefault(e["data"]["rank"], []).append(e["data"]["pid"])
        return out

    def step(self, rank: int) -> int:
        steps = [e["data"]["step"] for e in self.of("progress.step") if e["data"]["rank"] == rank]
        return max(steps, default=-1)

    def kinds(self) -> list[str]:
        return [d["data"]["kind"] for d in self.decisions]

    def decided(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.decisions if d["data"]["kind"] == kind]

    def story(self) -> str:
        """The job's events in order, one short line each (a failed test's account of what the processes said):
        each rank's progress as its newest step per generation, everything else by type, rank and generation."""
        lines: list[str] = []
        newest: dict[tuple[int, int], int] = {}
        for e in self.events:
            data = e.get("data") or {}
            if e["type"] in ("progress.step", "process.heartbeat", "progress.report", "progress.summary"):
                if e["type"] == "progress.step":
                    newest[(data["rank"], data.get("attempt", 0))] = data["step"]
                continue
            extra = {k: data[k] for k in ("rank", "attempt", "step", "exit_code", "signal", "error") if k in data}
            lines.append(f"{e['type']} {str(extra)[:200]}")
            for dumped in data.get("ranks", []) if e["type"] == "process.stacks" else []:
                # the main thread's innermost frames: where the rank was when the hang was taken
                frames = [line.strip() for line in str(dumped.get("stack") or dumped.get("error")).splitlines()]
                lines.append(f"  rank {dumped.get('rank')}: {' | '.join(frames[:8])[:600]}")
        steps = ", ".join(f"rank {r} gen {a}: {s}" for (r, a), s in sorted(newest.items()))
        return "\n".join([*lines, f"newest steps: {steps}"])


async def wait_until(condition: Callable[[], bool], timeout: float, what: str,
                     explain: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{explain()}")
        await asyncio.sleep(POLL_S)  # polling interval of a deadline-bounded wait


async def watch(nc: Client, job: str) -> JobWatch:
    w = JobWatch(job)

    async def on_event(msg: Msg) -> None:
        w.on_event(msg)

    async def on_decision(msg: Msg) -> None:
        w.on_decision(msg)

    await nc.subscribe(f"{subjects.PREFIX}.ev.job.{job}.>", cb=on_event)
    await nc.subscribe(subjects.decision(job), cb=on_decision)
    return w


def job_spec(out: Path, steps: int, step_time: float, nodes: list[str], master_port: int,
             rendezvous: str = "agent", checkpoint: dict[str, Any] | None = None,
             detection: dict[str, Any] | None = None, args: list[str] | None = None) -> dict[str, Any]:
    policies: dict[str, Any] = {"detection": {"name": "default", "params": detection or {"hang_min_silence_s": 5.0,
                                                                                         "agent_silence_s": 3.0}}}
    if checkpoint is not None:
        policies["checkpoint"] = {"name": "newest-complete", "params": checkpoint}
    return {
        "nodes": nodes, "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": 1.0,
        "policies": policies,
        "entrypoint": {"command": sys.executable,
                       "args": [str(TRAIN), "--steps", str(steps), "--step-time", str(step_time), "--out", str(out),
                                *(args or [])],
                       "cwd": str(ROOT), "rendezvous": rendezvous,
                       "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                               "PYTHONPATH": environment()["PYTHONPATH"]}},
    }


async def submit(nc: Client, job: str, spec: dict[str, Any], *, accepted: bool = False, again: int = 0) -> int:
    """Submit `job`; the sequence of its submission comes back. `accepted`: also write the daemon's acceptance of
    it (agents start nothing before it), for tests that run agents without a daemon; `again`: the how-manieth
    submission of the job id this is (each its own event)."""
    ident = f"{job}:submitted" + (f":{again}" if again else "")
    envelope = make_envelope("job.submitted", {"spec": spec}, id=ident, job=job, source="test")
    ack = await nc.jetstream().publish(subjects.job_event(job, "job.submitted"), encode_envelope(envelope),
                                       headers={"Nats-Msg-Id": envelope.id})
    if accepted:
        await accept(nc, job, ack.seq)
    return int(ack.seq)


async def accept(nc: Client, job: str, seq: int, kind: DecisionKind = DecisionKind.JOB_ACCEPTED,
                 state: str = "submitted") -> None:
    """The decision a daemon writes for the submission of `job` at `seq` (`kind`: its acceptance, or another;
    `state`: the job's after it)."""
    decision = Decision(job=job, cause_seq=seq, index=0, kind=kind, previous="submitted", state=state,
                        reason="written by the test")
    envelope = make_envelope("decision", decision, id=f"dec:{job}:{seq}:0", job=job, source="test")
    await nc.jetstream().publish(subjects.decision(job), encode_envelope(envelope),
                                 headers={"Nats-Msg-Id": envelope.id})


async def connect(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)


def stop_agents(agents: Iterable[AgentProcess]) -> None:
    """Stop every agent: all told at once, then each waited for (each stops its ranks within its kill grace; one by
    one, a cluster of eight took 15 s to take down)."""
    agents = list(agents)
    for agent in agents:
        agent.terminate()
    for agent in agents:
        agent.stop()


def kill_leftovers(pids: list[int]) -> None:
    """Processes a failed test may leave behind (each rank runs in a session of its own)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


__all__ = ["AgentProcess", "JobWatch", "RendezvousProcess", "accept", "connect", "free_port", "job_spec",
           "kill_leftovers", "stop_agents", "submit", "wait_until", "watch"]

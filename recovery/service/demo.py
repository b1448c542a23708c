"""`recovery-daemon --demo`: the daemon on an embedded JetStream, a simulated cluster publishing faults and
carrying out commands, and a live view of the jobs recovering.

The cluster is a *driver*: an object with `start()` and `execute(command)`, built by a factory called with
a `Bus` (publish events, schedule actions on the wall clock) and the demo's settings. It sees the daemon only
through NATS: its events go into the log like any agent's, and it receives the commands the daemon stores in
the command stream (an executor consuming from JetStream, so a command republished after a crash reaches it
once). Drivers:

- `sim` (the default, `auto`): the simulator's world (`recovery.sim.world.World`) with the small demo cluster
  and its scripted faults (`recovery.sim.demo`), on the wall clock;
- `builtin`: a small cluster in this module, three jobs with a random fault every few seconds;
- `module:attribute`: any factory `(bus, settings) -> driver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from pydantic import TypeAdapter
from rich.live import Live

from events import subjects
from events.codec import encode_envelope
from events.commands import Command, CommandBase
from events.envelope import EnvelopeBase, make_envelope
from events.values import STORAGE_HOLDER, JobSpec, Layout, Tier
from recovery.log import iter_file, replay
from recovery.log.file import overruns_in_file
from recovery.log.jetstream import JetStreamLog
from recovery.log.verify import first_divergence
from recovery.report.screen import screen_console
from recovery.service import jsonlog
from recovery.service.config import DaemonConfig
from recovery.service.connection import retry
from recovery.service.daemon import Daemon
from recovery.service.demo_view import LiveView
from recovery.service.process import run
from recovery.service.publisher import Outgoing, Publisher
from recovery.sim.demo import DEMO_FAULTS, DemoCluster
from recovery.sim.faults import Fault
from recovery.sim.world import World

logger = logging.getLogger("recovery.demo")
NS = 1_000_000_000
COMMANDS = TypeAdapter(Command)


class Driver(Protocol):
    def start(self) -> None: ...

    def execute(self, command: CommandBase) -> None: ...


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    seconds: float = 60.0
    seed: int = 1
    jobs: int = 3
    step_s: float = 0.5
    fault_every_s: float = 6.0
    ack_delay_s: tuple[float, float] = (0.2, 0.8)
    restart_s: tuple[float, float] = (1.0, 2.5)


class Bus:
    """The demo cluster's connection to the world: `emit` publishes an event into the log (in order, with its
    id as `Nats-Msg-Id`, retried through outages), `now`/`at` schedule on the wall clock, and the commands
    the daemon stores reach `driver.execute` once each."""

    def __init__(self, nc: Client, js: JetStreamContext, command_stream: str = "RECOVERY_CMD") -> None:
        self.nc = nc
        self.js = js
        self.command_stream = command_stream
        self.driver: Driver | None = None
        self.published = 0
        self.sent: list[str] = []
        """ids of the events published, in order"""
        self.commands = 0
        self._queue: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self._seen: set[str] = set()
        self._inflight = 0

    @property
    def now(self) -> int:
        return time.time_ns()

    def at(self, when: int, action: Callable[[], None]) -> None:
        delay = max(0.0, (when - time.time_ns()) / NS)
        self._loop.call_later(delay, self._guarded, action)

    @staticmethod
    def _guarded(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            logger.exception("demo cluster action failed")

    def emit(self, subject: str, envelope: EnvelopeBase) -> None:
        self._queue.put_nowait((subject, encode_envelope(envelope), envelope.id))

    async def start(self, driver: Driver) -> None:
        self.driver = driver
        self._publisher = Publisher(self.js)
        self._tasks.append(asyncio.create_task(self._pump(), name="demo-publish"))
        # A cluster's JetStream may still be electing the stream's leader, or busy: the consumer's creation is
        # retried with backoff (an ordered consumer is ephemeral: one whose reply was lost is removed when idle)
        self._sub = await retry(lambda: self.js.subscribe(subjects.COMMANDS, stream=self.command_stream,
                                                          ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                                                          cb=self._on_command),
                                "the demo's subscription to commands", lambda: False, limit_s=60.0)
        driver.start()

    async def _pump(self) -> None:
        while True:
            subject, data, msg_id = await self._queue.get()
            batch = [Outgoing(subject, data, msg_id, "input")]
            while not self._queue.empty() and len(batch) < 256:
                subject, data, msg_id = self._queue.get_nowait()
                batch.append(Outgoing(subject, data, msg_id, "input"))
            self._inflight = len(batch)
            await self._publisher.publish(batch)
            self._inflight = 0
            self.published += len(batch)
            self.sent.extend(o.msg_id for o in batch)

    async def _on_command(self, msg: Msg) -> None:
        try:
            command = COMMANDS.validate_json(msg.data)
        except ValueError:
            logger.warning("undecodable command", extra={"fields": {"subject": msg.subject}})
            return
        if command.id in self._seen:
            return  # executors are idempotent: a command id is carried out once
        self._seen.add(command.id)
        self.commands += 1
        if self.driver is not None:
            self._guarded(lambda: self.driver.execute(command))  # type: ignore[union-attr]

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every event emitted so far is stored."""
        target = self.published + self._queue.qsize() + self._inflight
        deadline = time.monotonic() + timeout
        while self.published < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target - self.published} demo events not stored within {timeout}s")
            await asyncio.sleep(0.01)  # polling interval of a deadline-bounded wait

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)


# -- the built-in cluster -------------------------------------------------------------------------------------
DEMO_POLICIES: dict[str, Any] = {
    "detection": {"name": "default", "params": {"link_debounce_s": 3, "hang_min_silence_s": 4,
                                                "frequency_threshold": 1000, "node_frequency_threshold": 1000}},
    "rescheduling": {"name": "ladder", "params": {"ladders": {
        "process": [{"granularity": "in_place", "budget": None, "deadline_s": 30}],
        "hang": [{"granularity": "in_place", "budget": None, "deadline_s": 30}],
        "device": [{"granularity": "migrate", "budget": None, "deadline_s": 30},
                   {"granularity": "restart_job", "budget": None, "deadline_s": 60}],
        "network": [{"granularity": "retry", "budget": None, "deadline_s": 20},
                    {"granularity": "in_place", "budget": None, "deadline_s": 30}],
        "node": [{"granularity": "migrate", "budget": None, "deadline_s": 30},
                 {"granularity": "restart_job", "budget": None, "deadline_s": 60}]}}},
    "checkpoint": {"name": "newest-complete", "params": {"dying": True}},
}


@dataclasses.dataclass
class SimJob:
    id: str
    nodes: list[str]
    rpn: int
    tp: int
    generation: int = 0
    step: int = 0
    progressing: bool = True
    alive: set[int] = dataclasses.field(default_factory=set)
    hung: int | None = None
    failed: bool = False
    faults: int = 0

    @property
    def world(self) -> int:
        return len(self.nodes) * self.rpn


class BuiltinCluster:
    """Jobs of 8 ranks (tp=2, dp=4) on two nodes of four GPUs, a pool of spare nodes, and every few seconds one
    fault on a training job: a process crash (restart in place), a GPU off the bus (XID 79: the node's ranks
    move to a spare, the node is isolated and comes back repaired), a hung rank (the engine's watchdog sees
    the silence), or a link flap (suspected, then cleared). Executors answer every command after a short
    delay; restarted ranks report progress from the resume step."""

    FAULTS = (("crash", 4), ("xid79", 3), ("hang", 2), ("link_flap", 2))

    def __init__(self, bus: Bus, settings: DemoSettings, *, prefix: str = "") -> None:
        self.bus = bus
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.run = prefix or secrets.token_hex(3)
        self.n = 0
        self.jobs: dict[str, SimJob] = {}
        self.spares: list[str] = [f"spare{i}" for i in range(max(2, settings.jobs))]
        self.repairing: set[str] = set()
        self.done: set[str] = set()
        self.stopped = False
        self.faulting = True
        self.recovered = 0
        """restarts carried out (each ends an incident once the job reports progress)"""
        for j in range(settings.jobs):
            job = SimJob(f"job{j}", [f"n{2 * j}", f"n{2 * j + 1}"], rpn=4, tp=2)
            job.alive = set(range(job.world))
            self.jobs[job.id] = job

    # -- events ---------------------------------------------------------------------------------------------
    def _id(self) -> str:
        self.n += 1
        return f"demo-{self.run}-{self.n}"

    def job_event(self, job: str, type_: str, data: dict[str, Any], source: str = "agent") -> None:
        self.bus.emit(subjects.job_event(job, type_), make_envelope(type_, data, id=self._id(), job=job,
                                                                    source=source))

    def node_event(self, node: str, type_: str, data: dict[str, Any], source: str = "probe") -> None:
        self.bus.emit(subjects.node_event(node, type_), make_envelope(type_, data, id=self._id(), node=node,
                                                                      source=source))

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self.bus.at(self.bus.now + int(seconds * NS), action)

    # -- life ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        for job in self.jobs.values():
            for node in job.nodes:
                self.node_event(node, "node.joined", {"spare": False, "devices": job.rpn}, source="scheduler")
        for node in self.spares:
            self.node_event(node, "node.joined", {"spare": True, "devices": 4}, source="scheduler")
        for job in self.jobs.values():
            spec = JobSpec.model_validate({"nodes": job.nodes, "ranks_per_node": job.rpn,
                                           "layout": Layout(dp=job.world // job.tp, tp=job.tp, pp=1),
                                           "policies": DEMO_POLICIES, "watchdog_interval_s": 1.0})
            self.job_event(job.id, "job.submitted", {"spec": spec.model_dump(mode="json")}, source="scheduler")
            self.job_event(job.id, "checkpoint.saved", {"step": 0, "tier": Tier.STORAGE.value,
                                                        "holder": STORAGE_HOLDER, "shards": list(range(job.tp))})
            self.job_event(job.id, "job.started", {}, source="scheduler")
        self.later(self.s.step_s, self._tick)
        self.later(self.s.fault_every_s * (0.5 + self.rng.random() * 0.5), self._fault)

    def stop(self) -> None:
        self.stopped = True

    def calm(self) -> None:
        """No new faults from now on; the ones under way finish recovering."""
        self.faulting = False

    def _tick(self) -> None:
        if self.stopped:
            return
        for job in self.jobs.values():
            if job.failed:
                continue
            if job.progressing:
                job.step += 1
                for rank in sorted(job.alive):
                    self.job_event(job.id, "progress.step", {"rank": rank, "step": job.step,
                                                             "attempt": job.generation})
                if job.step % 10 == 0:
                    self.job_event(job.id, "checkpoint.saved", {"step": job.step, "tier": Tier.STORAGE.value,
                                                                "holder": STORAGE_HOLDER,
                                                                "shards": list(range(job.tp))}, source="checkpointer")
            elif job.hung is not None:
                for rank in sorted(job.alive - {job.hung}):  # blocked in the collective, agents still beat
                    self.job_event(job.id, "process.heartbeat", {"rank": rank, "attempt": job.generation})
        self.later(self.s.step_s, self._tick)

    def _fault(self) -> None:
        if self.stopped or not self.faulting:
            return
        healthy = [j for j in self.jobs.values() if j.progressing and not j.failed and j.step >= 3]
        if healthy:
            job = self.rng.choice(healthy)
            kind = self.rng.choices([k for k, _ in self.FAULTS], [w for _, w in self.FAULTS])[0]
            if kind == "xid79" and not [s for s in self.spares if s not in self.repairing]:
                kind = "crash"
            job.faults += 1
            getattr(self, f"_fault_{kind}")(job)
        self.later(self.s.fault_every_s * (0.6 + self.rng.random() * 0.8), self._fault)

    def _fault_crash(self, job: SimJob) -> None:
        rank = self.rng.randrange(job.world)
        job.progressing = False
        job.alive.discard(rank)
        self.job_event(job.id, "process.exited", {"rank": rank, "exit_code": None, "signal": 11,
                                                  "attempt": job.generation},
                       source=f"agent@{job.nodes[rank // job.rpn]}")

    def _fault_xid79(self, job: SimJob) -> None:
        index = self.rng.randrange(len(job.nodes))
        node = job.nodes[index]
        device = self.rng.randrange(job.rpn)
        job.progressing = False
        job.alive -= set(range(index * job.rpn, (index + 1) * job.rpn))
        self.node_event(node, "device.fault", {"device": device, "vendor": "nvidia", "code": "79",
                                               "message": "GPU has fallen off the bus"})

    def _fault_hang(self, job: SimJob) -> None:
        job.progressing = False
        job.hung = self.rng.randrange(job.world)

    def _fault_link_flap(self, job: SimJob) -> None:
        node = self.rng.choice(job.nodes)
        self.node_event(node, "network.link_down", {"link": "ib0", "switch": "leaf0"})
        self.later(1.0 + self.rng.random(), lambda: self.node_event(node, "network.link_up", {"link": "ib0"}))

    # -- executors -----------------------------------------------------------------------------------------
    def execute(self, command: CommandBase) -> None:
        if command.id in self.done or self.stopped:
            return
        self.done.add(command.id)
        job = self.jobs.get(command.job)
        if job is None:
            return
        kind = command.kind  # type: ignore[attr-defined]
        slow = kind in ("restart_ranks", "migrate_ranks", "restart_job", "scale_job")
        low, high = self.s.restart_s if slow else self.s.ack_delay_s
        self.job_event(job.id, "command.ack", {"command_id": command.id, "status": "accepted"}, source="executor")
        self.later(low + self.rng.random() * (high - low), lambda: self._complete(job, command))

    def _complete(self, job: SimJob, command: Any) -> None:
        if self.stopped:
            return
        kind = command.kind
        if kind == "stop_ranks":
            job.alive -= set(command.ranks)
            job.progressing = False
        elif kind == "save_checkpoint":
            self.job_event(job.id, "checkpoint.saved", {"step": command.step, "tier": Tier.DYING.value,
                                                        "holder": STORAGE_HOLDER, "shards": list(range(job.tp))},
                           source="checkpointer")
        elif kind in ("restart_ranks", "migrate_ranks", "restart_job", "scale_job"):
            if kind == "migrate_ranks":
                job.nodes[job.nodes.index(command.from_node)] = command.to_node
                if command.to_node in self.spares:
                    self.spares.remove(command.to_node)
                # The node left behind is repaired and rejoins the pool, isolated or not: the engine isolates a
                # lemon only when a spare can replace it, so isolation alone cannot be what brings nodes back.
                left = command.from_node
                if left not in self.repairing:
                    self.repairing.add(left)
                    self.later(8.0, lambda: self._repaired(left))
            elif kind in ("restart_job", "scale_job"):
                job.nodes = list(command.nodes)
            job.generation = command.attempt
            job.step = command.plan.checkpoint_step or 0
            job.alive = set(range(job.world))
            job.hung = None
            restarted = command.ranks if kind in ("restart_ranks", "migrate_ranks") else range(job.world)
            for rank in restarted:
                self.job_event(job.id, "process.started", {"rank": rank, "pid": 1000 + rank,
                                                           "attempt": job.generation})
        elif kind in ("isolate_node", "isolate_device"):
            node = command.node
            self.repairing.add(node)
            self.later(8.0, lambda: self._repaired(node))
        elif kind == "retry_step":
            job.generation = command.attempt  # the same processes, formed again in the retry's generation
        elif kind == "fail_job":
            job.failed = True
        self.job_event(job.id, "command.ack", {"command_id": command.id, "status": "done"}, source="executor")
        if kind in ("restart_ranks", "migrate_ranks", "restart_job", "scale_job", "retry_step"):
            job.progressing = True
            self.recovered += 1

    def _repaired(self, node: str) -> None:
        if self.stopped:
            return
        self.repairing.discard(node)
        if not any(node in j.nodes for j in self.jobs.values()):
            self.spares.append(node)
            self.node_event(node, "node.joined", {"spare": True, "devices": 4}, source="scheduler")


def builtin_driver(bus: Bus, settings: DemoSettings) -> Driver:
    return BuiltinCluster(bus, settings)


# -- the simulator's world on the wall clock ----------------------------------------------------------------
def sim_driver(bus: Bus, settings: DemoSettings) -> Driver:
    """The simulator's small demo cluster (one job, scripted faults), with its faults spread over the demo."""
    template = DemoCluster(seed=settings.seed)
    start = bus.now
    world = World(template.config, bus, bus.emit, start_ns=start)
    # The scripted faults come 30 s apart; a demo of `seconds` keeps as many as fit 17 s apart (a recovery
    # on the demo's costs takes up to ~10 s), the last one leaving time to recover on screen.
    times = [5 + 17 * i for i in range(len(DEMO_FAULTS)) if 5 + 17 * i <= settings.seconds - 15] or [5]

    class SimDriver:
        def start(self) -> None:
            world.start()
            for i, (fault, at_s) in enumerate(zip(DEMO_FAULTS, times, strict=False)):
                timed = dataclasses.replace(fault, at_ns=int(at_s * NS), index=i)
                bus.at(start + timed.at_ns, functools.partial(_inject, world, timed))

        def execute(self, command: CommandBase) -> None:
            world.execute(command)

    return SimDriver()


def _inject(world: World, fault: Fault) -> None:
    world.inject(fault)


def load_driver(name: str) -> Callable[[Bus, DemoSettings], Driver]:
    if name == "builtin":
        return builtin_driver
    if name in ("auto", "sim"):
        return sim_driver
    module, _, attr = name.partition(":")
    factory: Callable[[Bus, DemoSettings], Driver] = getattr(importlib.import_module(module), attr)
    return factory


def run_demo(cfg: DaemonConfig) -> int:
    """The daemon (embedded NATS in a temporary directory unless --data-dir is given) plus a demo cluster,
    shown live for `duration_s` seconds (default 60); then a summary and the log exported for replay."""
    seconds = cfg.duration_s or 60.0
    explicit_dir = "data_dir" in cfg.model_fields_set
    data_dir = Path(cfg.data_dir) if explicit_dir else Path(tempfile.mkdtemp(prefix="recovery-demo-"))
    updates: dict[str, Any] = {"data_dir": data_dir, "duration_s": seconds, "snapshot_every_s": 10.0}
    if "embedded_port" not in cfg.model_fields_set:
        updates["embedded_port"] = 0
    if "http_port" not in cfg.model_fields_set:
        updates["http_port"] = 0
    cfg = cfg.model_copy(update=updates)
    jsonlog.setup(cfg.log_level, cfg.log_format, cfg.log_file or data_dir / "daemon.log")
    settings = DemoSettings(seconds=seconds, seed=cfg.demo_seed)
    return anyio.run(_demo, cfg, settings, data_dir)


async def _demo(cfg: DaemonConfig, settings: DemoSettings, data_dir: Path) -> int:
    console = screen_console()
    factory = load_driver(cfg.demo_driver)
    where = "simulator world" if factory is sim_driver else ("built-in cluster" if factory is builtin_driver
                                                             else cfg.demo_driver)
    console.print(f"[bold]recovery demo[/]: daemon on an embedded JetStream in {data_dir}, a simulated cluster "
                  f"({where}) publishing faults and acking commands, for {settings.seconds:.0f}s.")
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def cluster(daemon: Daemon) -> AsyncIterator[None]:
        """The cluster and the live view beside the daemon. When the daemon stops, they stop first; then the
        daemon takes no more input and the log is exported and verified, before the daemon drains."""
        assert daemon.nc is not None and daemon.js is not None
        bus = Bus(daemon.nc, daemon.js, cfg.command_stream)
        try:
            driver = factory(bus, settings)
        except Exception as exc:  # the simulator is another team's moving code: the demo must still run
            if cfg.demo_driver != "auto" or factory is builtin_driver:
                raise
            console.print(f"the simulator's demo cluster unavailable ({exc!r}): the built-in cluster runs instead")
            driver = builtin_driver(bus, settings)
        view = LiveView(daemon, settings.seconds)
        state.update(view=view)
        live = Live(view, console=console, refresh_per_second=4, transient=False)
        try:
            await bus.start(driver)
            # the command on a line of its own: wrapped into the sentence, it is broken for copying at 80 columns
            console.print(f"metrics on http://{cfg.http_host}:{daemon.http_port}/metrics; the live jobs:")
            console.print(f"  recovery-ctl --nats {daemon.url} jobs")
            live.start()
            async with anyio.create_task_group() as screen:
                screen.start_soon(_refresh, live, view)
                try:
                    yield
                finally:
                    screen.cancel_scope.cancel()
        finally:
            stopper = getattr(driver, "stop", None)
            if stopper is not None:
                stopper()
            live.update(view, refresh=True)
            live.stop()
            await bus.close()
            await daemon.quiesce()
            state["export"] = await _export(daemon, data_dir / "demo.jsonl")

    code = await run(cfg, cluster)
    view = state.get("view")
    if view is not None:
        mttr = f", median MTTR {statistics.median(view.mttr):.1f}s" if view.mttr else ""
        console.print(f"\n{view.incidents} incident(s) opened, {len(view.mttr)} closed{mttr}.")
    export = state.get("export")
    if export is not None:
        path, verdict = export
        console.print(f"the log: {path} ({verdict})")
        jobs = view.job_ids() if view is not None else []
        for job in jobs or ["<job>"]:  # the jobs the demo ran, by name: a command to paste, not a template
            console.print(f"  recovery-replay timeline {path} --job {job}")
        console.print(f"  recovery-replay report {path}")
        console.print(f"  recovery-replay run {path}")
    return code


async def _refresh(live: Live, view: LiveView) -> None:
    while True:
        live.update(view)
        await anyio.sleep(0.25)  # screen refresh interval


async def _export(daemon: Daemon, path: Path) -> tuple[Path, str]:
    """Export the log for `recovery-replay` and verify it: the demo's own decisions, derived again."""
    assert daemon.nc is not None and daemon.js is not None
    try:
        with anyio.fail_after(5):
            log = JetStreamLog(daemon.nc, daemon.js, daemon.cfg.stream, owns_connection=False)
            count = await log.export(path)
        result = replay(iter_file(path), overruns=overruns_in_file(path))
        divergence = first_divergence(result)
        verdict = (f"{count} records; verify: ok, {len(result.decisions)} decisions re-derived"
                   if divergence is None else f"verify: DIVERGENCE at decision #{divergence.index}")
        return path, verdict
    except Exception as exc:
        return path, f"export failed: {exc!r}"

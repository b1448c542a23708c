"""The node agent: jobs placed on its node, their processes, the SDK's reports, and the node's commands."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from typing import Any

import anyio
import nats
import orjson
from anyio.abc import TaskGroup
from nats.aio.client import Client
from pydantic import BaseModel, TypeAdapter, ValidationError

from events import subjects
from events.codec import encode_envelope
from events.commands import (
    Command,
    DumpStacks,
    FailJob,
    IsolateDevice,
    IsolateNode,
    MigrateRanks,
    RestartJob,
    RestartRanks,
    RetryStep,
    SaveCheckpoint,
    ScaleJob,
    StopRanks,
)
from events.envelope import make_envelope
from events.kinds import RankStack
from events.values import ResumePlan
from recovery.agent import errors, ranks, stopping
from recovery.agent.admission import Admission, submissions
from recovery.agent.checks.selection import open_health_checks
from recovery.agent.compilecache import CompileCaches
from recovery.agent.config import AgentConfig
from recovery.agent.exits import take_last_exit
from recovery.agent.hangs import StockHangs, first_output
from recovery.agent.jobs import CommandFailed, JobOnNode, end_torch_stores
from recovery.agent.memory import MemoryTier, memory_root
from recovery.agent.outbox import Outbox
from recovery.agent.probes.nvml import open_nvml_probe
from recovery.agent.probes.watch import open_link_watcher, open_xid_follower, watch_probes
from recovery.agent.progress import ProgressFold, SilenceWatch
from recovery.agent.relay import Relay
from recovery.agent.rescale import Rescale
from recovery.agent.reset import ResetFailed, reset_device
from recovery.agent.stacks import Dumps, dump_tool, take_stack
from recovery.agent.standby import StandbyPool
from recovery.agent.stores import JobStores
from recovery.log.jetstream import JetStreamLog
from recovery.log.refusals import Refusals
from recovery.log.waiting import Attempts, until_streams_exist

logger = logging.getLogger("recovery.agent")

COMMANDS: TypeAdapter[Command] = TypeAdapter(Command)


class Agent(Relay, Rescale, Admission):
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.node = cfg.node
        self.source = f"agent@{cfg.node}"
        self.jobs: dict[str, JobOnNode] = {}
        self.seen_commands: set[str] = set()
        self.command_seq = 0  # the last command read (RECOVERY_CMD sequence)
        self._command_seqs: dict[str, int] = {}  # command id -> its sequence, while it is carried out
        self._commands: JetStreamLog | None = None
        self._command_start = 1  # the first command of this run of the agent: those before were missed or done
        self.nc: Client | None = None
        self.outbox: Outbox | None = None
        self._tg: TaskGroup | None = None
        self._boot = time.time_ns()  # event ids of this run of the agent: unique, and stable across retries
        self._counter = 0
        self.runtime_dir = cfg.runtime_dir.resolve()
        # Opened here, so that a probe that cannot work stops the agent at start with the key to fix.
        self.link_watcher = open_link_watcher(cfg.links, cfg.sysfs_net)
        self.xid_follower = open_xid_follower(cfg.kernel_log, cfg.gpu_bus_ids)
        self.nvml = open_nvml_probe(cfg.nvml, cfg.kernel_log)
        self.progress = ProgressFold()
        self.silence = SilenceWatch()
        self.stores = JobStores(cfg.store_host)  # by port: jobs naming the same MASTER_PORT share one
        self.standbys = StandbyPool(self.runtime_dir, cfg.standby, cfg.standby_preload, cfg.standby_delay_s,
                                    cfg.step_hook, idle_s=cfg.standby_idle_s)
        self.dumps = Dumps()
        self.memory = MemoryTier(memory_root(cfg.memory_dir, cfg.node, self.runtime_dir), self.checkpoint_saved)
        self.warming: dict[str, anyio.CancelScope] = {}
        self.caches = CompileCaches(cfg.compile_cache_dir or self.runtime_dir / "compile-cache", cfg.shared_dir,
                                    cfg.compile_cache)
        written = [cfg.memory_dir, self.caches.root if cfg.compile_cache else None, cfg.shared_dir]  # by the ranks
        self.health = open_health_checks(cfg, self.nvml, written, self.node_event)
        self.health.idle = lambda: not any(p.alive for j in self.jobs.values() for p in j.processes.values())
        self._reported_at = -math.inf  # when a progress report last said this agent lives (monotonic)
        self.last_exit: str | None = None
        """why the previous agent on this node stopped, as it kept it in the runtime directory"""

    # -- events ----------------------------------------------------------------------------------------
    def _next_id(self) -> str:
        self._counter += 1
        return f"{self.node}:{self._boot}:{self._counter}"

    def publish(self, job: str, type_: str, data: dict[str, Any] | BaseModel, event_id: str | None,
                heartbeat: bool) -> None:
        # A progress report names its node: the engine takes it for the agent's sign of life, as a heartbeat.
        node = self.node if type_ == "progress.report" else None
        if node is not None:
            self._reported_at = time.monotonic()
        envelope = make_envelope(type_, data, id=event_id or self._next_id(), job=job, node=node, source=self.source)
        assert self.outbox is not None
        self.outbox.put(subjects.job_event(job, type_), encode_envelope(envelope), envelope.id, heartbeat=heartbeat)

    async def report_to_daemon(self, job: str) -> None:
        report = self.progress.take(job)
        if report is None or self.nc is None:
            return
        envelope = make_envelope("progress.report", report, id=self._next_id(), job=job, node=self.node,
                                 source=self.source)
        with contextlib.suppress(Exception):  # NATS away: this report is lost, as a beat may be
            await self.nc.publish(subjects.reports(self.node), encode_envelope(envelope))

    def node_event(self, type_: str, data: dict[str, Any], event_id: str | None = None) -> None:
        envelope = make_envelope(type_, data, id=event_id or self._next_id(), node=self.node, source=self.source)
        assert self.outbox is not None
        # A logged heartbeat is dropped first when the outbox is full; the statement of the live mode never is.
        self.outbox.put(subjects.node_event(self.node, type_), encode_envelope(envelope), envelope.id,
                        heartbeat=type_ == "node.heartbeat" and "live_s" not in data)

    async def _beat(self) -> None:
        """The agent's own heartbeat: its absence is how the engine tells a dead agent or host (whose ranks' reports
        stop with it) from ranks that stopped reporting. With `liveness = "live"` the beats go on core NATS, off the
        log, and the log holds the mode (stated once here) and what the daemon's liveness monitor finds."""
        period = self.cfg.node_heartbeat_s
        if self.cfg.liveness == "live":
            self.node_event("node.heartbeat", {"interval_s": period, "live_s": period})
            while True:
                assert self.nc is not None
                with contextlib.suppress(Exception):  # NATS away: this beat is lost, as a beat may be
                    await self.nc.publish(subjects.live(self.node), b"")
                await anyio.sleep(period)  # the live beat's period
        while True:
            # A report within the period of the slowest job's reports said it already (the engine's silence
            # threshold is several periods).
            quiet = max([self.cfg.node_heartbeat_s, *(self.report_period(job) for job in self.jobs)])
            if time.monotonic() - self._reported_at >= quiet:
                self.node_event("node.heartbeat", {"interval_s": self.cfg.node_heartbeat_s})
            await anyio.sleep(self.cfg.node_heartbeat_s)  # the heartbeat's period

    def ack(self, command: Command, status: str, reason: str = "", **result: Any) -> None:
        self.job_event(command.job, "command.ack",
                       {"command_id": command.id, "status": status, "reason": reason,
                        "result": {"node": self.node, **result}},
                       event_id=f"{subjects.command_msg_id(command.id, self.node)}:{status}")

    def standbys_wanted(self, job: JobOnNode) -> int:
        """The standbys the job keeps here: one for each of its ranks here while its faults restart every rank (no
        process of it here said it recovers in place: a stock script), else the pool's default (`StandbyPool`)."""
        assert job.spec.entrypoint is not None
        whole = not any(p.alive and p.caps is not None and "reform" in p.caps for p in job.processes.values())
        return self.standbys.wanted(job.spec.entrypoint, len(job.ranks_on(self.node)), whole)

    async def suspect_peer(self, job: str, rank: int, generation: int, error: str) -> None:
        """A rank this agent runs lost a peer's connection: the daemon probes the job's nodes at once."""
        if self.nc is None:
            return
        said = {"job": job, "rank": rank, "generation": generation, "error": error[:256]}
        with contextlib.suppress(Exception):  # NATS away: the silence bound finds a lost node instead
            await self.nc.publish(subjects.suspect(self.node), orjson.dumps(said))

    # -- running ---------------------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.last_exit = take_last_exit(self.runtime_dir)  # said in this run's first event of the node
        attempts = Attempts(logger, "NATS: the agent reports nothing until it connects", self.cfg.nats_url)

        async def on_error(exc: Exception) -> None:
            if self.nc is None:  # before the first connection: say what is waited for, not each failure's trace
                attempts.failed(exc)
            else:
                logger.debug("nats error", extra={"fields": {"error": repr(exc)}})

        servers = [s.strip() for s in self.cfg.nats_url.split(",") if s.strip()]  # a cluster: any of its servers
        refusals = Refusals(logger, f"the agent of node {self.node}")  # a refused publish is said as such, once
        self.nc = await nats.connect(servers, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                     name=f"recovery-agent-{self.node}", error_cb=refusals.around(on_error),
                                     inbox_prefix=self.cfg.nats_inbox_prefix)
        attempts.succeeded("NATS reached")
        # The daemon asks when something suggests this node is lost (`recovery.service.reachability`): the answer says
        # it lives, and its absence (NATS's "no responders") that no agent listens for the node.
        await self.nc.subscribe(subjects.probe(self.node), cb=_answer_probe)
        js = self.nc.jetstream(timeout=5.0)
        self.outbox = Outbox(js, self.cfg.outbox_capacity)
        log = JetStreamLog(self.nc, js, self.cfg.stream, owns_connection=False)
        commands = JetStreamLog(self.nc, js, self.cfg.command_stream, owns_connection=False)
        # Commands from before the agent started are another run's; jobs submitted before are read back (see
        # recovery.agent.admission), starting only what the old agent had not. A daemon creates the streams: an agent
        # started first waits for them.
        streams = f"{self.cfg.stream}, {self.cfg.command_stream}"
        log_start = await until_streams_exist(lambda: _next_seq(log), logger, streams)
        command_start = await until_streams_exist(lambda: _next_seq(commands), logger, streams)
        self._commands, self._command_start, self.command_seq = commands, command_start, command_start - 1
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self.outbox.run)
                # The jobs from before come first: a command for one of them must find it known.
                submitted = submissions(await log.stream_info())
                await self._known_jobs(log, log_start, submitted)
                tg.start_soon(self._follow_jobs, log, log_start, submitted)
                tg.start_soon(self._follow_commands, commands, command_start)
                tg.start_soon(self._beat)
                tg.start_soon(self.fold_reports)
                tg.start_soon(StockHangs(self.cfg, self.jobs, self.job_event).run)
                tg.start_soon(self.memory.run)
                said = {"last_exit": self.last_exit} if self.last_exit is not None else {}
                said |= self.health.announcement()  # `node.checked` follows: no ranks here until it passes
                if self.cfg.spare:
                    pool = {"pool": self.cfg.pool} if self.cfg.pool is not None else {}
                    self.node_event("node.joined", {"spare": True, "devices": self.cfg.devices, **pool, **said})
                else:
                    self.node_event("node.ready", said)
                tg.start_soon(self.health.serve)
                tg.start_soon(watch_probes, self.link_watcher, self.xid_follower, self.nvml,
                              self.health.watching(self.node_event), self.cfg)
                logger.info("agent ready", extra={"fields": {"node": self.node}})
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def preempt(self) -> None:
        """SIGTERM from the platform (a preemption, a node taken away): every live rank saves a dying checkpoint at
        its next step boundary and waits there (the SDK's part), then gets SIGTERM, then SIGKILL, within
        `preempt_grace_s`; the exits report the preemption. The agent then stays `preempt_linger_s` to acknowledge
        what the engine decides about its ranks (it waits for every addressed node), and stops. A rank that ends by
        itself meanwhile (its script finished) is waited for no more, and leaves nothing to linger for."""
        grace = self.cfg.preempt_grace_s
        stopped: list[bool] = []
        async with anyio.create_task_group() as tg:
            for job in self.jobs.values():
                live = [p for p in job.processes.values() if p.alive]
                if live:
                    tg.start_soon(stopping.stop_saving, self.node, job, live, grace, self.cfg.kill_grace_s, stopped)
        if any(stopped):
            await anyio.sleep(self.cfg.preempt_linger_s)  # commands about the stopped ranks are still to come

    async def _shutdown(self) -> None:
        """The agent stops: its ranks get SIGTERM and the kill grace to end (a platform stopping the node), then
        SIGKILL; the stores and the standbys go with the agent."""
        await self.standbys.close()
        self.memory.close()
        async with anyio.create_task_group() as tg:
            for job in self.jobs.values():
                for proc in job.processes.values():
                    tg.start_soon(ranks.stop, proc, self.cfg.kill_grace_s, self.cfg.kill_grace_s)
        await self.stores.aclose()
        for probe in (self.xid_follower, self.nvml):
            if probe is not None:
                probe.close()
        if self.outbox is not None:
            await self.outbox.flush(2.0)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _follow_commands(self, log: JetStreamLog, start: int) -> None:
        async for record in log.follow(start, subjects.node_commands(self.node)):
            raw = getattr(record, "data", None)
            if raw is None:
                continue
            try:
                command = COMMANDS.validate_json(raw)
            except ValidationError as exc:
                logger.warning("undecodable command on %s: %s", record.subject, exc)
                continue
            if command.id in self.seen_commands:
                continue  # a command is carried out once, however often it arrives
            self.seen_commands.add(command.id)
            self.command_seq = record.seq
            self._command_seqs[command.id] = record.seq
            assert self._tg is not None
            self._tg.start_soon(self._carry_out, command)

    # -- jobs ------------------------------------------------------------------------------------------
    def _adopt(self, job: JobOnNode) -> None:
        prefix = f"{job.id}.rank"
        for path in sorted(self.runtime_dir.glob("*.json")):
            rank = path.name[len(prefix):-len(".json")]
            if not path.name.startswith(prefix) or not rank.isdigit():
                continue
            proc = ranks.adopt(self.runtime_dir, job.id, int(rank))
            if proc is None:
                continue
            job.processes[proc.rank] = proc
            logger.info("adopted rank %d of %s (pid %d, generation %d), which outlived the previous agent",
                        proc.rank, job.id, proc.pid, proc.attempt)
            assert self._tg is not None
            self._tg.start_soon(self._watch, job, proc)

    async def _fence(self, job: JobOnNode) -> None:
        """Catch up with the commands for this job that reached the node before this agent started: the placement
        they made (a migration here or away, a job restart or scale on other nodes: the spec's is stale), and, for
        the ranks adopted from the old agent, what they ended. A rank that a restart, stop, migration away, job
        restart, scale or failure sent after its process started would have ended is ended now (the engine has moved
        on without it: a copy may already run elsewhere, in a newer generation). Nothing a missed command would have
        started is started, and none is acknowledged (the engine gave up on them when their acks were due)."""
        assert self._commands is not None
        ending: set[int] = set()
        try:
            async for record in self._commands.read(1, self._command_start - 1,
                                                    subjects.job_commands(self.node, job.id)):
                raw = getattr(record, "data", None)
                try:
                    command = COMMANDS.validate_json(raw) if raw is not None else None
                except ValidationError:
                    continue
                if command is None:
                    continue
                for rank in self._ended_by(job, command):
                    proc = job.processes.get(rank)
                    if proc is not None and proc.process is None and proc.command_seq < record.seq:
                        ending.add(rank)
                self._place(job, command)
            if ending:
                logger.warning("ending adopted ranks %s of %s: commands this node missed while no agent ran ended "
                               "them", sorted(ending), job.id)
                await self._kill(job, sorted(ending))
        except Exception:  # catching up must not stop the agent: the ranks it could not end are still watched
            logger.exception("could not catch up with the commands %s missed for %s", self.node, job.id)
        finally:
            job.caught_up.set()

    @staticmethod
    def _place(job: JobOnNode, command: Command) -> None:
        """The job's placement after `command`, as carrying it out changes it."""
        match command:
            case MigrateRanks():
                if command.from_node in job.nodes:
                    job.nodes[job.nodes.index(command.from_node)] = command.to_node
            case RestartJob() | ScaleJob():
                job.nodes = list(command.nodes)
                if isinstance(command, ScaleJob):
                    job.layout = job.layout.scaled(command.dp)

    def _ended_by(self, job: JobOnNode, command: Command) -> list[int]:
        """The ranks here whose processes `command` ends."""
        match command:
            case RestartRanks() | StopRanks():
                return list(command.ranks)
            case MigrateRanks() if command.from_node == self.node:
                return list(command.ranks)
            case RestartJob() | ScaleJob() | FailJob():
                return list(job.processes)
        return []

    async def _launch(self, job: JobOnNode, rank: int, attempt: int, plan: ResumePlan | None,
                      command_id: str | None = None, *, whole: bool) -> None:
        """Start `rank` in generation `attempt`; `whole`: every rank of the job starts in it (a new formation, with
        a fresh torch store), else the rank joins the running ones (a partial restart)."""
        assert job.spec.entrypoint is not None
        await self.health.gate(job.id)  # ChecksFailed: nothing starts on a node that failed its checks
        torch_port = await job.torch_port(attempt, whole, self.cfg.store_wait_s)
        env = ranks.environment(job.spec.entrypoint, job.placement(rank), job=job.id, node=self.node,
                                attempt=attempt, plan=plan, store_addr=job.store_addr, store_port=job.store_port,
                                torch_port=torch_port, socket=job.channel.path, heartbeat_s=self.cfg.heartbeat_s,
                                memory_dir=self.memory.job_dir(job.id),
                                error_file=errors.error_file(self.runtime_dir, job.id, rank, attempt),
                                step_hook=self.cfg.step_hook)
        env.update(self.caches.environment(job.id, job.spec.entrypoint.env))
        await self.caches.fetch(job.id)  # what the job compiled elsewhere, before its first rank here (once)
        if (following := self.caches.to_follow(job.id)) is not None:
            assert self._tg is not None
            self._tg.start_soon(self.caches.follow, job.id, job.stepped, following)
        output = errors.output_file(self.runtime_dir, job.id, rank, attempt)
        standby = self.standbys.take(job.id, env)
        proc = await ranks.start(job.spec.entrypoint, env, output, job=job.id, rank=rank, attempt=attempt,
                                 standby=standby)
        proc.command_seq = self._command_seqs.get(command_id, self.command_seq) if command_id else self.command_seq
        job.processes[rank] = proc
        ranks.write_record(self.runtime_dir, proc)
        if standby is not None:
            assert self._tg is not None
            self._tg.start_soon(self.standbys.keep, job.id, job.spec.entrypoint, lambda: self.standbys_wanted(job),
                                len(job.ranks_on(self.node)))
        # `announces`: this agent relays what the process's SDK says it can do; until it says, it can do nothing
        # more than a stock script (`process.capabilities`)
        self.job_event(job.id, "process.started", {"rank": rank, "pid": proc.pid, "attempt": attempt,
                                                   "announces": True})
        assert self._tg is not None
        self._tg.start_soon(self._watch, job, proc)
        self._tg.start_soon(first_output, job, proc, output, self.job_event)

    async def _watch(self, job: JobOnNode, proc: ranks.RankProcess) -> None:
        await ranks.reap(proc)
        if proc.returncode is None:
            # Its status unknown (adopted, or a standby whose parent ended first): it ended on its own if its SDK said
            # `closing`, a line that may still be unread until the connection ends (bounded: a dead SDK sends none).
            with anyio.move_on_after(2.0):
                while job.channel.connected(proc.rank):
                    await anyio.sleep(0.01)  # polling the connection's end, within the bound above
            proc.returncode = 0 if proc.closing else None
        ranks.forget_record(self.runtime_dir, proc)
        if job.processes.get(proc.rank) is proc:
            self.silence.forget(job.id, proc.rank)  # gone: its exit says so, not a silence
            self.progress.forget(job.id, proc.rank)
        exit_code, killed_by = proc.status()
        data: dict[str, Any] = {"rank": proc.rank, "attempt": proc.attempt}
        if killed_by is not None:
            data["signal"] = killed_by
        else:
            data["exit_code"] = exit_code
        error = errors.script_error(self.runtime_dir, job.id, proc.rank, proc.attempt, exit_code, killed_by)
        if error is not None:
            data["error"] = error.model_dump()
        self.job_event(job.id, "process.exited", data)
        if all(not p.alive and p.returncode == 0 for p in job.processes.values()):
            await self.standbys.discard(job.id, for_good=True)  # the job is done here: no rank to hand over
            assert self._tg is not None
            self._tg.start_soon(self.memory.end, job.id)  # and no checkpoint in memory to restart from
            self._tg.start_soon(self.caches.end, job.id, bool(job.nodes) and job.nodes[0] == self.node)
        if exit_code == 0 and job.nodes and job.nodes[0] == self.node and not job.finished:
            here = [job.processes.get(r) for r in job.ranks_on(self.node)]
            if all(p is not None and not p.alive and p.returncode == 0 for p in here):
                # Data-parallel ranks finish together: the first node's agent says so for the job.
                job.finished = True
                self.job_event(job.id, "job.completed", {}, event_id=f"{job.id}:completed")
                await end_torch_stores(job.store_addr, job.store_port, job.id)

    # -- commands --------------------------------------------------------------------------------------
    async def _carry_out(self, command: Command) -> None:
        try:
            await self._carry_out_once(command)
        finally:
            self._command_seqs.pop(command.id, None)

    async def _carry_out_once(self, command: Command) -> None:
        job = self.jobs.get(command.job)
        self.ack(command, "accepted")
        try:
            if job is None and not isinstance(command, IsolateNode | IsolateDevice):
                raise CommandFailed(f"job {command.job} has no entrypoint known to the agent of {self.node}")
            result = await self._execute(command, job)
        except CommandFailed as exc:
            logger.warning("command %s failed: %s", command.id, exc)
            self.ack(command, "failed", str(exc), **exc.result)
            return
        except Exception as exc:  # one job's command that breaks is that job's failure, never the agent's
            logger.exception("command %s of %s failed unexpectedly", command.id, command.job)
            self.ack(command, "failed", f"{type(exc).__name__}: {exc}")
            return
        self.ack(command, "done", **result)

    async def _execute(self, command: Command, job: JobOnNode | None) -> dict[str, Any]:
        match command:
            case RestartRanks():
                assert job is not None
                mine = [r for r in command.ranks if r in job.ranks_on(self.node)]
                await self._kill(job, mine)
                reset = sorted(command.reset_devices.get(self.node, []))
                for device in reset:  # after the ranks are gone (a GPU in use cannot be reset), before they start
                    try:
                        await reset_device(self.cfg.device_reset_command, device, self.cfg.device_reset_timeout_s)
                    except ResetFailed as exc:
                        # named in the ack, so that the engine counts the device bad again and moves the ranks
                        raise CommandFailed(str(exc), reset_failed=[device]) from None
                    logger.info("reset GPU %d for job %s", device, job.id)
                for rank in mine:
                    await self._launch(job, rank, command.attempt, command.plan, command.id,
                                       whole=job.restarts_all(command.ranks))
                return {"restarted": mine, "reset": reset} if reset else {"restarted": mine}
            case StopRanks():
                assert job is not None
                mine = [r for r in command.ranks if r in job.ranks_on(self.node)]
                if command.mode == "kill":
                    await self._kill(job, mine)
                else:
                    await self.dumps.settled(job.id)
                    await stopping.stop_gracefully(job, mine, command.grace_s, self.cfg.kill_grace_s,
                                                   signal.Signals[command.signal], stuck_kill=command.stuck == "kill")
                return {"stopped": mine}
            case MigrateRanks():
                assert job is not None
                if command.to_node == self.node:  # before anything changes: a node that fails takes nothing
                    await self.health.gate(job.id, moved_here=True)
                if command.from_node == self.node:
                    await self._kill(job, [r for r in command.ranks if r in job.processes])
                self._place(job, command)
                if command.to_node == self.node:
                    for rank in command.ranks:
                        await self._launch(job, rank, command.attempt, command.plan, command.id,
                                           whole=job.restarts_all(command.ranks))
                return {"ranks": command.ranks}
            case ScaleJob() if command.kept:
                assert job is not None
                return await self.scale_keeping(job, command)  # survivors re-form in the new world
            case RestartJob() | ScaleJob():
                assert job is not None
                await self._kill(job, list(job.processes))
                self._place(job, command)
                for rank in job.ranks_on(self.node):
                    await self._launch(job, rank, command.attempt, command.plan, command.id, whole=True)
                return {"started": job.ranks_on(self.node)}
            case SaveCheckpoint():
                assert job is not None
                return await self._save(job, command)
            case DumpStacks():
                assert job is not None
                return await self._dump(job, command)
            case FailJob():
                assert job is not None
                await self._kill(job, list(job.processes))
                await end_torch_stores(job.store_addr, job.store_port, job.id)
                assert self._tg is not None
                self._tg.start_soon(self.memory.end, job.id)
                self._tg.start_soon(self.caches.end, job.id, bool(job.nodes) and job.nodes[0] == self.node)
                return {}
            case RetryStep():
                assert job is not None
                return await job.retry(command.attempt, self.cfg.store_wait_s)
            case IsolateNode() | IsolateDevice():
                return {}
        raise CommandFailed(f"unknown command {command.kind}")

    async def _dump(self, job: JobOnNode, command: DumpStacks) -> dict[str, Any]:
        """Every live process of the job here, its stack, as one `process.stacks` event (see `stacks`)."""
        done = self.dumps.begin(job.id)  # before any await: a kill carried out after this command waits for it
        try:
            live = sorted((p.rank, p.pid) for p in job.processes.values() if p.alive)
            tool = dump_tool()
            found: list[RankStack | None] = [None] * len(live)

            async def one(index: int, rank: int, pid: int) -> None:
                found[index] = await take_stack(rank, pid, tool)

            async with anyio.create_task_group() as tg:
                for index, (rank, pid) in enumerate(live):
                    tg.start_soon(one, index, rank, pid)
            self.job_event(job.id, "process.stacks", {"ranks": [s.model_dump() for s in found if s is not None],
                                                      "command_id": command.id, "tool": "py-spy"})
            logger.info("stacks of %d rank(s) of %s taken: %s", len(live), job.id, command.reason)
            return {"ranks": [rank for rank, _ in live]}
        finally:
            self.dumps.end(job.id, done)

    async def _kill(self, job: JobOnNode, which: list[int]) -> None:
        await self.dumps.settled(job.id)  # the hang's evidence first
        procs = [job.processes[r] for r in which if r in job.processes]
        async with anyio.create_task_group() as tg:
            for proc in procs:
                tg.start_soon(ranks.kill, proc, self.cfg.kill_grace_s)
        if any(p.alive for p in procs):
            raise CommandFailed(f"ranks {[p.rank for p in procs if p.alive]} did not end after SIGKILL")

    async def _save(self, job: JobOnNode, command: SaveCheckpoint) -> dict[str, Any]:
        mine = [r for r in command.ranks if r in job.processes and job.processes[r].alive]
        waits = []
        for rank in mine:
            request = f"{command.id}/{rank}"
            job.saves[request] = anyio.Event()
            if await job.channel.send(rank, {"op": "save", "id": request, "step": command.step}):
                waits.append(job.saves[request])
        if not waits:
            raise CommandFailed(f"no live rank of {command.ranks} on {self.node} could be asked to save")
        with anyio.move_on_after(command.deadline_s):
            for event in waits:
                await event.wait()
        if not all(event.is_set() for event in waits):
            raise CommandFailed("the dying checkpoint was not saved before the command's deadline")
        failed = {rank: job.save_failures.pop(f"{command.id}/{rank}") for rank in mine
                  if f"{command.id}/{rank}" in job.save_failures}
        if failed:
            # named in the ack, so that the engine does not count a checkpoint that was never written
            reasons = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(failed.items()))
            raise CommandFailed(f"the dying checkpoint failed: {reasons}", failed=sorted(failed),
                                saved=[r for r in mine if r not in failed])
        return {"saved": mine}


async def _next_seq(log: JetStreamLog) -> int:
    return await log.last_seq() + 1


async def _answer_probe(msg: Any) -> None:
    with contextlib.suppress(Exception):  # NATS away: the daemon asked in vain, and its silence bound decides
        await msg.respond(b"")

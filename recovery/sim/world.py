"""The simulated world: hardware, the training job and the executors, in virtual time.

The world knows nothing of the engine. It emits the events a real cluster would (device probes, node agents,
the platform, executors' acks) through a `sink`, schedules its own future through a `Scheduler`, and carries
out the commands handed to `execute`, each after the duration of the cost model. `recovery.sim.sim.Simulator`
puts the real engine between the two; `recovery.sim.demo.DemoCluster` hands the same events to a daemon in real
time.

Training between faults is closed form: the job's step at time t is `anchor_step + (t - anchor_t) // step`,
and nothing is emitted while it trains, except a persistent checkpoint at each save. What the engine needs to
know at a fault (how far every shard's replicas got, which in-memory snapshot the hosts hold) is reported when
it matters, just before the fault's own events: the per-step reports of a real job collapse into their last
one, because the engine keeps only the newest step of every rank and the newest snapshot per holder.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from events import subjects
from events.commands import CommandBase
from events.envelope import EnvelopeBase, make_envelope
from events.values import MAX_WATCHDOG_S, STORAGE_HOLDER, JobSpec, Layout, ResumePlan, Tier
from policies.codes import Action, nvidia_xid
from recovery.sim.config import NS, SimConfig
from recovery.sim.faults import FOLLOW_UPS, Fault, node_name

Sink = Callable[[str, EnvelopeBase], None]
_RESTARTS = ("restart_ranks", "migrate_ranks", "restart_job", "scale_job")
LINK = "ib0"


class Scheduler(Protocol):
    """Virtual time: `now` in nanoseconds of log time, and actions to run at a later time, in order."""

    @property
    def now(self) -> int: ...

    def at(self, when: int, action: Callable[[], None]) -> None: ...


@dataclass(slots=True)
class Hardware:
    """One node as the world sees it (the engine only sees the events)."""

    name: str
    switch: str
    down: bool = False
    """the host is gone (power, CPU, memory, maintenance)"""
    gpu_lost: int | None = None
    """the device that fell off the bus: the node needs a power cycle"""
    bad: set[int] = field(default_factory=set)
    """devices that need a reset or a replacement"""
    link_down: bool = False
    not_ready: bool = False
    """the platform marked it not ready (announced with node.not_ready)"""
    isolated: bool = False
    repairing: bool = False

    @property
    def healthy(self) -> bool:
        return not (self.down or self.gpu_lost is not None or self.bad or self.link_down or self.isolated
                    or self.not_ready)


@dataclass
class Counters:
    """Training time booked by the world, in nanoseconds: it sums to the ledger's `train` interval."""

    productive: int = 0
    recompute: int = 0
    checkpoint: int = 0
    """the in-memory snapshots' stall, spread over the steps (memory_save_stall_s / memory_every_steps)"""
    steps: int = 0
    """steps completed for the first time"""


class World:
    def __init__(self, config: SimConfig, scheduler: Scheduler, sink: Sink, *, start_ns: int) -> None:
        self.cfg = config
        self.sched = scheduler
        self.sink = sink
        self.start_ns = start_ns
        cl = config.cluster
        self.rpn = cl.gpus_per_node
        self.tp, self.pp, self.dp = cl.tp, cl.pp, cl.dp
        self.shards = cl.shards
        self.shard_bytes = config.training.shard_bytes(cl)
        names = [node_name(i) for i in range(cl.nodes + cl.spares)]
        self.hw: dict[str, Hardware] = {n: Hardware(n, f"leaf{i // cl.nodes_per_switch:03d}")
                                        for i, n in enumerate(names)}
        self.by_switch: dict[str, list[str]] = {}
        for n in names:
            self.by_switch.setdefault(self.hw[n].switch, []).append(n)
        self.placement: list[str] = names[: cl.nodes]
        self.initial_spares = names[cl.nodes:]
        self.exec_rng = random.Random(f"recovery-sim/executors/{config.seed}")
        tr = config.training
        self.step_ns = int(tr.step_time_s * NS)
        self.memory_k = tr.memory_every_steps if config.profile.memory_tier else None
        mem_stall = int(config.costs.memory_save_stall_s * NS) // self.memory_k if self.memory_k else 0
        self.step_eff = self.step_ns + mem_stall
        self.storage_every = int(tr.storage_every_s * NS) if tr.storage_every_s else None
        # the job
        self.generation = 0
        self.dead: set[int] = set()
        self.hung: set[int] = set()
        self.training = False
        self.loading = False
        self.stalled = False
        """staging a persistent checkpoint: training pauses for the save's stall"""
        self.failed = False
        self.anchor_t = 0
        self.anchor_step = 0
        self.high_water = 0
        self.halted_step = 0
        self.resume_step = 0
        self.reported_step = 0
        self.mem_step: dict[str, int] = {}
        """holder node -> step of the in-memory snapshot it holds (hosts keep their latest only)"""
        self.storage_credit = 0
        """training time since the last persistent checkpoint"""
        self.counters = Counters()
        self._token = 0
        self._epoch = 0
        self._ct_epoch: int | None = None
        self.inflight: dict[str, tuple[int, frozenset[int]]] = {}
        """restart commands under way: id -> (generation, ranks)"""
        self.restarted: set[int] = set()
        self.plan: ResumePlan | None = None
        self.retried = False
        self._n = 0
        self.stats: dict[str, int] = {}
        self.replaced: set[tuple[str, int]] = set()
        """devices swapped for new ones after an isolation: a lemon's repeated faults stop there"""

    @property
    def busy_label(self) -> str | None:
        """What the job is doing, when the world knows better than the engine's state: training, staging a
        checkpoint, loading its state, or failed. None: it is stopped, and the engine's state says why."""
        if self.failed:
            return "failed"
        if self.training:
            return "train"
        if self.stalled:
            return "checkpoint"
        if self.loading:
            return "loading"
        return None

    # -- small helpers --------------------------------------------------------------------------------
    @property
    def job(self) -> str:
        return self.cfg.job

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def _id(self) -> str:
        self._n += 1
        return f"e{self._n}"

    def job_event(self, type_: str, data: dict[str, Any], source: str = "agent") -> None:
        self.sink(subjects.job_event(self.job, type_), make_envelope(type_, data, id=self._id(), job=self.job,
                                                                     source=source))

    def node_event(self, node: str, type_: str, data: dict[str, Any], source: str | None = None) -> None:
        self.sink(subjects.node_event(node, type_), make_envelope(type_, data, id=self._id(), node=node,
                                                                  source=source or f"probe@{node}"))

    def later(self, delay_ns: int, action: Callable[[], None]) -> None:
        self.sched.at(self.sched.now + delay_ns, action)

    def node_of(self, rank: int) -> str:
        return self.placement[rank // self.rpn]

    def ranks_on(self, node: str) -> range:
        index = self.placement.index(node)
        return range(index * self.rpn, (index + 1) * self.rpn)

    def reporters(self) -> list[int]:
        """One rank per shard in the first and the last data-parallel replica: their reports tell the engine
        how far every shard got, and their holders keep the in-memory snapshots the engine hears about."""
        replicas = [0] if self.dp == 1 else [0, self.dp - 1]
        return [replica * self.shards + shard for replica in replicas for shard in range(self.shards)]

    def spec(self) -> JobSpec:
        # The one job may use the whole spare pool (repaired nodes rejoin it, so no fixed quota fits). Its ranks send
        # no heartbeats: a watchdog interval past the run's end (within the wire's bound) keeps it quiet.
        return JobSpec(nodes=list(self.placement), ranks_per_node=self.rpn, max_restarts=None,
                       layout=Layout(dp=self.dp, tp=self.tp, pp=self.pp), spares=None,
                       policies=self.cfg.profile.selection,
                       watchdog_interval_s=self.cfg.watchdog_interval_s or min(
                           max(10 * self.cfg.days * 86_400.0, 1e6), MAX_WATCHDOG_S))

    # -- start and end --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nodes join, the job is submitted and starts from a persistent checkpoint at step 0."""
        for name in self.placement:
            self.node_event(name, "node.joined", {"spare": False, "devices": self.rpn}, source="scheduler")
        for name in self.initial_spares:
            self.node_event(name, "node.joined", {"spare": True, "devices": self.rpn}, source="scheduler")
        self.job_event("job.submitted", {"spec": self.spec().model_dump()}, source="scheduler")
        self.job_event("checkpoint.saved", {"step": 0, "tier": Tier.STORAGE, "holder": STORAGE_HOLDER,
                                            "shards": list(range(self.shards))}, source="checkpointer")
        self.job_event("job.started", {}, source="scheduler")
        self._train(self.sched.now, 0)
        if self.cfg.report_every_s:
            self._tick()

    def _tick(self) -> None:
        """Reporting mode: every live rank's agent reports its step while the job trains, a heartbeat otherwise."""
        if not self.failed:
            live = [r for r in range(self.world_size)
                    if r not in self.dead and r not in self.hung and not self.hw[self.node_of(r)].down]
            step = self.step_now() if self.training else None
            for rank in live:
                if step is not None:
                    self.job_event("progress.step", {"rank": rank, "step": step, "attempt": self.generation},
                                   source=f"agent@{self.node_of(rank)}")
                else:
                    self.job_event("process.heartbeat", {"rank": rank, "attempt": self.generation},
                                   source=f"agent@{self.node_of(rank)}")
            if step is not None:
                self.reported_step = max(self.reported_step, step)
        self.later(int((self.cfg.report_every_s or 1.0) * NS), self._tick)

    def finish(self, end: int) -> None:
        """The horizon: book the training under way (its unfinished step counts: it is not lost)."""
        if self.training:
            self._halt(end, final=True)

    # -- training, closed form ------------------------------------------------------------------------
    def step_now(self) -> int:
        if not self.training or self.sched.now <= self.anchor_t:
            return self.anchor_step if self.training else self.halted_step
        return self.anchor_step + (self.sched.now - self.anchor_t) // self.step_eff

    def _train(self, t: int, from_step: int, report_rank: int | None = None) -> None:
        self._token += 1
        self._epoch += 1
        self._ct_epoch = None
        self.training, self.loading, self.stalled = True, False, False
        self.anchor_t, self.anchor_step = t, from_step
        token = self._token
        if report_rank is not None:
            # the restarted ranks report their first step: the engine closes the incident on it
            def report() -> None:
                if self._token == token:
                    self.job_event("progress.step", {"rank": report_rank, "step": from_step + 1,
                                                     "attempt": self.generation}, source=f"agent@"
                                                                                         f"{self.node_of(report_rank)}")
            self.sched.at(t + self.step_eff, report)
        if self.storage_every is not None:
            due = max(0, self.storage_every - self.storage_credit)
            steps = -(-due // self.step_eff)
            self.sched.at(t + steps * self.step_eff, lambda: self._storage_save(token))

    def _halt(self, t: int, final: bool = False) -> None:
        """Stop training at t and book it: new steps are productive, steps done again are recomputation, an
        interrupted step is lost (at the horizon it is not: it would complete)."""
        if not self.training:
            return
        self._token += 1
        elapsed = max(0, t - self.anchor_t)
        n, part = divmod(elapsed, self.step_eff)
        reached = self.anchor_step + n
        new = max(0, reached - max(self.high_water, self.anchor_step))
        c = self.counters
        c.productive += new * self.step_ns + (part if final else 0)
        c.recompute += (n - new) * self.step_ns + (0 if final else part)
        c.checkpoint += n * (self.step_eff - self.step_ns)
        c.steps += new
        self.storage_credit += elapsed
        self.high_water = max(self.high_water, reached)
        self.halted_step = reached
        self.training = False

    def _storage_save(self, token: int) -> None:
        """A persistent checkpoint at a step boundary: a short stall to stage the state in host memory, then an
        asynchronous upload; `checkpoint.saved` arrives when the upload is done."""
        if token != self._token or not self.training:
            return
        now = self.sched.now
        self._halt(now)
        self.storage_credit = 0
        step = self.halted_step
        stall = int(self.cfg.costs.storage_save_stall_s * NS)
        self.stalled = True
        upload = int(self.cfg.costs.save_s(self.shards, self.shard_bytes) * NS)

        def saved() -> None:
            if not self.failed:
                self.job_event("checkpoint.saved", {"step": step, "tier": Tier.STORAGE, "holder": STORAGE_HOLDER,
                                                    "shards": list(range(self.shards))}, source="checkpointer")
        self.later(stall + upload, saved)
        token2 = self._token

        def resume() -> None:
            if self._token == token2 and not self.failed:
                self._train(self.sched.now, step)
        self.later(stall, resume)

    def _catch_up(self, step: int) -> None:
        """Before a fault's events: what the job's ranks and hosts reported since the last fault, collapsed into
        the last report (the engine keeps only the newest step per rank and the newest snapshot per holder)."""
        reporters = [r for r in self.reporters() if r not in self.dead and r not in self.hung
                     and not self.hw[self.node_of(r)].down]
        if step > self.reported_step:
            for rank in reporters:
                self.job_event("progress.step", {"rank": rank, "step": step, "attempt": self.generation},
                               source=f"agent@{self.node_of(rank)}")
            self.reported_step = step
        if self.memory_k:
            snap = step // self.memory_k * self.memory_k
            if snap > self.resume_step:
                holders: dict[str, list[int]] = {}
                for rank in self.reporters():
                    holders.setdefault(self.node_of(rank), []).append(rank % self.shards)
                for node, shards in holders.items():
                    if self.mem_step.get(node) != snap and not self.hw[node].down:
                        self.mem_step[node] = snap
                        self.job_event("checkpoint.saved", {"step": snap, "tier": Tier.MEMORY, "holder": node,
                                                            "shards": sorted(set(shards))}, source=f"agent@{node}")

    def _stop_training(self) -> None:
        """Training stops now (a fault, or processes being stopped): book it and tell the engine how far it got."""
        if self.training:
            step = self.step_now()
            self._halt(self.sched.now)
            self._catch_up(step)
        elif self.loading or self.stalled:
            self.loading = self.stalled = False
            self._token += 1

    # -- faults ---------------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> bool:
        """Apply a fault and emit its events. Returns whether it struck the job (its nodes or processes)."""
        node = fault.node if fault.node in self.hw else self.placement[fault.position % len(self.placement)]
        if fault.repeat and (node, fault.device) in self.replaced:
            self._count("repeats_on_replaced_devices")
            return False
        hw = self.hw[node]
        switch = fault.signal == "network" and fault.scope == "switch"
        nodes = list(self.by_switch[hw.switch]) if switch else [node]
        struck = any(n in self.placement for n in nodes) and not self.failed
        if fault.signal == "device":
            meaning = nvidia_xid(fault.code or "79")
            struck = struck and meaning.action not in (Action.IGNORE, Action.WATCH)
        if struck:
            self._stop_training()
            self._arm_collective_timeout()
        getattr(self, f"_fault_{fault.signal}")(fault, node, nodes)
        return struck

    def _rank_on(self, node: str, device: int) -> int | None:
        if node not in self.placement:
            return None
        return self.placement.index(node) * self.rpn + device % self.rpn

    def _exit(self, rank: int, exit_code: int | None, signal: int | None) -> None:
        self.dead.add(rank)
        self.hung.discard(rank)
        self.job_event("process.exited", {"rank": rank, "exit_code": exit_code, "signal": signal,
                                          "attempt": self.generation}, source=f"agent@{self.node_of(rank)}")

    def _fault_device(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        code = fault.code or "79"
        meaning = nvidia_xid(code)
        hw = self.hw[node]
        self.node_event(node, "device.fault", {"device": fault.device, "vendor": "nvidia", "code": code,
                                               "severity": "critical"})
        follow = FOLLOW_UPS.get(code)
        if follow is not None:
            self.later(NS, lambda: self.node_event(node, "device.fault", {"device": fault.device, "vendor": "nvidia",
                                                                           "code": follow, "severity": "warning"}))
        if meaning.action in (Action.IGNORE, Action.WATCH):
            return
        if meaning.action in (Action.RESET_DEVICE, Action.ISOLATE_DEVICE, Action.ISOLATE_NODE):
            if meaning.fault_class is not None and meaning.fault_class.value == "node":
                hw.gpu_lost = fault.device
            else:
                hw.bad.add(fault.device)
            self._repair_later(node, fault.repair_ns)
        rank = self._rank_on(node, fault.device)
        if rank is not None and rank not in self.dead:
            gen = self.generation

            def crash() -> None:
                if self.generation == gen and rank not in self.dead and not self.failed:
                    # the CUDA error aborts the process (SIGABRT) unless the fault says otherwise
                    given = fault.exit_code is not None or fault.exit_signal is not None
                    self._exit(rank, fault.exit_code, fault.exit_signal if given else 6)
            self.later(int(self.cfg.agents.exit_report_s * NS), crash)

    def _fault_process(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        if node not in self.placement:
            return
        if fault.scope == "job":
            for rank in range(self.world_size):  # a dependency every rank uses is gone: all of them fail
                if rank not in self.dead:
                    self._exit(rank, 1, None)
            return
        struck = self._rank_on(node, fault.device)
        if struck is not None and struck not in self.dead:
            self._exit(struck, fault.exit_code, fault.exit_signal)

    def _fault_hang(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        rank = self._rank_on(node, fault.device)
        if rank is None or rank in self.dead:
            return
        self.hung.add(rank)
        gen = self.generation
        delay = self.cfg.agents.hang_detect_s

        def report() -> None:
            if rank in self.hung and self.generation == gen and not self.failed:
                self.job_event("process.hang", {"rank": rank, "seconds_without_progress": delay,
                                                "attempt": gen}, source=f"agent@{self.node_of(rank)}")
        self.later(int(delay * NS), report)

    def _fault_network(self, fault: Fault, node: str, nodes: list[str]) -> None:
        switch = self.hw[node].switch
        for name in nodes:
            self.hw[name].link_down = True
            self.node_event(name, "network.link_down", {"link": LINK, "switch": switch})
        if fault.outage_ns > 0:  # a switch reboot or a cable flap: the links come back by themselves
            def up() -> None:
                for name in nodes:
                    hw = self.hw[name]
                    if hw.link_down and not hw.repairing:
                        hw.link_down = False
                        self.node_event(name, "network.link_up", {"link": LINK})
                self._maybe_resume()  # restarted processes waiting in NCCL init can now connect
            self.later(fault.outage_ns, up)
            return
        # a dead NIC: the platform's health check marks the node not ready, and it waits for a repair
        def check() -> None:
            hw = self.hw[node]
            if hw.link_down and not hw.not_ready:
                hw.not_ready = True
                self.node_event(node, "node.not_ready", {"reason": f"health check: {LINK} down"}, source="k8s")
        self.later(int(self.cfg.agents.link_health_check_s * NS), check)
        self._repair_later(node, fault.repair_ns)

    def _fault_node(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        hw = self.hw[node]
        hw.down = True
        self.mem_step.pop(node, None)
        if node in self.placement:
            self.dead.update(self.ranks_on(node))  # the agent dies with the host: nobody reports the exits

        def not_ready() -> None:
            if hw.down and not hw.not_ready:
                hw.not_ready = True
                self.node_event(node, "node.not_ready", {"reason": fault.component}, source="k8s")
        self.later(int(self.cfg.agents.node_not_ready_s * NS), not_ready)
        self._repair_later(node, fault.repair_ns)

    def _repair_later(self, node: str, after_ns: int) -> None:
        hw = self.hw[node]
        if hw.repairing:
            return
        hw.repairing = True
        self.later(max(after_ns, NS), lambda: self._repaired(node))

    def _repaired(self, node: str) -> None:
        """The node is fixed: back in the job (each recovered condition announced), or back in the spare pool."""
        hw = self.hw[node]
        was_not_ready, link = hw.not_ready, hw.link_down
        bad = sorted(hw.bad)
        # An isolated node comes back repaired or replaced, and booted: it joins afresh, which ends its isolation.
        rebooted = hw.down or hw.gpu_lost is not None or hw.isolated
        if rebooted:
            self.mem_step.pop(node, None)  # a power cycle empties host memory; a GPU reset does not
        hw.down = hw.link_down = hw.not_ready = hw.isolated = hw.repairing = False
        hw.gpu_lost = None
        hw.bad.clear()
        if node in self.placement and not self.failed:
            if rebooted:  # booted again: it joins afresh (the engine forgets what its memory held)
                self.node_event(node, "node.joined", {"spare": False, "devices": self.rpn}, source="scheduler")
            else:
                for device in bad:
                    self.node_event(node, "device.recovered", {"device": device})
                if link:
                    self.node_event(node, "network.link_up", {"link": LINK})
                if was_not_ready:
                    self.node_event(node, "node.ready", {}, source="k8s")
            self._maybe_resume()
        else:
            self.node_event(node, "node.joined", {"spare": True, "devices": self.rpn}, source="scheduler")

    # -- collective timeouts --------------------------------------------------------------------------
    def _arm_collective_timeout(self) -> None:
        """The ranks still running block in a collective; if nothing restarts them they time out (NCCL's
        watchdog), report it, and abort."""
        if self._ct_epoch == self._epoch or self.failed:
            return
        self._ct_epoch = epoch = self._epoch
        self.later(int(self.cfg.agents.collective_timeout_s * NS), lambda: self._collective_timeout(epoch))

    def _collective_timeout(self, epoch: int) -> None:
        if epoch != self._epoch or self.training or self.loading or self.failed:
            return
        gone = {r for n in self.placement if self.hw[n].down or self.hw[n].gpu_lost is not None
                for r in self.ranks_on(n)}
        stuck = sorted(self.dead | self.hung | gone)
        first = stuck[0] if stuck else next((r for n in self.placement if self.hw[n].link_down
                                             for r in self.ranks_on(n)), 0)
        shard = first % self.shards
        members = list(range(shard, self.world_size, self.shards))
        stuck_set = set(stuck)
        reporters = [r for r in members if r not in stuck_set] or members
        timeout = self.cfg.agents.collective_timeout_s
        self.job_event("network.collective_timeout", {"group": f"dp{shard}", "members": members,
                                                      "reporters": reporters, "operation": "allreduce",
                                                      "timeout_s": timeout, "attempt": self.generation},
                       source="agent")
        # the watchdog aborts every process that timed out: the job has no live rank left
        self.dead.update(range(self.world_size))
        self.hung.clear()
        self._count("collective_timeouts")

    # -- executors ------------------------------------------------------------------------------------
    def command_cost_s(self, command: CommandBase) -> float:
        c = self.cfg.costs
        kind = getattr(command, "kind", "")
        data: Any = command
        if kind == "stop_ranks":
            return c.stop_kill_s if data.mode == "kill" else min(c.stop_graceful_s, data.grace_s)
        if kind == "save_checkpoint":
            return c.save_s(len(data.ranks), self.shard_bytes)
        if kind == "retry_step":
            return c.retry_step_s
        if kind == "restart_ranks":
            return c.restart_in_place_s + (c.device_reset_s if data.reset_devices else 0.0)
        if kind == "migrate_ranks":
            return c.migrate_s
        if kind in ("restart_job", "scale_job"):
            return c.restart_job_s(len(data.nodes))
        if kind in ("isolate_node", "isolate_device"):
            return c.isolate_s
        return c.fail_job_s

    def execute(self, command: CommandBase) -> None:
        """Carry out a command like an executor: ack `accepted` at once, then `done` (or `failed`) after its
        cost; with the configured probabilities it fails, or never answers."""
        c = self.cfg.costs
        kind = getattr(command, "kind", "")
        now = self.sched.now
        lat = int(c.ack_latency_s * NS)
        self.sched.at(now + lat, lambda: self._ack(command, "accepted"))
        u = self.exec_rng.random()
        outcome = "failed" if u < c.fail_probability else (
            "timeout" if u < c.fail_probability + c.timeout_probability else "ok")
        self._count(f"{kind}:{outcome}")
        if kind in ("stop_ranks", *_RESTARTS, "retry_step"):
            self._stop_training()
        if kind in _RESTARTS:
            self.inflight[command.id] = (command.attempt, frozenset(self._command_ranks(command)))
        cost = int(self.command_cost_s(command) * NS)
        self.sched.at(now + lat + cost, lambda: self._complete(command, outcome))

    def _ack(self, command: CommandBase, status: str, reason: str = "") -> None:
        self.job_event("command.ack", {"command_id": command.id, "status": status, "reason": reason},
                       source="executor")

    def _command_ranks(self, command: Any) -> list[int]:
        kind = command.kind
        if kind in ("restart_ranks", "migrate_ranks"):
            return list(command.ranks)
        if kind == "restart_job":
            return list(range(self.world_size))
        if kind == "scale_job":
            return list(range(command.dp * self.tp * self.pp))
        return []

    def _complete(self, command: Any, outcome: str) -> None:
        kind = command.kind
        self.inflight.pop(command.id, None)
        if self.failed and kind != "fail_job":
            return
        if outcome == "timeout":
            self._maybe_resume()
            return
        if outcome == "failed":
            self._ack(command, "failed", "executor error (simulated)")
            self._maybe_resume()
            return
        why = getattr(self, f"_do_{kind}")(command)
        if why:
            self._count(f"{kind}:refused")
            self._ack(command, "failed", why)
            self._maybe_resume()
            return
        if kind != "save_checkpoint":
            self._ack(command, "done")
        self._maybe_resume()

    def _unhealthy(self, nodes: list[str]) -> str:
        for name in nodes:
            hw = self.hw[name]
            if not hw.healthy:
                what = ("host down" if hw.down else "GPU off the bus" if hw.gpu_lost is not None else
                        f"devices {sorted(hw.bad)} need a reset" if hw.bad else f"{LINK} down" if hw.link_down
                        else "isolated" if hw.isolated else "not ready")
                return f"node {name}: {what}"
        return ""

    def _others_blocked(self, ranks: set[int], generation: int) -> str:
        """Ranks outside the restart must still run (they roll back in place) unless another restart of the same
        generation is bringing them back."""
        covered = set(ranks)
        for gen, others in self.inflight.values():
            if gen == generation:
                covered |= others
        missing = sorted((self.dead | self.hung) - covered)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            return f"ranks {missing[:8]}{more} are not running and cannot roll back"
        return ""

    def _plan_missing(self, plan: ResumePlan, restarting: set[int]) -> str:
        """An in-memory snapshot the plan relies on that no host holds any more. Hosts keep their latest snapshot
        only and lose it when they power-cycle; a rank whose named holder lost it reads the same shard of the same
        step from another replica's host if one has it (as Gemini recovers from a peer's memory)."""
        step = plan.checkpoint_step
        if step is not None and any(s.tier is Tier.PEER for s in plan.shards):
            return self._peers_missing(plan, step, restarting)
        memory = [s for s in plan.shards if s.tier is Tier.MEMORY]
        if step is None or not memory:
            return ""
        held = {r % self.shards for r in self.reporters()
                if self.mem_step.get(self.node_of(r)) == step and not self.hw[self.node_of(r)].down}
        for source in memory:
            if source.shard not in held:
                return f"no host holds shard {source.shard} of step {step} in memory any more"
            if not any(self.mem_step.get(h) == step and not self.hw[h].down for h in source.holders):
                self._count("memory_read_from_peer")
        return ""

    def _restarting(self, command: Any) -> set[int]:
        """The command's ranks and those other restarts of its attempt brought back already."""
        earlier = self.restarted if command.attempt == self.generation else set()
        return set(self._command_ranks(command)) | earlier

    def _peers_missing(self, plan: ResumePlan, step: int, restarting: set[int]) -> str:
        """A live replica to send each shard: its process running and not restarted itself, on a healthy node, at
        the plan's step (the job halted there: a peer cannot send a step it is not at)."""
        if step != self.halted_step:
            return f"the live replicas are at step {self.halted_step}, not {step}"
        gone = self.dead | self.hung | restarting
        for source in plan.shards:
            if source.tier is not Tier.PEER:
                continue
            if not any(r not in gone and self.hw[self.node_of(r)].healthy
                       for r in range(source.shard, self.world_size, self.shards)
                       if self.node_of(r) in source.holders):
                return f"no live replica of shard {source.shard} on {source.holders} to send it"
        self._count("state_from_peers")
        return ""

    def _restarted(self, command: Any, ranks: list[int]) -> None:
        if command.attempt != self.generation:
            self.generation = command.attempt
            self.restarted = set()
        self.restarted.update(ranks)
        self.dead.difference_update(ranks)
        self.hung.difference_update(ranks)
        self.plan = command.plan
        self.retried = False
        self._epoch += 1

    def _do_stop_ranks(self, command: Any) -> str:
        self.dead.update(command.ranks)
        self.hung.difference_update(command.ranks)
        return ""

    def _do_save_checkpoint(self, command: Any) -> str:
        for rank in command.ranks:
            if rank >= self.world_size or rank in self.dead or rank in self.hung:
                return f"rank {rank} is not running: it cannot save"
            hw = self.hw[self.node_of(rank)]
            device = rank % self.rpn
            if hw.down or hw.gpu_lost == device or device in hw.bad:
                return f"rank {rank}'s {'node' if hw.down else 'device'} on {hw.name} is gone"
        shards = sorted({r % self.shards for r in command.ranks})
        self.job_event("checkpoint.saved", {"step": command.step, "tier": Tier.DYING, "holder": STORAGE_HOLDER,
                                            "shards": shards}, source="executor")
        self._ack(command, "done")
        return ""

    def _do_retry_step(self, command: Any) -> str:
        why = self._unhealthy(self.placement) or self._others_blocked(set(), self.generation)
        if why:
            return f"the step failed again: {why}"
        if command.attempt != self.generation:  # a retry is a new generation of the same processes
            self.generation = command.attempt
            self.restarted = set()
        self.retried = True
        self._epoch += 1
        return ""

    def _do_restart_ranks(self, command: Any) -> str:
        for name, devices in command.reset_devices.items():
            if name in self.hw:  # a reset clears what needs one (an XID 48); a lemon may fault again
                self.hw[name].bad.difference_update(devices)
        nodes = sorted({self.node_of(r) for r in command.ranks})
        why = (self._unhealthy(nodes) or self._others_blocked(set(command.ranks), command.attempt)
               or self._plan_missing(command.plan, self._restarting(command)))
        if why:
            return why
        self._restarted(command, list(command.ranks))
        return ""

    def _do_migrate_ranks(self, command: Any) -> str:
        if command.from_node not in self.placement:
            return f"{command.from_node} is not in the job"
        why = (self._unhealthy([command.to_node]) or self._others_blocked(set(command.ranks), command.attempt)
               or self._plan_missing(command.plan, self._restarting(command)))
        if why:
            return why
        self._place([command.to_node if n == command.from_node else n for n in self.placement])
        self._restarted(command, list(command.ranks))
        return ""

    def _do_restart_job(self, command: Any) -> str:
        why = self._unhealthy(list(command.nodes)) or self._plan_missing(command.plan, self._restarting(command))
        if why:
            return why
        self._place(list(command.nodes))
        self.dead.clear()
        self.hung.clear()
        self._restarted(command, list(range(self.world_size)))
        return ""

    def _place(self, nodes: list[str]) -> None:
        """The job now runs on `nodes`. A node it left that is healthy goes back to the spare pool once the
        scheduler has cleaned it up; a broken one when its repair is done."""
        keep = set(nodes)
        left = [n for n in self.placement if n not in keep]
        self.placement = nodes
        for name in left:
            hw = self.hw[name]
            if not hw.repairing:
                hw.repairing = True
                self.later(int(self.cfg.durations.node_return_s * NS), partial(self._repaired, name))

    def _do_scale_job(self, command: Any) -> str:
        why = self._unhealthy(list(command.nodes)) or self._plan_missing(command.plan, self._restarting(command))
        if why:
            return why
        self._place(list(command.nodes))
        self.dp = command.dp
        self.dead.clear()
        self.hung.clear()
        self._restarted(command, list(range(self.world_size)))
        return ""

    def _do_isolate_node(self, command: Any) -> str:
        hw = self.hw[command.node]
        hw.isolated = True
        self.replaced.update((command.node, device) for device in range(self.rpn))
        self._repair_later(command.node, int(self.cfg.durations.node_repair_mean_s * NS))
        return ""

    def _do_isolate_device(self, command: Any) -> str:
        hw = self.hw[command.node]
        hw.bad.add(command.device)
        self.replaced.add((command.node, command.device))
        self._repair_later(command.node, int(self.cfg.durations.device_repair_mean_s * NS))
        return ""

    def _do_fail_job(self, command: Any) -> str:
        self._stop_training()
        self.failed = True
        return ""

    # -- back to training -----------------------------------------------------------------------------
    def blocked(self) -> str:
        """Why the job cannot train now, or '' if it can."""
        if self.failed:
            return "the job failed"
        if self.dead or self.hung:
            return f"{len(self.dead)} rank(s) not running, {len(self.hung)} hung"
        return self._unhealthy(self.placement)

    def _maybe_resume(self) -> None:
        """After an executor finished: if every restart of the generation is done and the job can run, the
        ranks load their state and training resumes from the plan's step."""
        if self.training or self.loading or self.failed:
            return
        if any(gen == self.generation for gen, _ in self.inflight.values()):
            return
        if not (self.retried or (self.plan is not None and self.restarted)):
            return
        if self.blocked():
            self._arm_collective_timeout()
            return
        if self.retried:
            start, load_ns, rank = self.halted_step, 0, 0
        else:
            assert self.plan is not None
            start = self.plan.checkpoint_step or 0
            loading = self.restarted if start == self.halted_step else set(range(self.world_size))
            load_ns = int(self.load_s(self.plan, loading) * NS)
            rank = min(self.restarted)
        self.retried = False
        self.restarted = set()
        self.plan = None
        self.loading = True
        self._token += 1
        token = self._token

        def go() -> None:
            if self._token == token and not self.failed:
                self.resume_step = self.reported_step = start
                self._train(self.sched.now, start, report_rank=rank)
        self.later(load_ns, go)

    def load_s(self, plan: ResumePlan, ranks: set[int]) -> float:
        """Time for `ranks` to load their shard of the plan: all at once, the slowest tier decides."""
        if plan.checkpoint_step is None or not plan.shards:
            return 0.0
        tier_of = [source.tier for source in plan.shards]
        by_tier: dict[Tier, int] = {}
        for rank in ranks:
            tier = tier_of[rank % len(tier_of)]
            by_tier[tier] = by_tier.get(tier, 0) + 1
        costs = self.cfg.costs
        return max((costs.load_s(tier, n, self.shard_bytes) for tier, n in by_tier.items()), default=0.0)

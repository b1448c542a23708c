"""The simulated job's state: its hardware, its placement and its training, in closed form, and how it resumes.

Training between faults is closed form: the job's step at time t is `anchor_step + (t - anchor_t) // step`,
and nothing is emitted while it trains, except a persistent checkpoint at each save. What the engine needs to
know at a fault (how far every shard's replicas got, which in-memory snapshot the hosts hold) is reported when
it matters, just before the fault's own events: the per-step reports of a real job collapse into their last
one, because the engine keeps only the newest step of every rank and the newest snapshot per holder.

`recovery.sim.world.World` is this state with its fault injection (`injection.py`) and its executors
(`executors.py`).
"""


import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from events import subjects
from events.envelope import EnvelopeBase, make_envelope
from events.values import MAX_WATCHDOG_S, STORAGE_HOLDER, Elastic, JobSpec, Layout, ResumePlan, Tier
from recovery.sim.config import NS, SimConfig
from recovery.sim.faults import node_name

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
    slowdown: float = 1.0
    """a straggler: it computes each step this many times slower, and the synchronous job waits for it"""
    slow_since: int = 0
    """which straggler fault set `slowdown` (its end applies only if no later one replaced it)"""
    slow_devices: dict[int, float] = field(default_factory=dict)
    """a recorded straggler's devices, each with how many times its peers' compute time its rank reported (the job's
    pace, `slowdown`, was measured apart); empty: every device computes at `slowdown`"""

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
    straggler: int = 0
    """what a straggler in the placement added to the steps: the job's pace is its slowest node's"""


class TrainingState:
    """The job and its hardware as the world sees them (the engine only sees the events)."""

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
        self.compute_ns = self.step_ns if tr.compute_s is None else int(tr.compute_s * NS)
        """what the ranks report as a step's compute time at the nominal pace"""
        self.reports_steps = tr.reports_steps
        self.memory_k = tr.memory_every_steps if config.profile.memory_tier else None
        mem_stall = int(config.costs.memory_save_stall_s * NS) // self.memory_k if self.memory_k else 0
        self.base_eff = self.step_ns + mem_stall
        """a step at the job's nominal pace (with its share of the snapshot stall)"""
        self.step_eff = self.base_eff
        """a step at the pace of the current stretch of training: slower while a straggler is in the placement"""
        self.storage_every = int(tr.storage_every_s * NS) if tr.storage_every_s else None
        self.save_due: int | None = None
        """when the stretch of training under way reaches its next persistent checkpoint"""
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
        self.watched_step = 0
        """the step of the last reports before a watchdog tick (watch mode): the next ones' compute times cover the
        steps since"""
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
        self.newest_sent = 0
        """the newest generation a command sent to the executors starts (a restart's or a retry's attempt)"""
        self.failing_generations: set[int] = set()
        """generations whose retried step fails again (a recorded night's collective failures): no retry of theirs
        resumes training"""
        self.issued: dict[str, int] = {}
        """commands sent so far, by `recovery.sim.answers.answer_kind`: which recorded answer is whose"""
        self.answers = {(a.kind, a.nth): a for a in config.answers}
        """the recorded answers by (kind, order); a command the recorded night has none for takes the cost model's"""
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
                       policies=self.cfg.profile.selection, spare_pool=self.cfg.spare_pool,
                       elastic=None if self.cfg.elastic is None else Elastic(min_dp=self.cfg.elastic[0],
                                                                             max_dp=self.cfg.elastic[1]),
                       watchdog_interval_s=self.cfg.watchdog_interval_s or self.cfg.watch_s or min(
                           max(10 * self.cfg.days * 86_400.0, 1e6), MAX_WATCHDOG_S))

    # -- start and end --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nodes join, the job is submitted and starts from a persistent checkpoint at step 0."""
        for name in self.placement:
            self.node_event(name, "node.joined", {"spare": False, "devices": self.rpn}, source="scheduler")
        for name in self.initial_spares:
            if name in self.cfg.joining:  # it joins later, when its `join` fault comes
                continue
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
        if not self.failed and self.reports_steps:
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
        slowest = max((self.hw[n].slowdown for n in self.placement), default=1.0)
        self.step_eff = self.base_eff + int(self.step_ns * slowest) - self.step_ns
        self.anchor_t, self.anchor_step = t, from_step
        token = self._token
        if report_rank is not None and self.reports_steps:
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
            self.save_due = t + steps * self.step_eff
            self.sched.at(self.save_due, lambda: self._storage_save(token))

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
        c.checkpoint += n * (self.base_eff - self.step_ns)
        c.straggler += n * (self.step_eff - self.base_eff)
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
        costs = self.cfg.costs
        measured = costs.storage_saved_s
        after = (max(stall, int(measured * NS)) if measured is not None
                 else stall + int(costs.save_s(self.shards, self.shard_bytes) * NS))

        def saved() -> None:
            if not self.failed:
                self.job_event("checkpoint.saved", {"step": step, "tier": Tier.STORAGE, "holder": STORAGE_HOLDER,
                                                    "shards": list(range(self.shards))}, source="checkpointer")
        # taken before the save is announced: a decision it brings at once (a drain due at this checkpoint) may stop
        # the ranks, and the stall's end must not then resume them
        token2 = self._token
        if after == 0:
            saved()  # saved at its step (as a recorded night can show it): before anything else at this instant
        else:
            self.later(after, saved)

        def resume() -> None:
            if self._token == token2 and not self.failed:
                self._train(self.sched.now, step)
        self.later(stall, resume)

    def _catch_up(self, step: int) -> None:
        """Before a fault's events: what the job's ranks and hosts reported since the last fault, collapsed into
        the last report (the engine keeps only the newest step per rank and the newest snapshot per holder)."""
        reporters = [r for r in self.reporters() if r not in self.dead and r not in self.hung
                     and not self.hw[self.node_of(r)].down]
        if step > self.reported_step and self.reports_steps:
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

    def retime(self) -> None:
        """A node of the placement changed its pace (a straggler began or ended): from the next step boundary the
        job trains at its slowest node's pace. Nothing is lost: the stretch so far is booked at the old pace."""
        if not self.training:
            return  # the next stretch of training takes the pace when it starts
        token = self._token
        n = max(0, self.sched.now - self.anchor_t) // self.step_eff
        boundary = self.anchor_t + (n + 1) * self.step_eff

        def at_boundary() -> None:
            if self._token == token and self.training:
                self._halt(boundary)
                self._train(boundary, self.halted_step)
        self.sched.at(boundary, at_boundary)

    def report_progress(self) -> None:
        """Watch mode, just before a watchdog tick: each node's agent reports its live ranks' step (while the job
        trains, or is stopped where a fault left it) and the mean compute time of the steps since the last tick
        (the node's pace: a straggler's ranks stand out), one `progress.report` per node."""
        if self.failed or not self.reports_steps:
            return
        if self.training:
            step: int | None = self.step_now()
        elif self.stalled or not (self.loading or self.plan is not None or self.restarted or self.retried):
            step = self.halted_step  # at a checkpoint's stall, or halted by a fault no restart has answered yet
        else:
            step = None  # restarting or loading: the ranks' step is the resume point's, not yet reached
        count = 0
        if step is not None:
            count = max(0, step - self.watched_step)
            self.watched_step = step
        for node in self.placement:
            hw = self.hw[node]
            if hw.down:
                continue
            compute_s = self.compute_ns * (1.0 if hw.slow_devices else hw.slowdown) / NS
            entries: list[dict[str, Any]] = []
            for rank in self.ranks_on(node):
                if rank in self.dead or rank in self.hung:
                    continue
                entry: dict[str, Any] = {"rank": rank, "step": step, "attempt": self.generation}
                if count:
                    slow = hw.slow_devices.get(rank % self.rpn) if hw.slow_devices else None
                    entry["compute_s"] = compute_s if slow is None else self.compute_ns * slow / NS
                    entry["compute_steps"] = count
                entries.append(entry)
            if entries:
                self.job_event("progress.report", {"ranks": entries}, source=f"agent@{node}")
        if step is not None:
            self.reported_step = max(self.reported_step, step)

    def _stop_training(self) -> None:
        """Training stops now (a fault, or processes being stopped): book it and tell the engine how far it got."""
        if self.training and self.save_due == self.sched.now:
            # A stop at the very instant a persistent checkpoint is due comes after it: the step that ends now is
            # complete, and its checkpoint staged (a recorded log has them in that order; faults are scheduled before
            # the run, so at one instant they would otherwise go first).
            self._storage_save(self._token)
        if self.training:
            step = self.step_now()
            self._halt(self.sched.now)
            self._catch_up(step)
        elif self.loading or self.stalled:
            if self.stalled:  # halted at a checkpoint's step: the ranks got there, and the engine must hear so
                self._catch_up(self.halted_step)
            self.loading = self.stalled = False
            self._token += 1

    # -- repairs --------------------------------------------------------------------------------------
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
        hw.slowdown = 1.0  # a drained straggler was looked at before it rejoined
        hw.slow_devices.clear()
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

    # -- health -------------------------------------------------------------------------------------
    def _unhealthy(self, nodes: list[str]) -> str:
        for name in nodes:
            hw = self.hw[name]
            if not hw.healthy:
                what = ("host down" if hw.down else "GPU off the bus" if hw.gpu_lost is not None else
                        f"devices {sorted(hw.bad)} need a reset" if hw.bad else f"{LINK} down" if hw.link_down
                        else "isolated" if hw.isolated else "not ready")
                return f"node {name}: {what}"
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
        if self.retried and self.generation in self.failing_generations:
            self.retried = False  # the retried step's collective times out again: its ranks say so
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

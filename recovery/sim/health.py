"""Latent bad hardware, and the node agents' health checks that look for it (`node.checked`, `events.health`).

A latent bad device reports nothing while its node is idle and faults once ranks run on it: after a time uniform in
`Durations.latent_work_s` of the job's training on the node, with an XID 79 or 48. It comes from a repair that did not
hold (a share `Cluster.latent_after_repair` of repaired nodes) or with a spare (`Cluster.latent_spares` of the initial
spares). Without checks a recovery that lands on such a node is followed by a second fault minutes later.

With `Agents.health_checks` the checks run as the node agent runs them (`recovery.agent.checks.runner`): when a node
joins (it says `checks: true`; `node.checked` `join` comes `Costs.check_s` later), and again at once when its probes
report a device or network fault on it (`fault`; a fault during a run queues one more after it), in the background,
while the engine detects, plans, stops the survivors and resets a device. A restart's gate before ranks start waits
only for what is left of a run under way on its nodes, and the executor refuses the command when that run fails
("health checks failed on <node>"). A node with no fault since its last pass starts ranks at once: a software fault's
restart waits for nothing. An idle spare runs its checks again every `Agents.check_fresh_s / 2`, so a grant finds its
pass fresh and waits for nothing either; only a refresh that fails is logged (`spare`). A node whose checks failed is
out of service (the engine's `check_failed`) until it is repaired, and joins again afterwards.

Common random numbers: whether a spare or a repaired node is latent, its device, its XID, its time to fault and its
repair are drawn from a stream of their own per node and per episode (the initial join, the n-th repair), and whether
each run of the checks finds it from another (per node, episode and run); neither touches the fault or executor
streams. A run with checks and one without therefore see the same faults, and the same latent devices on the same
nodes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from recovery.sim.config import NS, SimConfig
from recovery.sim.faults import Fault
from recovery.sim.training import Scheduler, Sink, TrainingState

LATENT_XIDS = ("79", "48")
"""what a latent bad device raises under load, drawn evenly: off the bus (a power cycle) or a double-bit ECC error"""
LATENT_INDEX = 1_000_000
"""latent devices' faults are numbered from here (`FaultOutcome.index`), apart from the run's drawn faults"""
FAULTS = ("device.fault", "network.link_down", "network.nic_errors")
"""the node events after which a node's agent runs its checks again at once (`recovery.agent.checks.runner`)"""
WEAR_XIDS = ("92",)
"""device faults that are wear signals, not faults: no new run of the checks"""
CHECK = "gpu-compute"
"""the check that finds a latent device: a short load on every GPU (the node agent's built-in check)"""


@dataclass(slots=True)
class Latent:
    """A bad device on a node that nothing has reported yet."""

    device: int
    xid: str
    work_ns: int
    """the job's training on the node left before the device faults"""
    repair_ns: int
    """how long its repair takes once it is found (by its fault or by a check)"""
    source: str
    """`repair` (a repair that did not hold) or `spare`"""
    episode: int
    """which of its node's joins brought it (0: the first, n: after the n-th repair): the key of its draws"""
    checks: int = 0
    """checks run on it so far: each draws from the checks' stream under its own number"""


@dataclass(slots=True)
class CheckRun:
    """One run of a node's checks: why it ran (`join`, `fault`, `refresh`: an idle spare's in the background), when,
    what it finds, and in which of its agent's lives."""

    when: str
    start_ns: int
    end_ns: int
    found: bool
    life: int


class NodeHealth(TrainingState):
    """The nodes' latent bad devices and their agents' health checks."""

    def __init__(self, config: SimConfig, scheduler: Scheduler, sink: Sink, *, start_ns: int) -> None:
        super().__init__(config, scheduler, sink, start_ns=start_ns)
        self.checks = config.agents.health_checks
        self.check_ns = int(config.costs.check_s * NS)
        self.refresh_ns = int(config.agents.check_fresh_s / 2 * NS)
        self.latent: dict[str, Latent] = {}
        self.failed_checks: set[str] = set()
        """nodes whose last checks failed: out of service until they join again, repaired"""
        self._life: dict[str, int] = {}
        """per node: its agent's joins so far (a run of an earlier life says nothing of the node now)"""
        self._runs: dict[str, CheckRun] = {}
        """per node: the last run of its checks, under way, queued or done"""
        self._idle: set[str] = set()
        """spares in the pool, not granted since they joined: their agents keep their checks fresh"""
        self._episodes: dict[str, int] = {}
        """per node: its repairs so far, which key its latent draws (0: its first join)"""
        self._latent_faults = 0
        self._starting = False
        self._added: dict[str, int] = {}
        """what the checks added to the recovery under way, per attempt (its commands' gates wait in parallel)"""
        self.landed = False
        """a restart of the recovery under way put ranks on a node with a latent bad device"""
        self.strike: Callable[[Fault], object] = lambda fault: None
        """how a latent device's fault enters the world: the world injects it, the simulator also counts it"""
        share = config.cluster.latent_spares
        if share > 0:
            for name in self.initial_spares:
                self._maybe_latent(name, share, "spare")

    # -- latent devices -------------------------------------------------------------------------------
    def _maybe_latent(self, node: str, share: float, source: str) -> None:
        """Draw whether `node` comes (back) with a latent bad device, from its own stream for this episode; every
        draw is made whatever the outcome, so the episodes after it are the same in every run."""
        episode = self._episodes.get(node, 0)
        seed = self.cfg.seed
        rng = random.Random(f"recovery-sim/latent/{seed}/{node}/{episode}")
        u, device, xid = rng.random(), rng.randrange(self.rpn), LATENT_XIDS[rng.randrange(len(LATENT_XIDS))]
        low, high = self.cfg.durations.latent_work_s
        work = low + (high - low) * rng.random()
        repair = -self.cfg.durations.device_repair_mean_s * math.log(1.0 - rng.random())
        if u < share:
            self.latent[node] = Latent(device, xid, int(work * NS), max(NS, int(repair * NS)), source, episode)
            self._count(f"latent:{source}")

    def _train(self, t: int, from_step: int, report_rank: int | None = None) -> None:
        super()._train(t, from_step, report_rank)
        if self.latent:  # each latent device in the placement faults once the job has trained on it long enough
            token, on = self._token, set(self.placement)
            for name, latent in self.latent.items():
                if name in on:
                    self.sched.at(t + latent.work_ns, partial(self._latent_fault, name, token))

    def _halt(self, t: int, final: bool = False) -> None:
        if self.training and self.latent:  # the stretch of training counts towards each latent device's fault
            worked, on = max(0, t - self.anchor_t), set(self.placement)
            for name, latent in self.latent.items():
                if name in on:
                    latent.work_ns = max(0, latent.work_ns - worked)
        super()._halt(t, final)

    def _latent_fault(self, node: str, token: int) -> None:
        if token != self._token or not self.training or self.failed or node not in self.placement:
            return  # training stopped first: the stretch was booked, the next one arms it again
        latent = self.latent.pop(node, None)
        if latent is None:
            return
        self._latent_faults += 1
        self._count("latent_faults")
        self.strike(Fault(index=LATENT_INDEX + self._latent_faults, at_ns=self.sched.now - self.start_ns,
                          component=f"latent bad device ({latent.source})", signal="device", scope="device",
                          position=self.placement.index(node), device=latent.device, code=latent.xid,
                          repair_ns=latent.repair_ns, node=node))

    def _repaired(self, node: str) -> None:
        hw = self.hw[node]
        broken = hw.down or hw.gpu_lost is not None or bool(hw.bad) or hw.isolated
        if broken:  # a repair (not a healthy node back from a job): what was latent is replaced; it may not hold
            self.latent.pop(node, None)
            self._episodes[node] = self._episodes.get(node, 0) + 1
            share = self.cfg.cluster.latent_after_repair
            if share > 0:
                self._maybe_latent(node, share, "repair")
        super()._repaired(node)

    # -- the agents' checks ---------------------------------------------------------------------------
    def start(self) -> None:
        self._starting = True  # the nodes there at the start checked before the job's submission
        super().start()
        self._starting = False

    def node_event(self, node: str, type_: str, data: dict[str, Any], source: str | None = None) -> None:
        """Every node event passes here: a node that joins announces its checks and runs them, a device or network
        fault its agent's probes report makes it run them again at once."""
        if self.checks and self.sched.now >= self.start_ns:  # not the cluster's recorded history
            if type_ == "node.joined":
                super().node_event(node, type_, {**data, "checks": True}, source)
                self._joined(node, spare=node not in self.placement)
                return
            super().node_event(node, type_, data, source)
            if type_ in FAULTS and not (type_ == "device.fault" and str(data.get("code")) in WEAR_XIDS):
                self._fault_run(node)
            return
        super().node_event(node, type_, data, source)

    def _joined(self, node: str, *, spare: bool) -> None:
        """A node's agent starts (a new life: what an earlier one ran says nothing now) and runs its `join` checks;
        an idle spare then keeps them fresh in the background."""
        self._life[node] = life = self._life.get(node, 0) + 1
        self.failed_checks.discard(node)
        if spare:
            self._idle.add(node)
        if self._starting:  # checked before the job's submission: logged at once
            self._runs[node] = run = CheckRun("join", self.sched.now, self.sched.now, self.check_finds(node), life)
            self._run_done(node, run)
            return
        self._run(node, "join", self.sched.now)

    def _fault_run(self, node: str) -> None:
        """The node's probes reported a fault: its agent runs the checks again at once, or, while a run is under
        way, once more after it (faults during that wait join the queued run)."""
        if node in self.failed_checks:
            return  # cordoned for repair: its agent checks it again when it joins, repaired
        now, last = self.sched.now, self._runs.get(node)
        if last is not None and last.life == self._life.get(node, 0) and last.end_ns > now:
            if last.start_ns > now:
                return  # a run is already queued after the current one: it sees this fault too
            self._run(node, "fault", last.end_ns)
        else:
            self._run(node, "fault", now)

    def _run(self, node: str, when: str, start_ns: int) -> None:
        """A run of the node's checks from `start_ns`, `Costs.check_s` long; what it finds is drawn now (its own
        number in the checks' stream) and logged at its end."""
        run = CheckRun(when, start_ns, start_ns + self.check_ns, self.check_finds(node), self._life.get(node, 0))
        self._runs[node] = run
        self.sched.at(run.end_ns, partial(self._run_done, node, run))

    def _run_done(self, node: str, run: CheckRun) -> None:
        if self.failed or self.hw[node].down or run.life != self._life.get(node, 0) or node in self.failed_checks:
            return  # the agent died with its host, the node joined again since, or it is cordoned for repair
        if run.when != "refresh" or (run.found and node in self._idle):  # a passing refresh logs nothing
            self.checked(node, "spare" if run.when == "refresh" else run.when, run.found)
        if node in self._idle and node in self.latent and not run.found:
            # a latent bad spare the checks missed: its agent checks it again while it is idle (a spare without
            # one passes every refresh, which logs nothing)
            self.sched.at(run.start_ns + self.refresh_ns, partial(self._refresh, node, run.life))

    def _refresh(self, node: str, life: int) -> None:
        if life == self._life.get(node, 0) and node in self._idle and not self.failed:
            self._run(node, "refresh", self.sched.now)

    def check_finds(self, node: str) -> bool:
        """Whether this run of the node's checks finds its latent bad device, if it has one: each run finds it with
        probability `Agents.check_detects`, from the checks' own stream (per node, device and run), so that the
        faults and the latent devices are the same with checks and without."""
        latent = self.latent.get(node)
        if latent is None:
            return False
        latent.checks += 1
        rng = random.Random(f"recovery-sim/checks/{self.cfg.seed}/{node}/{latent.episode}/{latent.checks}")
        return rng.random() < self.cfg.agents.check_detects

    def checked(self, node: str, when: str, found: bool) -> None:
        """The node's agent ran its checks: logged, and a node they found bad is out of service until repaired."""
        latent = self.latent.get(node)
        found = found and latent is not None
        result: dict[str, Any] = {"check": CHECK, "ok": not found, "took_s": self.cfg.costs.check_s,
                                  "saw": f"device {latent.device} failed under load" if latent is not None and found
                                  else f"{self.rpn} devices passed"}
        self.node_event(node, "node.checked", {"when": when, "job": "", "results": [result]}, source=f"agent@{node}")
        self._count(f"checks:{when}:{'failed' if found else 'ok'}")
        if latent is not None and found:
            self.failed_checks.add(node)
            self._idle.discard(node)
            self.hw[node].isolated = True  # cordoned for repair: it joins again once repaired (`_repaired`)
            self._repair_later(node, latent.repair_ns)

    # -- the gate before ranks start --------------------------------------------------------------------
    def restart_nodes(self, command: Any) -> list[str]:
        """The nodes a restart starts ranks on."""
        kind = command.kind
        if kind == "migrate_ranks":
            return [command.to_node]
        if kind == "restart_ranks":
            return sorted({self.node_of(r) for r in command.ranks if r < self.world_size})
        if kind in ("restart_job", "scale_job"):
            return list(command.nodes)
        return []

    def gate(self, command: Any, at_ns: int) -> tuple[int, str | None]:
        """The agents' gate before a restart's ranks start, reached at `at_ns`: how long it waits (for what is left of
        a run of the checks under way on one of its nodes: after a fault there, or its join), and the node whose
        run failed, if one did (the command is refused). A node with no fault since its last pass, a spare kept fresh,
        passes at once. What it waits is booked as what the checks added to the recovery."""
        wait, refused = 0, None
        for node in self.restart_nodes(command):
            self._idle.discard(node)  # granted: its agent stops refreshing, its last pass answers for it
            if node in self.failed_checks:
                refused = refused or node
                continue
            run = self._runs.get(node)
            if (run is None or run.when == "refresh" or run.life != self._life.get(node, 0)
                    or run.end_ns <= self.sched.now):
                continue  # nothing under way that the gate waits for: a refresh under way leaves the last pass fresh
            wait = max(wait, run.end_ns - at_ns)
            if run.found:
                refused = refused or node
        key = f"attempt:{command.attempt}"
        self._added[key] = max(self._added.get(key, 0), wait)
        return wait, refused

    def note_landed(self, command: Any) -> None:
        """A restart was carried out: did it put ranks on a node with a latent bad device?"""
        if self.latent and any(node in self.latent for node in self.restart_nodes(command)):
            self.landed = True
            self._count("landed_on_bad")

    def recovered(self) -> tuple[bool, int]:
        """The recovery under way closed: whether it landed on a bad node, and what the checks added to it (ns)."""
        landed, added = self.landed, sum(self._added.values())
        self.landed, self._added = False, {}
        return landed, added

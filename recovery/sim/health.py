"""Latent bad hardware, and the node agents' health checks that look for it (`node.checked`, `events.health`).

A latent bad device reports nothing while its node is idle and faults once ranks run on it: after a time uniform in
`Durations.latent_work_s` of the job's training on the node, with an XID 79 or 48. It comes from a repair that did not
hold (a share `Cluster.latent_after_repair` of repaired nodes) or with a spare (`Cluster.latent_spares` of the initial
spares). Without checks a recovery that lands on such a node is followed by a second fault minutes later.

With `Agents.health_checks` every node's agent says `checks: true` when it joins and logs `node.checked` (`join`)
`Costs.check_s` later; before a restart's ranks start on a node it checks again (`spare` on a node the job takes from
the pool, `fault` after a device or network fault on the node, `start` otherwise), and the executor waits for the
checks and refuses the command when one fails ("health checks failed on <node>"). The checks start when the attempt's
stop is sent (the agents hear of the recovery then), so a restart waits only for what is left of them. A node whose
checks failed is out of service until it is repaired, and joins again afterwards.

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


class NodeHealth(TrainingState):
    """The nodes' latent bad devices and their agents' health checks."""

    def __init__(self, config: SimConfig, scheduler: Scheduler, sink: Sink, *, start_ns: int) -> None:
        super().__init__(config, scheduler, sink, start_ns=start_ns)
        self.checks = config.agents.health_checks
        self.check_ns = int(config.costs.check_s * NS)
        self.latent: dict[str, Latent] = {}
        self.faulted: set[str] = set()
        """nodes with a device or network fault since their last checks: their next checks are `fault` ones"""
        self._episodes: dict[str, int] = {}
        """per node: its repairs so far, which key its latent draws (0: its first join)"""
        self._latent_faults = 0
        self._starting = False
        self._stop_at: int | None = None
        """when the last stop was sent, if no restart has been sent since: the next restarts' checks ran from then"""
        self._restarts_at: tuple[int, int | None] = (-1, None)
        """when the last restarts were sent (an attempt's go out at one instant), and the stop that came before them"""
        self._added: dict[str, int] = {}
        """what the checks added to the recovery under way, per attempt (its commands' checks run in parallel) and per
        node the job waited for while it checked after joining"""
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
        fault makes its node's next checks `fault` ones."""
        if self.checks and self.sched.now >= self.start_ns:  # not the cluster's recorded history
            if type_ == "node.joined":
                super().node_event(node, type_, {**data, "checks": True}, source)
                if self._starting:
                    self._join_checked(node)
                else:
                    self.later(self.check_ns, partial(self._join_checked, node))
                return
            if type_ in ("device.fault", "network.link_down"):
                self.faulted.add(node)
        super().node_event(node, type_, data, source)

    def _join_checked(self, node: str) -> None:
        if self.failed or self.hw[node].down:
            return  # the agent died with its host before it reported
        if node in self.placement and not (self.training or self._starting):
            self._added[f"join:{node}"] = self.check_ns  # the job waits for this node's checks
        self.checked(node, "join", self.check_finds(node))

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

    def checked(self, node: str, when: str, found: bool, job: str = "") -> None:
        """The node's agent ran its checks: logged, and a node they found bad is out of service until repaired."""
        latent = self.latent.get(node)
        found = found and latent is not None
        self.faulted.discard(node)
        result: dict[str, Any] = {"check": CHECK, "ok": not found, "took_s": self.cfg.costs.check_s,
                                  "saw": f"device {latent.device} failed under load" if latent is not None and found
                                  else f"{self.rpn} devices passed"}
        self.node_event(node, "node.checked", {"when": when, "job": job, "results": [result]}, source=f"agent@{node}")
        self._count(f"checks:{when}:{'failed' if found else 'ok'}")
        if latent is not None and found:
            self.hw[node].isolated = True  # cordoned for repair: it joins again once repaired (`_repaired`)
            self._repair_later(node, latent.repair_ns)

    def check_targets(self, command: Any) -> list[tuple[str, str]]:
        """The nodes a restart starts ranks on, each with why its agent checks it (`spare`, `fault`, `start`)."""
        kind = command.kind
        if kind == "migrate_ranks":
            return [(command.to_node, "spare")]
        if kind == "restart_ranks":
            nodes = sorted({self.node_of(r) for r in command.ranks if r < self.world_size})
        elif kind in ("restart_job", "scale_job"):
            nodes = list(command.nodes)
        else:
            return []
        on = set(self.placement)
        return [(n, "spare" if n not in on else "fault" if n in self.faulted else "start") for n in nodes]

    def check_delay(self, command: Any) -> int:
        """How long a restart waits for its nodes' checks: they started when its attempt's stop was sent, if it sent
        one; booked as what the checks added to the recovery."""
        now = self.sched.now
        if self._restarts_at[0] != now:  # an attempt's restarts: its stop, if it sent one, is the one just before
            self._restarts_at, self._stop_at = (now, self._stop_at), None
        began = self._restarts_at[1]
        delay = max(0, self.check_ns - (now - began if began is not None else 0))
        key = f"attempt:{command.attempt}"
        self._added[key] = max(self._added.get(key, 0), delay)
        return delay

    def stop_sent(self) -> None:
        """A stop was sent: the agents hear of the recovery, and start the checks of the restart that follows."""
        self._stop_at = self.sched.now

    def note_landed(self, command: Any) -> None:
        """A restart was carried out: did it put ranks on a node with a latent bad device?"""
        if self.latent and any(node in self.latent for node, _ in self.check_targets(command)):
            self.landed = True
            self._count("landed_on_bad")

    def recovered(self) -> tuple[bool, int]:
        """The recovery under way closed: whether it landed on a bad node, and what the checks added to it (ns)."""
        landed, added = self.landed, sum(self._added.values())
        self.landed, self._added = False, {}
        return landed, added

"""A small simulated cluster for watching the daemon recover it in real time.

    events, execute = demo_cluster()             # or DemoCluster(): .events(), .execute
    for delay_s, subject, envelope in events:
        await asyncio.sleep(delay_s)
        await log.append(subject, envelope)       # or publish to JetStream
    ...
    execute(command)                              # for every command the daemon sends

`events()` yields the cluster's events in time order, each with the delay since the previous one: nodes
joining, the job's submission and start, every live rank's step (or heartbeat, when the job is stopped) each
second, persistent checkpoints, the scripted faults and what they emit (XIDs, process exits, hang reports, link
downs, node conditions), and the executors' answers. The generator computes the next event when asked, so it is
never more than a second ahead of the events a daemon has published; a command executed meanwhile is answered
from the time of the last event. `execute(command)`
is the executor callback: it carries the command out on the simulated cluster after the cost model's duration,
and its acks (`accepted`, then `done` or `failed`, with `checkpoint.saved` before the ack of a dying checkpoint,
and the restarted ranks' first step after a restore) come out of `events()` at their time.

There is no engine here: the daemon under test is the engine. The world is the same as the simulator's
(`recovery.sim.world.World`), on a small cluster with short costs so a recovery takes seconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from events.commands import CommandBase
from events.envelope import EnvelopeBase
from recovery.log import EPOCH
from recovery.sim.config import NS, Agents, Cluster, Costs, Durations, Profile, SimConfig, Training, profile
from recovery.sim.faults import Fault
from recovery.sim.world import World

DEMO_COSTS = Costs(stop_kill_s=0.5, stop_graceful_s=1.0, retry_step_s=1.0, restart_in_place_s=3.0, migrate_s=5.0,
                   restart_job_small_s=8.0, restart_job_large_s=8.0, memory_latency_s=0.5, storage_latency_s=1.0,
                   storage_rank_Bps=1e12, memory_rank_Bps=1e12, fail_probability=0.0, timeout_probability=0.0)
"""Short costs: a demo recovery takes seconds, not minutes."""

DEMO_AGENTS = Agents(hang_detect_s=3.0, collective_timeout_s=60.0, node_not_ready_s=5.0, link_health_check_s=10.0)

DEMO_FAULTS: tuple[Fault, ...] = (
    Fault(0, 15 * NS, "Faulty GPU", "device", "device", position=1, device=1, code="79", repair_ns=40 * NS),
    Fault(1, 45 * NS, "Software Bug", "process", "rank", position=0, device=0, exit_code=None, exit_signal=11),
    Fault(2, 75 * NS, "NCCL Watchdog Timeouts", "hang", "job", position=2, device=0),
    Fault(3, 105 * NS, "Host Maintenance", "node", "node", position=3, device=0, repair_ns=60 * NS),
)
"""A GPU falls off the bus (pod-level move to a spare), a process crashes (restart in place), a rank hangs
(the agent's watchdog reports it), a host goes down (not ready, then moved)."""


class DemoCluster:
    """A 4-node job (2 GPUs each, tp=2, dp=4) with one spare node and a scripted fault every 30 s."""

    def __init__(self, *, nodes: int = 4, gpus_per_node: int = 2, tp: int = 2, spares: int = 1, seed: int = 0,
                 faults: tuple[Fault, ...] | list[Fault] = DEMO_FAULTS, step_time_s: float = 1.0,
                 seconds: float = 180.0, policies: str | Profile = "default", job: str = "demo",
                 costs: Costs = DEMO_COSTS, agents: Agents = DEMO_AGENTS) -> None:
        cluster = Cluster(gpus=nodes * gpus_per_node, gpus_per_node=gpus_per_node, tp=tp, pp=1,
                          nodes_per_switch=nodes + spares, spare_nodes=spares)
        training = Training(step_time_s=step_time_s, memory_every_steps=5, storage_every_s=20.0, params=1e9)
        self.config = SimConfig(cluster=cluster, training=training, costs=costs, agents=agents,
                                durations=Durations(node_return_s=5.0), profile=profile(policies),
                                days=seconds / 86_400, seed=seed, job=job, report_every_s=1.0,
                                watchdog_interval_s=2.0)
        self._now = EPOCH
        self._last = EPOCH
        self._seq = 0
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._out: deque[tuple[int, str, EnvelopeBase]] = deque()
        self.end = EPOCH + int(seconds * NS)
        self.world = World(self.config, self, self._emit, start_ns=EPOCH)
        self._started = False
        for fault in faults:
            self.at(EPOCH + fault.at_ns, partial(self._inject, fault))

    def _inject(self, fault: Fault) -> None:
        self.world.inject(fault)

    # -- the scheduler the world runs on ---------------------------------------------------------------
    @property
    def now(self) -> int:
        return self._now

    def at(self, when: int, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self._now), self._seq, action))

    def _emit(self, subject: str, envelope: EnvelopeBase) -> None:
        self._out.append((self._now, subject, envelope))

    # -- the two halves of the demo -------------------------------------------------------------------
    def events(self) -> Iterator[tuple[float, str, EnvelopeBase]]:
        """(delay_s since the previous event, subject, envelope), in time order, until `seconds` have passed."""
        if not self._started:
            self._started = True
            self.world.start()
        while True:
            if self._out:
                ts, subject, envelope = self._out.popleft()
                delay = max(0, ts - self._last) / NS
                self._last = max(self._last, ts)
                yield delay, subject, envelope
                continue
            if not self._heap or self._heap[0][0] > self.end:
                return
            when, _, action = heapq.heappop(self._heap)
            self._now = max(self._now, when)
            action()

    def execute(self, command: CommandBase) -> None:
        """The executor callback: carry `command` out on the cluster; its acks come out of `events()`."""
        if getattr(command, "kind", "") != "dump_stacks":  # simulated processes have no stacks to take
            self.world.execute(command)


def demo_cluster(**options: Any) -> tuple[Iterator[tuple[float, str, EnvelopeBase]], Callable[[CommandBase], None]]:
    """The demo as a pair: the generator of `(delay_s, subject, envelope)` in real-time order, and the executor
    callback that turns the daemon's commands into acks (which the generator then yields). Options are
    `DemoCluster`'s."""
    demo = DemoCluster(**options)
    return demo.events(), demo.execute


__all__ = ["DEMO_FAULTS", "DemoCluster", "demo_cluster"]

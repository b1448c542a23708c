"""A job as one node's agent knows it: its spec, its placement, its processes here, its job store (the long-lived
rendezvous store, `recovery.agent.rendezvous`) and the torch store of each formation of its ranks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from events.values import JobSpec, Layout
from recovery.agent import ranks
from recovery.agent.channel import ProcessChannel
from recovery.agent.rendezvous import REQUESTS, SERVED, torch_store_key
from recovery.agent.tcpstore import StoreError, TorchStore

logger = logging.getLogger("recovery.agent")

DEFAULT_STORE_PORT = 29500  # torchrun's MASTER_PORT
CONNECT_RETRY_S = 0.1
"""how often the job store is tried again while its process starts (an agent's own, which imports torch)"""


@dataclass
class JobOnNode:
    """What the agent knows of a job: its spec, its current placement and its processes here."""

    id: str
    spec: JobSpec
    nodes: list[str]
    layout: Layout
    store_addr: str  # the job store, where the SDK's generations live: the entrypoint's MASTER_ADDR/MASTER_PORT
    store_port: int
    channel: ProcessChannel
    processes: dict[int, ranks.RankProcess] = field(default_factory=dict)
    saves: dict[str, anyio.Event] = field(default_factory=dict)  # save request id -> answered
    save_failures: dict[str, str] = field(default_factory=dict)  # save request id -> the SDK's reason
    finished: bool = False
    caught_up: anyio.Event = field(default_factory=anyio.Event)  # with the commands missed before this agent ran
    torch_ports: dict[int, int | None] = field(default_factory=dict)  # generation -> its torch store's port
    torch_lock: anyio.Lock = field(default_factory=anyio.Lock)
    serving: anyio.CancelScope = field(default_factory=anyio.CancelScope)  # cancelled: its socket is closed
    stepped: anyio.Event = field(default_factory=anyio.Event)  # a rank here reported a step: its start-up is over

    async def serve_channel(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the job's socket until `serving` is cancelled (a job the daemon rejected is forgotten)."""
        with self.serving:
            await self.channel.serve(task_status=task_status)

    @property
    def rpn(self) -> int:
        return self.spec.ranks_per_node

    def ranks_on(self, node: str) -> list[int]:
        if node not in self.nodes:
            return []
        index = self.nodes.index(node)
        return [r for r in range(index * self.rpn, (index + 1) * self.rpn) if r < self.layout.world]

    def placement(self, rank: int) -> ranks.Placement:
        return ranks.Placement(rank, self.layout.world, rank % self.rpn, self.rpn, rank // self.rpn,
                               len(self.nodes))

    def restarts_all(self, restarted: list[int]) -> bool:
        """Does a restart of `restarted` start every rank of the job (a new formation, even if it came as a restart
        of ranks: every other had ended), or do they join ranks that run on?"""
        return set(restarted) >= set(range(self.layout.world))

    async def retry(self, generation: int, wait_s: float) -> dict[str, Any]:
        """A step retry is a new generation with no process restarted: asking the job store for its torch store (as
        an in-place restart's agents do, for the running formation) announces it, and every rank waiting in
        `recover()` forms its group there in its own process and trains the step again. Every agent of the job asks;
        the first request makes the announcement, the others read it."""
        if await self.torch_port(generation, False, wait_s) is None:
            raise CommandFailed(f"the job store of {self.id} did not announce generation {generation}: the ranks "
                                "cannot form it")
        return {"retried": sorted(r for r, p in self.processes.items() if p.alive)}

    async def torch_port(self, generation: int, whole: bool, wait_s: float) -> int | None:
        """The port of the torch store of the ranks this node starts in `generation` (`whole`: every rank of the
        job starts in it; else they join the running formation), asked of the job store once per generation."""
        async with self.torch_lock:
            if generation not in self.torch_ports:
                self.torch_ports[generation] = await torch_store_port(
                    self.store_addr, self.store_port, self.id, generation, whole, wait_s)
                if self.torch_ports[generation] is None:
                    logger.warning("the job store of %s at %s:%d serves no torch store: its ranks' MASTER_PORT is "
                                   "the job store's, whose keys outlive a restart", self.id, self.store_addr,
                                   self.store_port)
            return self.torch_ports[generation]


async def torch_store_port(host: str, port: int, run_id: str, generation: int, whole: bool,
                           wait_s: float) -> int | None:
    """Ask the job store at host:port for the torch store of `run_id`'s ranks started in `generation`; None if the
    store is not reachable within `wait_s` or does not serve torch stores (a store of an older version)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            store = await TorchStore.connect(host, port, timeout_s=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except StoreError as exc:
            if time.monotonic() >= deadline:
                logger.warning("no job store for %s within %gs: %s", run_id, wait_s, exc)
                return None
            await anyio.sleep(CONNECT_RETRY_S)  # polling the store's start, within the deadline above
    try:
        async with store:
            if not await store.check(SERVED):
                return None
            key = torch_store_key(run_id, generation)
            if not await store.check(key):
                await store.queue_push(REQUESTS, f"{'whole' if whole else 'join'} {generation} {run_id}")
                if not await store.wait(key, max(0.1, deadline - time.monotonic())):
                    logger.warning("the job store of %s did not answer for generation %d within %gs", run_id,
                                   generation, wait_s)
                    return None
            return int(await store.get(key))
    except (StoreError, ValueError, TimeoutError) as exc:
        logger.warning("the job store of %s failed to give generation %d's torch store: %s", run_id, generation, exc)
        return None


async def end_torch_stores(host: str, port: int, run_id: str) -> None:
    """Tell the job store that `run_id` ended, so that it closes the job's torch stores (one store serves many jobs
    for months: each job's last formation would otherwise stay open). Best effort: a store that is gone has none."""
    try:
        with anyio.fail_after(5.0):
            async with await TorchStore.connect(host, port, timeout_s=2.0) as store:
                if await store.check(SERVED):
                    await store.queue_push(REQUESTS, f"end 0 {run_id}")
    except (StoreError, TimeoutError) as exc:
        logger.info("could not tell the job store that %s ended: %s", run_id, exc)


class CommandFailed(Exception):
    """A command that could not be carried out: its ack says why, and `result` what the engine may act on."""

    def __init__(self, reason: str, **result: object) -> None:
        super().__init__(reason)
        self.result = result

"""A scale that keeps live processes (`ScaleJob.kept`): an elastic job's survivors re-form in the new world instead of
being restarted, the ranks the new placement adds start and take their state from them.

The new world is written to the job store before the generation is announced (the agent's request for its torch
store), under `<run id>/recovery/world/<generation>` (`recovery.client.torch.WORLD_KEY`), so that a survivor that sees
the generation finds its world there: `nodes` and `ranks_per_node` give it its rank (its node's place, its local
rank), `world_size` the size. Every agent the command addresses writes the same value: whichever announces first, the
world is there.

`Rescale` is the part of the agent (`recovery.agent.agent.Agent` derives from it) that carries such a scale out.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from events.commands import ScaleJob
from events.values import ResumePlan
from recovery.agent import ranks
from recovery.agent.config import AgentConfig
from recovery.agent.jobs import CommandFailed, JobOnNode
from recovery.agent.progress import ProgressFold, SilenceWatch
from recovery.agent.tcpstore import StoreError, TorchStore

logger = logging.getLogger("recovery.agent")

WORLD_KEY = "{run_id}/recovery/world/{generation}"
"""where the world of a generation a scale decided lives in the job store (`recovery.client.torch.WORLD_KEY`)"""


class Rescale:
    cfg: AgentConfig
    node: str
    runtime_dir: Path
    progress: ProgressFold
    silence: SilenceWatch

    async def _kill(self, job: JobOnNode, which: list[int]) -> None:
        raise NotImplementedError

    async def _launch(self, job: JobOnNode, rank: int, attempt: int, plan: ResumePlan | None,
                      command_id: str | None = None, *, whole: bool) -> None:
        raise NotImplementedError

    async def scale_keeping(self, job: JobOnNode, command: ScaleJob) -> dict[str, Any]:
        """Keep the processes of this node that `command.kept` names (same local rank, their new rank), end the other
        processes of the job here, and start the ranks of the new placement on this node that no process keeps."""
        index = command.nodes.index(self.node) if self.node in command.nodes else None
        kept = set(command.kept)
        survivors: dict[int, ranks.RankProcess] = {}  # new rank -> the process that lives on as it
        ending: list[int] = []
        for rank, proc in sorted(job.processes.items()):
            if not proc.alive:
                continue
            new = None if index is None else index * job.rpn + rank % job.rpn
            if new is not None and new in kept:
                survivors[new] = proc
            else:
                ending.append(rank)
        await publish_world(job, command)  # first: the generation is announced below
        await self._kill(job, ending)
        for proc in survivors.values():
            # Under its new rank from now on: its record, its reports, and its exit (in the new generation).
            self.silence.forget(job.id, proc.rank)
            self.progress.forget(job.id, proc.rank)
            ranks.forget_record(self.runtime_dir, proc)
        job.processes = {rank: proc for rank, proc in job.processes.items() if rank not in ending
                         and proc not in survivors.values() and proc.alive}
        for new, proc in sorted(survivors.items()):
            proc.rank, proc.attempt = new, command.attempt
            job.processes[new] = proc
            ranks.write_record(self.runtime_dir, proc)
        job.nodes = list(command.nodes)
        job.layout = job.layout.scaled(command.dp)
        started = [rank for rank in job.ranks_on(self.node) if rank not in survivors]
        if not started:
            # Nothing starts here to announce the generation: its torch store's request does (the survivors wait
            # for it).
            await job.torch_port(command.attempt, False, self.cfg.store_wait_s)
        for rank in started:
            await self._launch(job, rank, command.attempt, command.plan, command.id, whole=False)
        logger.info("scaled %s to dp=%d: kept ranks %s here, started %s", job.id, command.dp, sorted(survivors),
                    started)
        return {"started": started, "kept": sorted(survivors)}


async def publish_world(job: JobOnNode, command: ScaleJob) -> None:
    """Write the world of `command`'s generation to the job store, for the survivors that re-form in it."""
    world = json.dumps({"world_size": command.dp * job.layout.per_replica, "nodes": list(command.nodes),
                        "ranks_per_node": job.rpn})
    try:
        async with await TorchStore.connect(job.store_addr, job.store_port, timeout_s=5.0) as store:
            await store.set(WORLD_KEY.format(run_id=job.id, generation=command.attempt), world)
    except (StoreError, OSError, TimeoutError) as exc:
        raise CommandFailed(f"the new world could not be written to the job store: {exc}") from None

"""The agent's watch over the ranks of stock scripts (no SDK connection): the rules of `probes.hang` applied every
`hang_poll_s` to each job's ranks on this node, a rank found hung reported as `process.hang` (the engine restarts
the job as it does for a silent SDK rank), each once per process; and each process's first output, reported as
`process.output` (the first sign a stock script gives that it runs again after a restart)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from recovery.agent.config import AgentConfig
from recovery.agent.jobs import JobOnNode
from recovery.agent.probes.hang import HangRules, ProcSample, read_sample
from recovery.agent.ranks import RankProcess
from recovery.agent.stacks import dump_tool, take_stack

logger = logging.getLogger("recovery.agent")
OUTPUT_POLL_S = 0.2
"""how often a started process's output file is looked at until it grows: the precision of a stock script's
measured restart"""


async def first_output(job: JobOnNode, proc: RankProcess, output: Path,
                       report: Callable[[str, str, dict[str, Any]], None]) -> None:
    """Report `process.output` once `proc` has written to its output file; nothing for a process that ends first,
    is replaced, or connects through the SDK (its steps are the measure then)."""
    while proc.alive and job.processes.get(proc.rank) is proc and not speaks(job, proc):
        try:
            grown = output.stat().st_size > 0
        except OSError:
            grown = False  # not created yet
        if grown:
            report(job.id, "process.output", {"rank": proc.rank, "attempt": proc.attempt})
            return
        await anyio.sleep(OUTPUT_POLL_S)  # the period of the look, until the process ends or writes


def speaks(job: JobOnNode, proc: RankProcess) -> bool:
    """Does the rank speak through the SDK (its steps and silence are the measure), not only the step hook?"""
    return job.channel.connected(proc.rank) and not proc.counted_only


class StockHangs:
    def __init__(self, cfg: AgentConfig, jobs: dict[str, JobOnNode],
                 report: Callable[[str, str, dict[str, Any]], None]) -> None:
        self.cfg = cfg
        self.jobs = jobs
        self.report = report  # the agent's job_event
        self.rules: dict[str, HangRules] = {}
        self._looked: dict[str, float] = {}  # job -> when its ranks' stacks were last taken

    async def run(self) -> None:
        if self.cfg.stock_hang_s <= 0 and self.cfg.stock_stopped_s <= 0:
            return
        while True:
            await anyio.sleep(self.cfg.hang_poll_s)  # the period of the watch
            for job_id in [j for j in self.rules if j not in self.jobs]:
                del self.rules[job_id]
            for job in list(self.jobs.values()):
                try:
                    await self._check(job)
                except Exception:  # a probe's mistake must not stop the agent
                    logger.exception("the hang watch of %s failed", job.id)

    async def _check(self, job: JobOnNode) -> None:
        live = {rank: proc for rank, proc in job.processes.items()
                if proc.alive and not speaks(job, proc)}  # an SDK rank's silence says more
        rules = self.rules.setdefault(job.id, HangRules(stopped_s=self.cfg.stock_stopped_s or float("inf"),
                                                        still_s=self.cfg.stock_hang_s or float("inf")))
        samples: dict[int, ProcSample] = {}
        for rank, proc in live.items():
            sample = read_sample(proc.pid)
            if sample is not None:
                samples[rank] = sample
        now = time.monotonic()
        found = rules.observe(now, samples)
        if rules.still(now, rules.still_s / 2) and now - self._looked.get(job.id, -1e18) >= rules.still_s / 4:
            # Some rank has been still a while: its stack and its peers' tell a hang from a wait.
            self._looked[job.id] = now
            tool = dump_tool()
            stacks = {}
            for rank, proc in sorted(live.items()):
                taken = await take_stack(rank, proc.pid, tool)
                if taken.stack:
                    stacks[rank] = taken.stack
            found += rules.judge_still(time.monotonic(), stacks)
        for suspicion in found:
            proc = live[suspicion.rank]
            logger.warning("rank %d of %s hangs: %s", suspicion.rank, job.id, suspicion.cause)
            self.report(job.id, "process.hang", {"rank": suspicion.rank, "attempt": proc.attempt,
                                                 "seconds_without_progress": suspicion.seconds,
                                                 "cause": suspicion.cause})

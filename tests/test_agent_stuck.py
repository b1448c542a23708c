"""A stop after a fault kills at once the ranks that cannot run a signal handler (stopped, or waiting in a
collective, as py-spy shows them), and gives every other rank the grace its handlers may need; a stop that does not
say so (an operator's) waits for all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from recovery.agent import stopping
from recovery.agent.probes.hang import STOPPED, read_sample
from recovery.agent.ranks import RankProcess
from tests.e2e_support import kill_leftovers

IGNORING = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: None)  # a handler that saves nothing and ends nothing: the grace runs out
print("ready", flush=True)
def {function}():
    while True:
        time.sleep(0.05)
{function}()
"""
"""a rank that outlives its SIGTERM, its main thread in `function`: `all_reduce` is a frame py-spy shows as a
collective's"""


class Channel:
    async def send(self, rank: int, message: dict[str, Any]) -> bool:
        return False  # no SDK: the signal at once


def start(tmp_path: Path, function: str) -> subprocess.Popen[bytes]:
    script = tmp_path / f"{function}.py"
    script.write_text(IGNORING.format(function=function))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


async def test_a_stop_after_a_fault_kills_at_once_only_the_ranks_that_cannot_run_a_handler(tmp_path: Path) -> None:
    procs = [start(tmp_path, name) for name in ("all_reduce", "train", "train")]
    os.kill(procs[2].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30  # the signal's delivery, on a busy host
    while (sample := read_sample(procs[2].pid)) is None or sample.state != STOPPED:
        assert time.monotonic() < deadline, "SIGSTOP did not stop the process"
        time.sleep(0.01)  # polling the process's state, within the deadline above
    ranks = {r: RankProcess(job="j", rank=r, attempt=0, process=None, pid=p.pid) for r, p in enumerate(procs)}
    job = SimpleNamespace(id="j", channel=Channel(), processes=ranks)
    try:
        async with anyio.create_task_group() as tg:
            async def supervise(rank: RankProcess, proc: subprocess.Popen[bytes]) -> None:
                rank.returncode = await anyio.to_thread.run_sync(proc.wait)  # the agent's watch of its child
                rank.ended.set()

            for rank, proc in zip(ranks.values(), procs, strict=True):
                tg.start_soon(supervise, rank, proc)
            tg.start_soon(stopping.stop_gracefully, job, [0, 1, 2], 600.0, 5.0, signal.SIGTERM, True)
            try:
                deadline = time.monotonic() + 60  # py-spy's dumps on a busy host
                while not (ranks[0].ended.is_set() and ranks[2].ended.is_set()) and time.monotonic() < deadline:
                    await anyio.sleep(0.05)  # polling the exits, within the deadline above
                assert ranks[0].ended.is_set() and ranks[2].ended.is_set(), "the stuck ranks were not killed"
                assert ranks[0].returncode == ranks[2].returncode == -signal.SIGKILL
                assert not ranks[1].ended.is_set(), "a rank that can run its handler gets the whole grace"
            finally:
                kill_leftovers([p.pid for p in procs])  # before the task group ends: it waits for their exits
                with anyio.fail_after(30):
                    for rank in ranks.values():
                        await rank.ended.wait()
                tg.cancel_scope.cancel()
    finally:
        kill_leftovers([p.pid for p in procs])

"""A preemption (the agent's SIGTERM) asks each live rank for a dying checkpoint and stops it: a rank that ends by
itself meanwhile (its script finished as the node was taken away) is waited for no more, and leaves nothing for the
agent to linger for; one that neither saves nor ends is stopped after half the grace; a rank without the SDK gets
SIGTERM at once and the whole grace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from recovery.agent.agent import Agent
from recovery.agent.config import load
from recovery.agent.ranks import RankProcess


class Channel:
    """The job's socket as the preemption uses it: what it sends each rank, and what the rank does then."""

    def __init__(self, on_send: Any, connected: bool = True) -> None:
        self.sent: list[dict[str, Any]] = []
        self.on_send = on_send
        self.connected = connected  # False: a script without the SDK, which nothing can be sent to

    async def send(self, rank: int, message: dict[str, Any]) -> bool:
        if not self.connected:
            return False
        self.sent.append(message)
        self.on_send()
        return True


async def preempt_one(tmp_path: Path, on_send: Any, proc: subprocess.Popen[bytes], grace_s: float,
                      linger_s: float, connected: bool = True) -> tuple[Channel, RankProcess]:
    cfg = load(node="n0", runtime_dir=tmp_path, preempt_grace_s=grace_s, preempt_linger_s=linger_s, kill_grace_s=5)
    agent = Agent(cfg)
    rank = RankProcess(job="j", rank=0, attempt=0, process=None, pid=proc.pid)
    channel = Channel(on_send, connected)
    agent.jobs["j"] = SimpleNamespace(id="j", channel=channel, processes={0: rank}, saves={},  # type: ignore[assignment]
                                      save_failures={})

    async def supervise() -> None:  # the agent's own watch of its child: the exit ends the rank
        rank.returncode = await anyio.to_thread.run_sync(proc.wait)
        rank.ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(supervise)
        with anyio.fail_after(60):  # a busy host's slack; the grace and the linger are ten minutes each
            await agent.preempt()
        tg.cancel_scope.cancel()
    return channel, rank


async def test_a_rank_that_ends_by_itself_during_the_preemption_is_waited_for_no_more(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdin is not None
        channel, rank = await preempt_one(tmp_path, proc.stdin.close, proc, grace_s=1200, linger_s=600)
        assert [m["op"] for m in channel.sent] == ["save"] and channel.sent[0]["hold"]
        assert not rank.alive and rank.returncode == 0  # it ended by itself: not signalled
    finally:
        proc.kill()
        proc.wait(timeout=30)


async def test_a_rank_that_neither_saves_nor_ends_is_stopped_after_half_the_grace(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        channel, rank = await preempt_one(tmp_path, lambda: None, proc, grace_s=1.0, linger_s=0.1)
        assert [m["op"] for m in channel.sent] == ["save"]
        assert not rank.alive and rank.returncode == -15  # SIGTERM, the grace's second half
    finally:
        proc.kill()
        proc.wait(timeout=30)


SAVES_ON_SIGTERM = """
import signal, sys, time
def on_term(signum, frame):
    time.sleep(3.5)  # a framework's checkpoint on the way out: longer than half the grace
    open(sys.argv[1], "w").write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(600)
"""


async def test_a_rank_without_the_sdk_gets_sigterm_at_once_and_the_whole_grace_to_save(tmp_path: Path) -> None:
    """A stock script or a framework's own loop cannot be asked to save: its own SIGTERM handler is its dying
    checkpoint, and it gets the whole grace for it (half the grace was the SDK's share, and killed it mid-save)."""
    saved = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, "-c", SAVES_ON_SIGTERM, str(saved)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # its handler is in place
        channel, rank = await preempt_one(tmp_path, lambda: None, proc, grace_s=6.0, linger_s=0.1, connected=False)
        assert channel.sent == []
        assert not rank.alive and rank.returncode == 0 and saved.read_text() == "saved"
    finally:
        proc.kill()
        proc.wait(timeout=30)


async def test_a_rank_already_in_the_next_step_saves_once_the_held_ranks_are_stopped(tmp_path: Path) -> None:
    """Two ranks of a node that train in lockstep: rank 0 holds at its boundary at once; rank 1 had passed it, and
    waits in the next step's collectives for rank 0, so it saves only when rank 0 is gone (its collective fails and
    it writes as it waits to recover). The held rank is stopped first, and rank 1, still running then, saves: before,
    both waited out half the grace and were stopped together, and rank 1's shard was never written."""
    cfg = load(node="n0", runtime_dir=tmp_path, preempt_grace_s=40, preempt_linger_s=0.1, kill_grace_s=5)
    agent = Agent(cfg)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
             for _ in range(2)]
    held, late = (RankProcess(job="j", rank=r, attempt=0, process=None, pid=p.pid) for r, p in enumerate(procs))
    saves: dict[str, anyio.Event] = {}
    order: list[str] = []

    async def lockstep(message: dict[str, Any]) -> None:
        if message["id"].endswith(":0:0"):
            saves[message["id"]].set()  # rank 0: at its boundary, saved, holding
            return
        await held.ended.wait()  # rank 1: its collective fails only when rank 0 is gone
        order.append("rank 0 gone")
        await anyio.sleep(1.0)  # its recovery, and the write of its shard, take a while (the rank's work, modelled)
        if late.alive:  # it writes its last step's state as it waits to recover
            saves[message["id"]].set()
            order.append("rank 1 saved")

    try:
        async with anyio.create_task_group() as tg:
            channel = Channel(lambda: None)
            original = channel.send

            async def send(rank: int, message: dict[str, Any]) -> bool:
                sent = await original(rank, message)
                tg.start_soon(lockstep, message)
                return sent

            channel.send = send  # type: ignore[method-assign]
            agent.jobs["j"] = SimpleNamespace(id="j", channel=channel, processes={0: held, 1: late},  # type: ignore[assignment]
                                              saves=saves, save_failures={})

            async def supervise(rank: RankProcess, proc: subprocess.Popen[bytes]) -> None:
                rank.returncode = await anyio.to_thread.run_sync(proc.wait)
                rank.ended.set()

            for rank, proc in zip((held, late), procs, strict=True):
                tg.start_soon(supervise, rank, proc)
            with anyio.fail_after(120):  # a busy host's slack
                await agent.preempt()
            tg.cancel_scope.cancel()
        assert order == ["rank 0 gone", "rank 1 saved"]
        assert all(event.is_set() for event in saves.values()) and len(saves) == 2
        await anyio.sleep(0)  # the lockstep task ran to its end before the group was cancelled: nothing left to set
        assert held.returncode == -15 and late.returncode == -15  # both stopped: by SIGTERM, neither killed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)

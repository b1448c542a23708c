"""The rank processes of one node: their environment (torchrun's, plus the job's generation and resume plan),
their start in a session of their own, signals to that session, and how each ended (from its wait status)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import Process

from events.values import Entrypoint, ResumePlan
from recovery.agent.standby import Standby


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank runs within its job: torchrun's numbers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int


@dataclass(slots=True)
class RankProcess:
    job: str
    rank: int
    attempt: int
    process: Process
    pid: int
    ended: anyio.Event = field(default_factory=anyio.Event)
    returncode: int | None = None

    @property
    def alive(self) -> bool:
        return not self.ended.is_set()

    def signal(self, signum: int) -> None:
        """Signal the rank's whole session (the training script and whatever it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def status(self) -> tuple[int | None, int | None]:
        """(exit code, signal) from the wait status: Python reports a signal as a negative return code."""
        code = self.returncode
        if code is None:
            return None, None
        return (None, -code) if code < 0 else (code, None)


def environment(entrypoint: Entrypoint, placement: Placement, *, job: str, node: str, attempt: int,
                plan: ResumePlan | None, master_addr: str, master_port: int, socket: Path,
                heartbeat_s: float) -> dict[str, str]:
    """The agent's environment, the job's, then what the agent sets for the rank (which wins)."""
    env = {**os.environ, **entrypoint.env}
    env.update({
        "RANK": str(placement.rank),
        "LOCAL_RANK": str(placement.local_rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_WORLD_SIZE": str(placement.local_world_size),
        "GROUP_RANK": str(placement.group_rank),
        "ROLE_RANK": str(placement.rank),
        "ROLE_WORLD_SIZE": str(placement.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_MAX_RESTARTS": "0",  # restarts are the control plane's, never the script's own
        "RECOVERY_JOB": job,
        "RECOVERY_NODE": node,
        "RECOVERY_GENERATION": str(attempt),
        "RECOVERY_AGENT_SOCKET": str(socket),
        "RECOVERY_HEARTBEAT_S": str(heartbeat_s),
    })
    if plan is not None:
        env["RECOVERY_RESUME_PLAN"] = plan.model_dump_json()
    else:
        env.pop("RECOVERY_RESUME_PLAN", None)
    return env


async def start(entrypoint: Entrypoint, env: dict[str, str], output: Path, *, job: str, rank: int,
                attempt: int, standby: Standby | None = None) -> RankProcess:
    """Start the rank in a new session (so that a signal reaches everything it starts, and the agent's own
    terminal signals do not), its output appended to `output`; with a ready `standby`, hand the rank to it (a
    warm interpreter already in a session of its own) instead."""
    if standby is not None:
        process = await standby.hand_over(entrypoint, env, output)
        return RankProcess(job, rank, attempt, process, process.pid)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("ab") as log:
        process = await anyio.open_process([entrypoint.command, *entrypoint.args], cwd=entrypoint.cwd, env=env,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    return RankProcess(job, rank, attempt, process, process.pid)


async def reap(proc: RankProcess) -> None:
    """Wait for the process to end and keep its return code."""
    proc.returncode = await proc.process.wait()
    proc.ended.set()


async def stop(proc: RankProcess, grace_s: float, kill_after_s: float) -> bool:
    """SIGTERM, up to `grace_s` for the process to end, then SIGKILL; True if it ended within `kill_after_s`
    of the kill."""
    if proc.alive and grace_s > 0:
        proc.signal(signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            await proc.ended.wait()
    return await kill(proc, kill_after_s)


async def kill(proc: RankProcess, within_s: float) -> bool:
    if proc.alive:
        proc.signal(signal.SIGKILL)
    with anyio.move_on_after(within_s):
        await proc.ended.wait()
    return not proc.alive

"""The rank processes of one node: their environment (torchrun's, plus the job's generation and resume plan),
their start in a session of their own, signals to that session, and how each ended (from its wait status)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import Process

from events.values import Entrypoint, ResumePlan
from recovery.agent.standby import Standby, one_thread_each
from recovery.agent.standby_parent import ForkedStandby, StandbyLost, until_gone
from recovery.agent.stephook import with_step_hook

COUNTED = frozenset(("counts",))

logger = logging.getLogger("recovery.agent")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank runs within its job: torchrun's numbers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int  # nodes of the placement


@dataclass(slots=True)
class RankProcess:
    job: str
    rank: int
    attempt: int
    process: Process | ForkedStandby | None
    """None: adopted, a rank that outlived the agent that started it; a `ForkedStandby`: a standby's, whose exit
    status comes from the standby's parent (neither is the agent's child)"""
    pid: int
    ended: anyio.Event = field(default_factory=anyio.Event)
    returncode: int | None = None
    closing: bool = False  # its SDK said the script is done (the exit of an adopted rank counts as clean)
    ending_since: float | None = None  # monotonic time its SDK said the script is done or the interpreter exits
    caps: frozenset[str] | None = None  # what its SDK announced (`process.capabilities`); None: nothing yet

    @property
    def counted_only(self) -> bool:
        """Only the step hook speaks for it (`recovery.client.steps`): a script without the SDK, whose steps are
        counted. Its agent treats it as a stock script in all else (signals at once, its hangs seen from outside)."""
        return self.caps is not None and self.caps <= COUNTED
    command_seq: int = 0  # the last command (RECOVERY_CMD sequence) the agent had read when it started this process

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
                plan: ResumePlan | None, store_addr: str, store_port: int, torch_port: int | None, socket: Path,
                heartbeat_s: float, memory_dir: Path | None = None, error_file: Path | None = None,
                step_hook: bool = True) -> dict[str, str]:
    """The agent's environment, the job's, then what the agent sets for the rank (which wins): torchrun's, with its
    agent-store contract (`TORCHELASTIC_USE_AGENT_STORE=True`: every rank, rank 0 too, is a client of the store at
    MASTER_ADDR:MASTER_PORT, which is the fresh torch store of the rank's formation, `torch_port`; the job store's
    own port without one), and the job store itself as RECOVERY_STORE_ADDR/RECOVERY_STORE_PORT, where the SDK's
    generations live across formations; RECOVERY_MEMORY_DIR, the job's shared memory on the node
    (`recovery.agent.memory`); TORCHELASTIC_ERROR_FILE, where `@record` writes the exception the script dies of
    (`recovery.agent.errors`); OMP_NUM_THREADS as torchrun sets it (`one_thread_each`); with `step_hook`, unless
    the job says RECOVERY_STEP_HOOK=0, the start-up hook that counts the script's optimizer steps
    (`recovery.agent.stephook`)."""
    env = one_thread_each({**os.environ, **entrypoint.env}, placement.local_world_size)
    env.update({
        "RANK": str(placement.rank),
        "LOCAL_RANK": str(placement.local_rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_WORLD_SIZE": str(placement.local_world_size),
        "GROUP_RANK": str(placement.group_rank),
        "GROUP_WORLD_SIZE": str(placement.group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(placement.rank),
        "ROLE_WORLD_SIZE": str(placement.world_size),
        "MASTER_ADDR": store_addr,
        "MASTER_PORT": str(torch_port if torch_port is not None else store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # torch compares with str(True)
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_MAX_RESTARTS": "0",  # restarts are the control plane's, never the script's own
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "RECOVERY_JOB": job,
        "RECOVERY_NODE": node,
        "RECOVERY_GENERATION": str(attempt),
        "RECOVERY_STORE_ADDR": store_addr,
        "RECOVERY_STORE_PORT": str(store_port),
        "RECOVERY_AGENT_SOCKET": str(socket),
        "RECOVERY_HEARTBEAT_S": str(heartbeat_s),
    })
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)  # one per process, as torchrun gives each worker its own
    else:
        env.pop("TORCHELASTIC_ERROR_FILE", None)
    if memory_dir is not None:
        env["RECOVERY_MEMORY_DIR"] = str(memory_dir)  # the node's shared memory for the job's checkpoints
    else:
        env.pop("RECOVERY_MEMORY_DIR", None)
    if plan is not None:
        env["RECOVERY_RESUME_PLAN"] = plan.model_dump_json()
    else:
        env.pop("RECOVERY_RESUME_PLAN", None)
    return with_step_hook(env, step_hook)


async def start(entrypoint: Entrypoint, env: dict[str, str], output: Path, *, job: str, rank: int,
                attempt: int, standby: Standby | None = None) -> RankProcess:
    """Start the rank in a new session (so that a signal reaches everything it starts, and the agent's own
    terminal signals do not), its output appended to `output`; with a ready `standby`, hand the rank to it (a
    warm interpreter already in a session of its own) instead."""
    if "TORCHELASTIC_ERROR_FILE" in env:
        # An error file left by an earlier process of the same path would be taken for this one's (torchrun removes
        # it too).
        Path(env["TORCHELASTIC_ERROR_FILE"]).unlink(missing_ok=True)
    if standby is not None:
        try:
            forked = await standby.hand_over(entrypoint, env, output)
        except StandbyLost as exc:
            logger.warning("rank %d of %s starts cold: %s", rank, job, exc)
            await standby.close()
        else:
            assert forked.pid is not None  # `hand_over` waited for it
            return RankProcess(job, rank, attempt, forked, forked.pid)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("ab") as log:
        process = await anyio.open_process([entrypoint.command, *entrypoint.args], cwd=entrypoint.cwd, env=env,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    return RankProcess(job, rank, attempt, process, process.pid)


async def reap(proc: RankProcess) -> None:
    """Wait for the process to end and keep its return code. An adopted rank is not our child: its end is seen
    through a pidfd (readable once it has exited) and its return code stays unknown (None) here: the agent decides
    it from what the rank's SDK said before it went (`closing`). Nor is a standby's: its parent tells its status,
    unknown too where the parent ended first."""
    if proc.process is not None:
        proc.returncode = await proc.process.wait()
    else:
        await until_gone(proc.pid)
    proc.ended.set()


def in_session(pid: object, proc: RankProcess) -> bool:
    """Is `pid` the rank's process or one it started? The entrypoint may be a launcher (a shell script that runs
    python): the SDK then runs in a child, in the session the rank was started in, whose id is the rank's pid."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if pid == proc.pid:
        return True
    try:
        return os.getsid(pid) == proc.pid
    except OSError:
        return False


# -- ranks that outlive their agent --------------------------------------------------------------------
# The agent keeps a record per running rank in its runtime directory: pid, generation and the kernel's start time of
# the process (which tells the rank from a later process that reused its pid). An agent restarted on the node (an
# upgrade, a crash) adopts the ranks whose records still match a live process: it sees them exit and can stop or
# replace them, instead of starting a second copy of a rank that is still running.

def record_path(runtime_dir: Path, job: str, rank: int) -> Path:
    return runtime_dir / f"{job}.rank{rank}.json"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 and fields[0] != "Z" else None


def write_record(runtime_dir: Path, proc: RankProcess) -> None:
    started = start_time(proc.pid)
    if started is None:
        return
    path = record_path(runtime_dir, proc.job, proc.rank)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"pid": proc.pid, "attempt": proc.attempt, "start": started,
                                     "command_seq": proc.command_seq}))
    temporary.replace(path)  # whole or not at all: an agent killed mid-write leaves the older record


def forget_record(runtime_dir: Path, proc: RankProcess) -> None:
    path = record_path(runtime_dir, proc.job, proc.rank)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == proc.pid:
            path.unlink()


def adopt(runtime_dir: Path, job: str, rank: int) -> RankProcess | None:
    """The rank's process from the record an earlier agent left, if that process still runs."""
    try:
        record = json.loads(record_path(runtime_dir, job, rank).read_text())
        pid, attempt, started = int(record["pid"]), int(record["attempt"]), int(record["start"])
        command_seq = int(record.get("command_seq", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if start_time(pid) != started:
        return None  # ended (its pid maybe reused): nothing to adopt
    return RankProcess(job, rank, attempt, None, pid, command_seq=command_seq)


async def first_set(*events: anyio.Event) -> None:
    """Return once any of `events` is set."""
    async with anyio.create_task_group() as tg:
        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


async def stop(proc: RankProcess, grace_s: float, kill_after_s: float, signum: int = signal.SIGTERM) -> bool:
    """`signum` (SIGTERM; SIGINT for an interrupt), up to `grace_s` for the process to end, then SIGKILL; True if it
    ended within `kill_after_s` of the kill."""
    if proc.alive and grace_s > 0:
        proc.signal(signum)
        proc.signal(signal.SIGCONT)  # a stopped rank (a hang that was a SIGSTOP) handles it only once continued
        with anyio.move_on_after(grace_s):
            await proc.ended.wait()
    return await kill(proc, kill_after_s)


async def kill(proc: RankProcess, within_s: float) -> bool:
    if proc.alive:
        proc.signal(signal.SIGKILL)
    with anyio.move_on_after(within_s):
        await proc.ended.wait()
    return not proc.alive

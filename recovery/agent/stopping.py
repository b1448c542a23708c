"""How a node's ranks are stopped with time to save: a graceful stop (a cancel, a stop the engine sends) and a
preemption (the platform's SIGTERM to the agent). A rank that speaks through the SDK is asked first (to stop, or to
save and hold); a script without it (a stock script, a framework's own loop) gets the signal at once and the whole
grace, as torchrun gives its workers, so that its own handlers run: Lightning's checkpoint on an interrupt, a
`SIGTERM` handler that saves. Whatever still runs at the end of the grace is killed."""

from __future__ import annotations

import logging
import signal

import anyio

from recovery.agent import ranks
from recovery.agent.jobs import CommandFailed, JobOnNode
from recovery.agent.probes.hang import STOPPED, in_collective, read_sample
from recovery.agent.stacks import dump_tool, take_stack

logger = logging.getLogger("recovery.agent")
STUCK_DUMP_S = 5.0
"""the longest a stuck rank's stack may take before its stop goes on as if it could handle the signal"""


def is_stopped(proc: ranks.RankProcess) -> bool:
    """Is `proc` stopped (state T: SIGSTOP)? It runs no handler until continued."""
    sample = read_sample(proc.pid)
    return sample is not None and sample.state == STOPPED


async def kill_if_in_collective(job: JobOnNode, proc: ranks.RankProcess, kill_grace_s: float) -> None:
    """Kill `proc` if its stack (py-spy's) shows it waiting in a collective: a Python handler runs only between the
    main thread's bytecodes, never inside the C++ call, and what the collective waits on, the fault took."""
    taken = await take_stack(proc.rank, proc.pid, dump_tool(), STUCK_DUMP_S)
    if proc.alive and taken.stack and in_collective(taken.stack):
        logger.info("rank %d of %s waits in a collective and cannot run a signal handler: killed at once", proc.rank,
                    job.id)
        await ranks.kill(proc, kill_grace_s)


async def stop_gracefully(job: JobOnNode, which: list[int], grace_s: float, kill_grace_s: float,
                          signum: signal.Signals = signal.SIGTERM, stuck_kill: bool = False) -> None:
    """The SDK's stop first (the step ends cleanly), then `signum` (SIGTERM, or SIGINT for an interrupt), then
    SIGKILL, within `grace_s`; a rank with no SDK connection gets the signal at once and the whole grace. With
    `stuck_kill` (a stop after a fault), a rank that cannot run a handler is killed at once: a stopped one before any
    signal, one waiting in a collective as soon as its stack shows it (the signal and the grace go on meanwhile, so
    that a rank that ends by itself is not held up by the look). Raises `CommandFailed` if a rank outlives its
    SIGKILL by `kill_grace_s`."""
    procs = everyone = [job.processes[r] for r in which if r in job.processes and job.processes[r].alive]
    if stuck_kill:
        stopped = [proc for proc in procs if is_stopped(proc)]
        for proc in stopped:
            logger.info("rank %d of %s is stopped (state T) and cannot run a signal handler: killed at once",
                        proc.rank, job.id)
        async with anyio.create_task_group() as tg:
            for proc in stopped:
                tg.start_soon(ranks.kill, proc, kill_grace_s)
        procs = [proc for proc in procs if proc not in stopped]
    asked: set[int] = set()
    for proc in procs:
        # Only a script that reads the SDK's stop (`stops`) is asked first: any other (the step hook's client, a
        # script that only reports steps) gets the signal at once, as a stock script does.
        if proc.caps is not None and "stops" in proc.caps and await job.channel.send(proc.rank, {"op": "stop"}):
            asked.add(proc.rank)
        else:
            logger.info("rank %d of %s does not read the SDK's stop: %s now, and the whole grace to end", proc.rank,
                        job.id, signum.name)

    async def one(proc: ranks.RankProcess) -> None:
        if proc.rank in asked:  # its SDK ends the step cleanly
            with anyio.move_on_after(grace_s / 2):
                await proc.ended.wait()
            await ranks.stop(proc, grace_s / 2, kill_grace_s, signum)
        else:
            await ranks.stop(proc, grace_s, kill_grace_s, signum)

    async with anyio.create_task_group() as tg:
        for proc in procs:
            tg.start_soon(one, proc)
            if stuck_kill:
                tg.start_soon(kill_if_in_collective, job, proc, kill_grace_s)
    if any(p.alive for p in everyone):
        raise CommandFailed(f"ranks {[p.rank for p in everyone if p.alive]} did not end after SIGKILL")


LOCKSTEP_S = 2.0
"""once one rank of a node holds at its boundary, how long the others have to reach theirs: a rank still in the next
step waits there for the held ones (see `stop_saving`)"""


async def stop_saving(node: str, job: JobOnNode, procs: list[ranks.RankProcess], grace_s: float,
                      kill_grace_s: float, stopped: list[bool]) -> None:
    """A preemption's stop of `procs`: each SDK rank saves a dying checkpoint at its next step boundary and holds
    there (up to half the grace), then gets SIGTERM and the rest; a rank without the SDK gets SIGTERM at once and the
    whole grace. Appends True to `stopped` if any rank had to be stopped (the agent lingers for the engine then)."""
    saved: list[tuple[ranks.RankProcess, anyio.Event]] = []
    unasked: list[ranks.RankProcess] = []
    for proc in procs:
        request = f"preempt:{node}:{proc.rank}:{proc.attempt}"
        job.saves[request] = anyio.Event()
        if not proc.counted_only and await job.channel.send(proc.rank, {"op": "save", "id": request, "hold": True}):
            saved.append((proc, job.saves[request]))
        else:
            logger.info("rank %d of %s has no SDK connection: SIGTERM now, and the whole grace to end", proc.rank,
                        job.id)
            unasked.append(proc)
    stopped.append(bool(unasked))
    async with anyio.create_task_group() as tg:
        for proc in unasked:
            tg.start_soon(ranks.stop, proc, grace_s, kill_grace_s)
        deadline = anyio.current_time() + grace_s / 2
        if saved:
            with anyio.move_on_at(deadline):  # the first save, or exit
                await ranks.first_set(*(event for _, event in saved), *(proc.ended for proc, _ in saved))
        with anyio.move_on_at(min(deadline, anyio.current_time() + LOCKSTEP_S)):
            for proc, event in saved:
                await ranks.first_set(event, proc.ended)  # a rank that exited answers no more
        # A rank that had passed the boundary when it was asked is in the next step, whose collectives wait for the
        # ranks holding at that boundary: it reaches no boundary while they live. The held ranks go first; the
        # collective fails, and the rank writes the state of its last step as it waits to recover.
        late = [(proc, event) for proc, event in saved if not event.is_set() and proc.alive]
        first = [proc for proc, event in saved if event.is_set() and proc.alive] if late else []
        if first:
            logger.info("ranks %s of %s hold and %s are still in a step: the held ones stop first",
                        [p.rank for p in first], job.id, [p.rank for p, _ in late])
            for proc in first:
                tg.start_soon(ranks.stop, proc, grace_s / 2, kill_grace_s)
        with anyio.move_on_at(max(deadline, anyio.current_time() + grace_s / 4) if first else deadline):
            for proc, event in late:
                await ranks.first_set(event, proc.ended)
        for proc in procs:  # a failed save is the engine's to learn from the missing checkpoint: no ack says it
            job.save_failures.pop(f"preempt:{node}:{proc.rank}:{proc.attempt}", None)
        running = [proc for proc, _ in saved if proc.alive and proc not in first]
        stopped.append(bool(running or first))
        for proc in running:
            tg.start_soon(ranks.stop, proc, grace_s / 2, kill_grace_s)

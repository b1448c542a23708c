"""Stacks taken before a hang is acted on: the engine asks every node of the job for them with the fault, the agent
reads real processes with py-spy (bounded in time and size), and the report groups ranks by stack and names the
odd ones out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from events.commands import DumpStacks
from events.kinds import MAX_STACK_CHARS, RankStack
from recovery.agent.stacks import Dumps, dump_tool, take_stack, trimmed
from recovery.core.addressing import command_nodes
from recovery.log.file import FileLog
from recovery.report import build_report, iter_file
from recovery.report.html import render_html
from recovery.report.stacks import StackGroups, innermost_own, main_frames
from recovery.testing.scenario import Scenario

STUCK = textwrap.dedent("""
    import sys, threading

    def load_batch():
        threading.Event().wait()  # a data loader that never returns

    def all_reduce():
        threading.Event().wait()  # stands for a collective waiting on a peer

    def main():
        print("ready", flush=True)
        load_batch() if sys.argv[1] == "loader" else all_reduce()

    main()
""")


@pytest.fixture
def stuck(tmp_path: Path) -> Iterator[dict[str, int]]:
    """Four real processes: ranks 0, 1 and 3 wait in `all_reduce`, rank 2 in `load_batch`; pid by rank."""
    script = tmp_path / "train.py"
    script.write_text(STUCK)
    procs = {rank: subprocess.Popen([sys.executable, str(script), "loader" if rank == 2 else "collective"],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) for rank in range(4)}
    try:
        for proc in procs.values():
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # blocks until it is in main
        yield {rank: proc.pid for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_agent_reads_a_real_stack_and_the_report_names_the_rank_stuck_elsewhere(stuck: dict[str, int]) -> None:
    tool = dump_tool()
    assert tool is not None, "py-spy (a dependency) is not installed"

    async def dump() -> list[RankStack]:
        return [await take_stack(rank, pid, tool) for rank, pid in stuck.items()]

    taken = anyio.run(dump)
    assert all(not s.error for s in taken), [s.error for s in taken]
    loader = next(s for s in taken if s.rank == 2)
    assert "load_batch" in loader.stack and "train.py" in loader.stack
    frames = main_frames(loader.stack)
    assert frames[0].startswith("Condition.wait (") and innermost_own(list(frames)) == "load_batch (train.py:5)"
    groups = StackGroups()
    groups.add({"ranks": [s.model_dump() for s in taken]})
    report = groups.report()
    assert report["odd"] == [{"ranks": [2], "frame": "load_batch (train.py:5)"}]
    assert report["groups"][0]["ranks"] == [0, 1, 3] and report["groups"][0]["frame"] == "all_reduce (train.py:8)"


def test_a_process_that_cannot_be_read_is_reported_with_why_not_waited_for() -> None:
    async def dump() -> tuple[RankStack, RankStack]:
        gone = await take_stack(5, 2**31 - 1, dump_tool())  # no such process
        missing = await take_stack(6, 1, None)
        return gone, missing

    gone, missing = anyio.run(dump)
    assert gone.rank == 5 and gone.error.startswith("py-spy exited") and not gone.stack
    assert missing.error == "py-spy not found on the node"


def test_a_stack_past_the_bound_keeps_its_innermost_frames() -> None:
    text = "Thread 1 (idle)\n" + "".join(f"    f{i} (x.py:{i})\n" for i in range(5000))
    cut = trimmed(text)
    assert len(cut) <= MAX_STACK_CHARS and cut.startswith("Thread 1 (idle)\n    f0 (x.py:0)")
    assert cut.endswith("(cut: the outermost frames)\n")


def test_a_kill_waits_for_the_dump_under_way() -> None:
    order: list[str] = []

    async def run() -> None:
        dumps = Dumps()
        done = dumps.begin("j")

        async def dump() -> None:
            await anyio.sleep(0.05)  # the dump takes a while
            order.append("dumped")
            dumps.end("j", done)

        async def kill() -> None:
            await dumps.settled("j")
            order.append("killed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill)
            tg.start_soon(dump)

    anyio.run(run)
    assert order == ["dumped", "killed"]


def silent_rank(log: FileLog | None = None) -> Scenario:
    """Rank 5 of 8 falls silent; the others heartbeat without progress until the watchdog finds it."""
    s = Scenario(log) if log is not None else Scenario()
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("llm", 20)
    s.checkpoint("llm", 20, "storage", "storage")
    for _ in range(40):
        s.advance(1)
        for rank in range(8):
            if rank != 5:
                s.job_event("llm", "process.heartbeat", rank=rank, step=20)
        if s.engine.jobs["llm"].incident is not None:
            break
    return s


def test_a_hang_asks_every_node_for_its_stacks_before_anything_is_stopped() -> None:
    s = silent_rank()
    [confirmed] = s.find("fault.confirmed", "llm")
    [dump] = [c for c in confirmed.commands if isinstance(c, DumpStacks)]
    job = s.engine.jobs["llm"]
    assert command_nodes(dump, job.node_of, job.nodes) == ["n0", "n1"]
    assert "silent" in dump.reason
    # published before the stop or restart that the same record decides
    commands = [c.kind for d in s.decisions if d.cause_seq == confirmed.cause_seq for c in d.commands]
    assert commands[0] == "dump_stacks" and any(k in ("stop_ranks", "restart_ranks") for k in commands[1:])


def test_stacks_of_a_rank_outside_the_job_are_dead_lettered() -> None:
    s = silent_rank()
    s.job_event("llm", "process.stacks", ranks=[{"rank": 99, "stack": "Thread 1 (idle)"}])
    assert s.rejections[-1].code == "unknown_rank"


def test_the_report_groups_the_incidents_stacks_and_names_the_odd_rank(tmp_path: Path) -> None:
    s = silent_rank(FileLog(tmp_path / "log.jsonl"))

    def stack(function: str, line: int) -> str:
        return (f'Thread 7 (idle): "MainThread"\n    Condition.wait (/usr/lib/python3.11/threading.py:327)\n'
                f"    {function} (/job/train.py:{line})\n    main (/job/train.py:40)\n")

    for ranks in (range(4), range(4, 8)):  # one dump per node
        s.job_event("llm", "process.stacks", ranks=[
            {"rank": r, "pid": 100 + r, "stack": stack("load_batch" if r == 5 else "all_reduce", 9 if r == 5 else 30)}
            for r in ranks], tool="py-spy")
    report = build_report(iter_file(tmp_path / "log.jsonl"))
    [incident] = report["jobs"][0]["incidents"]
    stacks = incident["stacks"]
    assert stacks["dumps"] == 2 and stacks["odd"] == [{"ranks": [5], "frame": "load_batch (train.py:9)"}]
    assert stacks["groups"][0]["ranks"] == [0, 1, 2, 3, 4, 6, 7]
    page = render_html(report)
    assert "stacks: rank(s) 5 stand out, in load_batch (train.py:9)" in page
    assert "stacks: the other 7 rank(s) in all_reduce (train.py:30)" in page

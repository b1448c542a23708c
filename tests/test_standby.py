"""Warm standbys (`recovery/agent/standby.py`): a real interpreter that waits, then becomes the rank handed to it
with the command line, environment, working directory, output and exit status a cold start would have given it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from events.values import Entrypoint
from recovery.agent import ranks
from recovery.agent.standby import THREAD_SETTINGS, Standby, StandbyPool, can_hand_over, standbys_wanted
from tests.e2e_support import environment

SCRIPT = """
import os, sys
print("argv", sys.argv)
print("path0", sys.path[0])
print("cwd", os.getcwd())
print("rank", os.environ.get("RANK"), "agent-only", os.environ.get("ONLY_IN_THE_STANDBY"))
print("name", __name__)
print("interpreter-stdin", sys.stdin.read() == "")
print("warmed", getattr(sys.modules.get("tests.test_standby"), "WARMED", False))
print("idle threads", [t for t in os.listdir("/proc/self/task")
                       if os.sched_getscheduler(int(t)) == getattr(os, "SCHED_IDLE", -1)])
print("autogroup nice", open("/proc/self/autogroup").read().split()[-1] if os.path.exists("/proc/self/autogroup")
      else "0")
sys.exit(int(os.environ["EXIT_WITH"]))
"""


WARMED = False


def autogroup_nice(pid: int) -> int:
    """The nice value of the scheduling group of `pid`'s session (0 on a kernel without autogroups)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError):
        return 0


def mark_warm() -> None:
    """A warm-up the standby of a test calls (`tests.test_standby:mark_warm`)."""
    global WARMED
    WARMED = True


def test_the_torch_warm_up_leaves_the_random_state_as_it_was() -> None:
    import torch

    from recovery.client.torch import warm_up

    torch.manual_seed(0)
    cold = torch.rand(4)
    torch.manual_seed(0)
    warm_up()
    assert torch.equal(torch.rand(4), cold)


@pytest.mark.parametrize(("command", "args", "expected"), [
    (sys.executable, ["train.py", "--steps", "3"], True),
    (sys.executable, ["-m", "pkg.train"], True),
    ("/usr/bin/python3.11", ["train.py"], True),
    (sys.executable, ["-u", "train.py"], False),  # interpreter options were read at its start: not ours to fake
    (sys.executable, ["-m"], False),
    (sys.executable, [], False),
    ("/usr/bin/bash", ["train.sh"], False),
])
def test_only_a_python_script_or_module_can_be_handed_over(command: str, args: list[str], expected: bool) -> None:
    assert can_hand_over(Entrypoint(command=command, args=args)) is expected


def test_a_job_opts_in_or_out_whatever_the_agent_says(tmp_path: Path) -> None:
    script = Entrypoint(command=sys.executable, args=["train.py"])
    opted_in = Entrypoint(command=sys.executable, args=["train.py"], env={"RECOVERY_STANDBY": "1"})
    opted_out = Entrypoint(command=sys.executable, args=["train.py"], env={"RECOVERY_STANDBY": "0"})
    off = StandbyPool(tmp_path, enabled=False, preload="", delay_s=0)
    on = StandbyPool(tmp_path, enabled=True, preload="", delay_s=0)
    assert (off.wanted(script), off.wanted(opted_in), off.wanted(opted_out)) == (False, True, False)
    assert (on.wanted(script), on.wanted(opted_in), on.wanted(opted_out)) == (True, True, False)


@pytest.mark.parametrize("exit_with", [0, 3])
async def test_a_standby_becomes_the_rank_as_a_cold_start_would_start_it(tmp_path: Path, exit_with: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "job.py").write_text(SCRIPT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    for key, value in environment().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ONLY_IN_THE_STANDBY", "yes")  # the agent's environment when the standby started
    entrypoint = Entrypoint(command=sys.executable, args=[str(scripts / "job.py"), "--flag"], cwd=str(workdir),
                            env={"RECOVERY_STANDBY_PRELOAD": "json, argparse,tests.test_standby:mark_warm"})
    pool = StandbyPool(tmp_path / "runtime", enabled=True, preload="torch", delay_s=0)
    (tmp_path / "runtime").mkdir()
    async with anyio.create_task_group() as tg:
        try:
            with anyio.fail_after(60):
                await pool.keep("job", entrypoint)
            standby = pool.take("job", dict(os.environ))
            assert standby is not None
            # it waits on the CPU time no rank wants
            assert os.sched_getscheduler(standby.pid) == getattr(os, "SCHED_IDLE", os.sched_getscheduler(0))
            # and its session's group, which the kernel weighs against each rank's session, at the least weight
            assert autogroup_nice(standby.pid) == (19 if Path("/proc/self/autogroup").exists() else 0)
            assert pool.take("job", dict(os.environ)) is None  # taken: the next one is the agent's to start
            assert "ready" in (tmp_path / "runtime" / "job.standby1.log").read_text()
            env = {k: v for k, v in environment().items() if k != "ONLY_IN_THE_STANDBY"}
            env.update({"RANK": "2", "EXIT_WITH": str(exit_with)})
            output = tmp_path / "runtime" / "job.rank2.gen1.log"
            proc = await ranks.start(entrypoint, env, output, job="job", rank=2, attempt=1, standby=standby)
            assert proc.pid == standby.pid
            tg.start_soon(ranks.reap, proc)
            with anyio.fail_after(60):
                await proc.ended.wait()
        finally:
            await pool.close()
    assert proc.status() == (exit_with, None)
    lines = output.read_text().splitlines()
    assert f"argv {[str(scripts / 'job.py'), '--flag']}" in lines
    assert f"path0 {scripts}" in lines
    assert f"cwd {workdir}" in lines
    assert "rank 2 agent-only None" in lines  # the rank's environment, not the standby's
    assert "name __main__" in lines
    assert "interpreter-stdin True" in lines
    assert "warmed True" in lines  # `module:function` in the preload: imported and called before the hand-over
    assert "idle threads []" in lines  # the rank, and every thread the imports started, runs as a cold start would
    assert "autogroup nice 0" in lines  # in a group that weighs what a cold start's session does


def hold_until_released() -> None:
    """A warm-up that lasts until the file `RELEASE_FILE` names exists: an import still under way."""
    import time

    while not os.path.exists(os.environ["RELEASE_FILE"]):
        time.sleep(0.01)  # the standby's own import, polled: no test waits on it


async def _taken_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: str,
                       forked: bool) -> list[str]:
    """Take the job's standby while what `preload` holds is under way (`forked`: once the standby is forked, in its
    warm-up; else its parent still importing), check what was sped up, hand it rank 1, release the hold, and return
    the rank's output lines."""
    (tmp_path / "job.py").write_text(SCRIPT)
    released = tmp_path / "released"
    for key, value in environment().items():
        monkeypatch.setenv(key, value)
    entrypoint = Entrypoint(command=sys.executable, args=[str(tmp_path / "job.py")], cwd=str(tmp_path),
                            env={"RECOVERY_STANDBY_PRELOAD": preload, "RELEASE_FILE": str(released)})
    pool = StandbyPool(tmp_path / "runtime", enabled=True, preload="json", delay_s=0)
    (tmp_path / "runtime").mkdir()
    output = tmp_path / "runtime" / "job.rank1.gen1.log"
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.keep, "job", entrypoint)
            with anyio.fail_after(60):
                while not pool._standbys.get("job") or (forked and pool._standbys["job"][0].pid is None):
                    await anyio.sleep(0.01)  # polling the pool until the standby is there (forked), with a deadline
            standby = pool.take("job", dict(os.environ))
            assert standby is not None and not standby.ready.is_set()
            parent = standby.process.parent.process.pid
            # promoted: its parent, which may still import what it is forked with, and the standby if forked
            for pid in [parent, standby.pid] if forked else [parent]:
                assert os.sched_getscheduler(pid) == os.sched_getscheduler(0)  # no longer SCHED_IDLE
                assert autogroup_nice(pid) == 0  # nor in a group of the least weight
            assert forked or standby.pid is None
            env = {**environment(), "RANK": "1", "EXIT_WITH": "3"}
            started: list[ranks.RankProcess] = []

            async def start() -> None:
                started.append(await ranks.start(entrypoint, env, output, job="job", rank=1, attempt=1,
                                                 standby=standby))

            tg.start_soon(start)
            released.touch()  # the hold ends: it is forked (if it was not), warms up and reads the hand-over
            with anyio.fail_after(60):
                while not started:
                    await anyio.sleep(0.01)  # polling for the hand-over's end, with the deadline above
            [proc] = started
            assert proc.pid == standby.pid and proc.pid != parent  # the forked standby became the rank
            tg.start_soon(ranks.reap, proc)
            with anyio.fail_after(60):
                await proc.ended.wait()
    finally:
        await pool.close()
    assert proc.status() == (3, None)  # its exit status, told by its parent
    return output.read_text().splitlines()


async def test_a_standby_still_warming_up_is_taken_at_full_speed_and_becomes_the_rank_once_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank is needed before its standby's warm-ups are done (a kill right after the job's start): the standby is
    taken all the same, every thread of it switched from SCHED_IDLE to SCHED_OTHER, and it becomes the rank once its
    warm-ups end: a head start on a cold interpreter, never a standby killed half way."""
    lines = await _taken_early(tmp_path, monkeypatch, "json,tests.test_standby:hold_until_released", forked=True)
    assert "rank 1 agent-only None" in lines and "name __main__" in lines and "idle threads []" in lines, lines
    assert "autogroup nice 0" in lines, lines


async def test_a_standby_whose_parent_still_imports_is_taken_and_forked_once_the_imports_are_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken before its parent's imports are done: the parent goes on at full speed, forks the standby once they
    are, and the standby becomes the rank (in a session of its own, at full speed) with its exit status told."""
    lines = await _taken_early(tmp_path, monkeypatch, "json,tests.standby_hold", forked=False)
    assert "rank 1 agent-only None" in lines and "name __main__" in lines and "idle threads []" in lines, lines
    assert "autogroup nice 0" in lines, lines


async def test_an_idle_standby_ends_with_its_pool(tmp_path: Path) -> None:
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"], env={"PYTHONPATH": environment()["PYTHONPATH"]})
    pool = StandbyPool(tmp_path, enabled=True, preload="json", delay_s=0)
    with anyio.fail_after(60):
        await pool.keep("job", entrypoint)
    [standby] = pool._standbys["job"]
    pids = [standby.pid, standby.process.parent.process.pid]
    await pool.close()
    with anyio.fail_after(30):
        while any(ranks.start_time(pid) is not None for pid in pids if pid is not None):
            await anyio.sleep(0.01)  # polling until the standby and its parent are gone, with a deadline
    assert pool.take("job", dict(os.environ)) is None
    await pool.keep("job", entrypoint)  # closed for good: no other standby starts
    assert pool.take("job", dict(os.environ)) is None and "job" not in pool._standbys


def test_how_many_standbys_a_job_keeps() -> None:
    assert [standbys_wanted(choice, enabled, 4) for choice, enabled in
            ((None, False), (None, True), ("0", True), ("no", True), ("1", False), ("3", False), ("9", False),
             ("all", False), ("yes", False))] == [0, 2, 0, 0, 1, 3, 4, 4, 1]
    # by default two per node, so that two ranks lost together both start warm; one where the job has one rank
    assert (standbys_wanted(None, True, 1), standbys_wanted(None, True, 8)) == (1, 2)


async def test_a_job_that_wants_two_standbys_keeps_two_and_hands_them_over(tmp_path: Path) -> None:
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"],
                            env={"PYTHONPATH": environment()["PYTHONPATH"], "RECOVERY_STANDBY": "all"})
    pool = StandbyPool(tmp_path, enabled=False, preload="json", delay_s=0)
    assert pool.wanted(entrypoint, local_ranks=2) == 2
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(pool.keep, "job", entrypoint, 2)
            await pool.keep("job", entrypoint, 2)  # already two: no third
        assert len(pool._standbys["job"]) == 2
        first, second = pool.take("job", dict(os.environ)), pool.take("job", dict(os.environ))
        assert first is not None and second is not None and first.pid != second.pid
        # forked from one parent, which imported once for both: their imports' pages and CPU time paid once
        assert first.process.parent is second.process.parent
        assert first.process.parent.process.pid not in (first.pid, second.pid)
        assert pool.take("job", dict(os.environ)) is None
        for standby in (first, second):
            await standby.close()
    finally:
        await pool.close()


def test_several_ranks_on_a_node_get_one_thread_each_unless_the_job_or_the_agent_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As torchrun: a rank's intra-op pool sized to every core of the node would oversubscribe them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    placement = ranks.Placement(rank=1, local_rank=1, world_size=4, local_world_size=2, group_rank=0,
                                group_world_size=2)
    alone = dataclasses.replace(placement, local_rank=0, local_world_size=1, world_size=2)

    def env_of(entrypoint: Entrypoint, where: ranks.Placement) -> dict[str, str]:
        return ranks.environment(entrypoint, where, job="j", node="n0", attempt=0, plan=None, store_addr="h",
                                 store_port=1, torch_port=2, socket=tmp_path / "s", heartbeat_s=1.0)

    script = Entrypoint(command=sys.executable, args=["train.py"])
    assert env_of(script, placement)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env_of(script, alone)  # one rank here: torch's own default
    assert env_of(script.model_copy(update={"env": {"OMP_NUM_THREADS": "8"}}), placement)["OMP_NUM_THREADS"] == "8"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert env_of(script, placement)["OMP_NUM_THREADS"] == "4"


async def test_a_standby_of_a_node_of_several_ranks_imports_torch_with_the_ranks_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sizes its pool when it is imported, before the hand-over: the standby must start with the thread count
    the rank it becomes gets, or a warm restart computes with other threads than the cold ranks beside it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"], env={"PYTHONPATH": environment()["PYTHONPATH"]})
    pool = StandbyPool(tmp_path, enabled=True, preload="json", delay_s=0)
    try:
        with anyio.fail_after(60):
            await pool.keep("job", entrypoint, 1, local_ranks=2)
            await pool.keep("single", entrypoint, 1, local_ranks=1)
        [several], [single] = pool._standbys["job"], pool._standbys["single"]

        def environ(pid: int) -> dict[str, str]:
            pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)

        assert environ(several.pid).get("OMP_NUM_THREADS") == "1"
        assert "OMP_NUM_THREADS" not in environ(single.pid)
    finally:
        await pool.close()


THREADS = """
import torch
print("threads", torch.get_num_threads(), "env", __import__("os").environ.get("OMP_NUM_THREADS"))
"""


async def test_a_standby_becomes_only_a_rank_whose_thread_settings_it_imported_torch_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby of a node with one rank of the job imported torch with every core in its pool; a rank whose
    environment says OMP_NUM_THREADS=1 (a node of two ranks after a move) handed to it would still compute with two
    threads, where its cold start computes with one: it starts cold instead."""
    for name in THREAD_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "job.py").write_text(THREADS)
    entrypoint = Entrypoint(command=sys.executable, args=[str(tmp_path / "job.py")],
                            env={"PYTHONPATH": environment()["PYTHONPATH"]})
    pool = StandbyPool(tmp_path, enabled=True, preload="torch", delay_s=0)
    one_thread = {**os.environ, **entrypoint.env, "OMP_NUM_THREADS": "1"}
    async with anyio.create_task_group() as tg:
        try:
            with anyio.fail_after(120):
                await pool.keep("job", entrypoint, 1, local_ranks=1)
                assert pool.take("job", one_thread) is None  # imported with the node's cores: not this rank's
                cold = await ranks.start(entrypoint, one_thread, tmp_path / "cold.log", job="job", rank=0, attempt=1,
                                         standby=None)
                [standby] = pool._standbys["job"]
                # what a hand-over regardless of the settings would run: the rank's environment, the standby's pool
                mismatched = await ranks.start(entrypoint, one_thread, tmp_path / "warm.log", job="job", rank=0,
                                               attempt=1, standby=standby)
                for proc in (cold, mismatched):
                    tg.start_soon(ranks.reap, proc)
                    await proc.ended.wait()
        finally:
            await pool.close()

    def threads(log: str) -> str:
        [line] = [line for line in (tmp_path / log).read_text().splitlines() if line.startswith("threads ")]
        return line

    assert threads("cold.log") == "threads 1 env 1"
    assert threads("warm.log") == f"threads {torch_default_threads()} env 1"  # the node's cores: the pool's


def torch_default_threads() -> int:
    """torch's pool where nothing sizes it (this test's own process may have imported torch otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_SETTINGS}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


def test_a_spare_keeps_one_standby_for_each_rank_of_a_node_unless_the_job_says() -> None:
    def entrypoint(**env: str) -> Entrypoint:
        return Entrypoint(command=sys.executable, args=["job.py"], env=env)

    on, off = (StandbyPool(Path("/nonexistent"), enabled=e, preload="json", delay_s=0) for e in (True, False))
    # a lost node's ranks all move to the spare together: every one of them starts warm
    assert [on.spare_wanted(entrypoint(), rpn) for rpn in (1, 4, 8)] == [1, 4, 8]
    assert off.spare_wanted(entrypoint(), 8) == 0
    assert [off.spare_wanted(entrypoint(RECOVERY_STANDBY=c), 8) for c in ("all", "2", "0")] == [8, 2, 0]
    assert on.spare_wanted(Entrypoint(command="bash", args=["run.sh"]), 8) == 0  # nothing to hand over


async def test_a_spare_warms_for_its_newest_jobs_and_drops_an_older_ones_standbys(tmp_path: Path) -> None:
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"], env={"PYTHONPATH": environment()["PYTHONPATH"]})
    pool = StandbyPool(tmp_path, enabled=True, preload="json", delay_s=0)
    try:
        assert pool.warm_for("a", 1) == []
        with anyio.fail_after(60):
            await pool.keep("a", entrypoint, 1, idle=False)
        [standby] = pool._standbys["a"]
        assert os.sched_getscheduler(standby.pid) == os.sched_getscheduler(0)  # beside no rank: at full speed
        assert pool.warm_for("b", 1) == ["a"] and pool.warm_for("b", 1) == []  # a job warmed again stays
        pids = [standby.pid, standby.process.parent.process.pid]
        await pool.drop("a")
        assert "a" not in pool._standbys
        with anyio.fail_after(30):
            while any(ranks.start_time(pid) is not None for pid in pids if pid is not None):
                await anyio.sleep(0.01)  # polling until the standby and its parent are gone, with a deadline
        pool.delay_s = 0.5
        async with anyio.create_task_group() as tg:  # a keep asked before the drop, due after it: starts nothing
            tg.start_soon(pool.keep, "a", entrypoint, 1)
            await anyio.wait_all_tasks_blocked()
            await pool.drop("a")
        assert "a" not in pool._standbys
        pool.delay_s = 0
        with anyio.fail_after(60):
            await pool.keep("a", entrypoint, 1)  # asked again (the spare granted to it): warm again
        assert len(pool._standbys["a"]) == 1
        assert pool.warm_for("c", 2) == [] and pool.warm_for("d", 2) == ["b"]
    finally:
        await pool.close()


def test_a_job_whose_faults_restart_every_rank_keeps_one_for_each_rank_here_by_default() -> None:
    pool = StandbyPool(Path("/nonexistent"), enabled=True, preload="json", delay_s=0)
    stock = Entrypoint(command=sys.executable, args=["job.py"])
    assert [pool.wanted(stock, 4, whole=w) for w in (False, True)] == [2, 4]
    assert pool.wanted(Entrypoint(command=sys.executable, args=["job.py"], env={"RECOVERY_STANDBY": "1"}), 4,
                       whole=True) == 1  # the job's word rules
    assert StandbyPool(Path("/nonexistent"), enabled=False, preload="json", delay_s=0).wanted(stock, 4, True) == 0


async def test_standbys_start_once_the_ranks_stepped_as_many_as_wanted_then_and_trimmed_when_fewer_are(
        tmp_path: Path) -> None:
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"], env={"PYTHONPATH": environment()["PYTHONPATH"]})
    pool = StandbyPool(tmp_path, enabled=True, preload="json", delay_s=3600)  # only the step ends the wait
    wanted, asked = [3], []
    stepped = anyio.Event()

    def count() -> int:
        asked.append(wanted[0])
        return wanted[0]

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(4):  # one per rank here; as many start as wanted once they may
                    tg.start_soon(pool.keep, "job", entrypoint, count, 4, stepped)
                await anyio.wait_all_tasks_blocked()
                assert not asked and "job" not in pool._standbys  # the ranks' start-up first
                stepped.set()
        assert len(asked) == 4 and len(pool._standbys["job"]) == 3
        extra = pool.trim("job", 2)  # it said it recovers in place: the default two
        assert len(extra) == 1 and len(pool._standbys["job"]) == 2 and pool.trim("job", 2) == []
        for standby in extra:
            await standby.close()
    finally:
        await pool.close()


WAITING_SCRIPT = """
import os, sys, time
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.01)  # the rank's own wait, polled: no test sleeps on it
sys.exit(5)
"""


async def test_a_forked_rank_s_status_comes_from_its_parent_and_its_end_is_seen_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent is not a forked rank's parent: the standby parent tells its exit status (a signal too); a parent
    gone first leaves the status unknown, and the rank's end is still seen (as an adopted rank's is)."""
    (tmp_path / "job.py").write_text(WAITING_SCRIPT)
    for key, value in environment().items():
        monkeypatch.setenv(key, value)
    entrypoint = Entrypoint(command=sys.executable, args=[str(tmp_path / "job.py")], cwd=str(tmp_path))
    pool = StandbyPool(tmp_path / "runtime", enabled=True, preload="json", delay_s=0)
    (tmp_path / "runtime").mkdir()
    try:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(60):
                await pool.keep("job", entrypoint, 2)
                await pool.keep("job", entrypoint, 2)
            procs = []
            for rank in (0, 1):
                standby = pool.take("job", dict(os.environ))
                assert standby is not None
                env = {**environment(), "GO_FILE": str(tmp_path / f"go{rank}")}
                proc = await ranks.start(entrypoint, env, tmp_path / f"rank{rank}.log", job="job", rank=rank,
                                         attempt=1, standby=standby)
                tg.start_soon(ranks.reap, proc)
                procs.append(proc)
            killed, orphaned = procs
            parent = killed.process.parent  # type: ignore[union-attr]
            assert orphaned.process.parent is parent  # type: ignore[union-attr]
            killed.signal(signal.SIGKILL)
            with anyio.fail_after(60):
                await killed.ended.wait()
            assert killed.status() == (None, signal.SIGKILL)  # told by the parent
            os.kill(parent.process.pid, signal.SIGKILL)  # the parent goes first: nobody to tell the other's
            with anyio.fail_after(60):
                await parent.process.wait()
            (tmp_path / "go1").touch()
            with anyio.fail_after(60):
                await orphaned.ended.wait()  # seen all the same
            assert orphaned.returncode is None
    finally:
        await pool.close()


async def test_the_end_of_a_process_not_the_agents_child_is_seen_without_pidfds_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.3 has no pidfds: the end is read from /proc instead, and a zombie counts as ended."""
    from recovery.agent import standby_parent

    def no_pidfds(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        async with anyio.create_task_group() as tg:
            gone = anyio.Event()

            async def wait() -> None:
                await standby_parent.until_gone(sleeper.pid, poll_s=0.01)
                gone.set()

            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            assert not gone.is_set()  # still running
            assert sleeper.stdin is not None
            sleeper.stdin.close()  # it ends, a zombie until reaped below
            with anyio.fail_after(30):
                await gone.wait()
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_a_standby_that_found_no_idle_cpu_time_for_standby_idle_s_goes_on_at_a_ranks_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose ranks keep every core busy leaves a standby no idle CPU time: past the agent's `standby_idle_s`
    its parent (still importing here) and the standby once forked go on at a rank's weight, or it might never be
    ready. A job's `RECOVERY_STANDBY_IDLE=0` has them at full speed from the start."""
    released = tmp_path / "released"
    for key, value in environment().items():
        monkeypatch.setenv(key, value)
    entrypoint = Entrypoint(command=sys.executable, args=["job.py"], cwd=str(tmp_path),
                            env={"RECOVERY_STANDBY_PRELOAD": "json,tests.standby_hold", "RELEASE_FILE": str(released)})
    pool = StandbyPool(tmp_path / "runtime", enabled=True, preload="json", delay_s=0, idle_s=0.2)
    (tmp_path / "runtime").mkdir()
    promoted = anyio.Event()  # nothing else promotes this standby: nobody takes it
    promote = Standby.promote

    def recorded(standby: Standby) -> None:
        promote(standby)
        promoted.set()

    monkeypatch.setattr(Standby, "promote", recorded)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.keep, "job", entrypoint)
            with anyio.fail_after(60):
                while not pool._standbys.get("job"):
                    await anyio.sleep(0.01)  # polling the pool until the standby is asked for, with a deadline
            [standby] = pool._standbys["job"]
            parent = standby.process.parent.process.pid
            with anyio.fail_after(60):
                await promoted.wait()  # the idle time is up, the parent still importing (held)
            assert os.sched_getscheduler(parent) == os.sched_getscheduler(0) and autogroup_nice(parent) == 0
            released.touch()
            with anyio.fail_after(60):
                await standby.ready.wait()
            assert standby.pid is not None and os.sched_getscheduler(standby.pid) == os.sched_getscheduler(0)
            assert autogroup_nice(standby.pid) == 0
        opted_out = entrypoint.model_copy(update={"env": {**entrypoint.env, "RECOVERY_STANDBY_IDLE": "0"}})
        fast = StandbyPool(tmp_path / "runtime", enabled=True, preload="json", delay_s=0, idle_s=3600)
        try:
            with anyio.fail_after(60):
                await fast.keep("other", opted_out)
            [other] = fast._standbys["other"]
            assert other.pid is not None and os.sched_getscheduler(other.pid) == os.sched_getscheduler(0)
        finally:
            await fast.close()
    finally:
        await pool.close()

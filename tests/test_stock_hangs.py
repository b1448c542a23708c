"""Hangs of a stock script seen from outside its processes (`recovery.agent.probes.hang`): a stopped rank, and a
still one outside a collective while a peer waits in one; never a slow first step nor a long checkpoint save."""

from __future__ import annotations

from pathlib import Path

from recovery.agent.probes.hang import HangRules, ProcSample, in_collective, read_sample

IN_ALLREDUCE = ("Thread 1 (idle): \"MainThread\"\n    all_reduce (torch/distributed/distributed_c10d.py:2801)\n"
                "    train (train.py:40)\n")
IN_BACKWARD = ("Thread 1 (idle): \"MainThread\"\n    _engine_run_backward (torch/autograd/graph.py:829)\n"
               "    backward (torch/_tensor.py:647)\n    train (train.py:38)\n")
ON_A_LOCK = "Thread 1 (idle): \"MainThread\"\n    acquire (threading.py:320)\n    load (data.py:12)\n"
SAVING = "Thread 1 (active): \"MainThread\"\n    save (torch/serialization.py:967)\n    train (train.py:50)\n"


def write_proc(root: Path, pid: int, state: str, utime: int, stime: int = 0, io: int | None = 0,
               children: list[int] | None = None) -> None:
    """A made-up /proc/<pid>: stat (its command name with a space and a parenthesis, as a script's may be), io, and
    the children of its main task."""
    directory = root / str(pid)
    (directory / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
    rest = [state, "1", str(pid), str(pid), "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime)] + ["0"] * 30
    (directory / "stat").write_text(f"{pid} (python t) x) {' '.join(rest)}\n")
    if io is not None:
        (directory / "io").write_text(f"rchar: {io}\nwchar: 0\nsyscr: 1\n")
    (directory / "task" / str(pid) / "children").write_text(" ".join(map(str, children or [])))


def sample(pid: int, state: str = "S", cpu: int = 0, io: int | None = 0) -> ProcSample:
    return ProcSample(pid, state, cpu, io)


def test_proc_is_read_with_the_children_of_a_launcher(tmp_path: Path) -> None:
    write_proc(tmp_path, 100, "S", 5, 2, io=10, children=[101])
    write_proc(tmp_path, 101, "T", 40, 3, io=7)
    assert read_sample(100, tmp_path) == ProcSample(100, "T", 50, 17)
    write_proc(tmp_path, 200, "Z", 1)
    assert read_sample(200, tmp_path) is None and read_sample(999, tmp_path) is None


def test_a_sigstopped_rank_is_found_after_stopped_s_once_and_a_continued_one_is_not() -> None:
    rules = HangRules(stopped_s=10, still_s=45)
    assert rules.observe(0, {0: sample(10, cpu=5), 1: sample(11, "T", 7)}) == []
    assert rules.observe(9, {0: sample(10, cpu=6), 1: sample(11, "T", 7)}) == []
    [found] = rules.observe(10, {0: sample(10, cpu=7), 1: sample(11, "T", 7)})
    assert found.rank == 1 and found.seconds == 10 and "SIGSTOP" in found.cause
    assert rules.observe(30, {0: sample(10, cpu=8), 1: sample(11, "T", 7)}) == [], "reported once"
    other = HangRules(stopped_s=10, still_s=45)
    other.observe(0, {1: sample(11, "T", 7)})
    other.observe(6, {1: sample(11, "S", 8)})  # continued (a debugger's stop, ^Z then fg)
    assert other.observe(12, {1: sample(11, "T", 8)}) == [] and other.observe(22, {1: sample(11, "T", 8)})
    assert HangRules().observe(0, {1: sample(11, "t", 7)}) == [] and not HangRules(stopped_s=1).observe(
        5, {1: sample(11, "t", 7)}), "py-spy's or a debugger's ptrace stop is no hang"


def test_a_new_process_of_the_rank_starts_afresh() -> None:
    rules = HangRules(stopped_s=10)
    rules.observe(0, {1: sample(11, "T", 7)})
    assert rules.observe(10, {1: sample(12, "T", 0)}) == [], "the restarted process was stopped only now"


def still_job(rules: HangRules, stacks: dict[int, str], until: float, moving: int | None = None,
              state: str = "S") -> list[int]:
    """Ranks 0 and 1 polled every 2 s until `until`, rank `moving`'s CPU advancing; the ranks found hung."""
    found = []
    for tick in range(0, int(until) + 1, 2):
        samples = {r: sample(10 + r, state if r == 0 else "S", cpu=tick if r == moving else 5) for r in (0, 1)}
        found += [s.rank for s in rules.observe(tick, samples)]
        if rules.still(tick, rules.still_s / 2):
            found += [s.rank for s in rules.judge_still(tick, stacks)]
    return found


def test_a_still_rank_outside_a_collective_while_its_peer_waits_in_one_hangs_within_a_minute() -> None:
    assert still_job(HangRules(still_s=45), {0: ON_A_LOCK, 1: IN_ALLREDUCE}, 60) == [0]
    assert still_job(HangRules(still_s=45), {0: ON_A_LOCK, 1: IN_BACKWARD}, 60) == [0]  # DDP's wait
    assert still_job(HangRules(still_s=45), {0: ON_A_LOCK, 1: IN_ALLREDUCE}, 40) == [], "not before still_s"


def test_no_false_alarm_on_a_slow_first_step_a_checkpoint_save_or_every_rank_waiting() -> None:
    # rank 0 compiles its first step or saves a checkpoint: its CPU or I/O moves; rank 1 waits in a collective
    assert still_job(HangRules(still_s=45), {0: SAVING, 1: IN_ALLREDUCE}, 300, moving=0) == []
    # a save blocked in the kernel on a slow disk: uninterruptible, not hung
    assert still_job(HangRules(still_s=45), {0: SAVING, 1: IN_ALLREDUCE}, 300, state="D") == []
    # every rank here waits in a collective (the one to blame is elsewhere, and its own agent sees it)
    assert still_job(HangRules(still_s=45), {0: IN_ALLREDUCE, 1: IN_ALLREDUCE}, 300) == []
    # still, outside a collective, but no peer waits: a script that sleeps, or a job of one rank here
    assert still_job(HangRules(still_s=45), {0: ON_A_LOCK, 1: ON_A_LOCK}, 300) == []


def test_a_stack_that_moved_between_the_looks_is_no_hang() -> None:
    rules = HangRules(still_s=45)
    found = []
    for tick in range(0, 61, 2):
        rules.observe(tick, {0: sample(10), 1: sample(11)})
        if rules.still(tick, 22.5):
            stack = ON_A_LOCK if tick < 40 else SAVING.replace("active", "idle")  # it went on, without CPU time
            found += rules.judge_still(tick, {0: stack, 1: IN_ALLREDUCE})
    assert found == []


def test_collectives_are_told_from_other_waits() -> None:
    assert in_collective(IN_ALLREDUCE) and in_collective(IN_BACKWARD)
    assert not in_collective(ON_A_LOCK) and not in_collective(SAVING)

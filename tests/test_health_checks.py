"""The node's health checks (`recovery.agent.checks`): each within its budget, what each saw, a pass that answers
the gate while fresh and no longer after a fault, one run for callers that ask at once, which checks a node runs,
and the agent's gate refusing ranks on a node that fails. The GPU checks run on a GPU (marked `gpu`); `collective`
on gloo runs here."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from events.commands import MigrateRanks
from events.health import NodeChecked
from events.values import ResumePlan
from recovery.agent.agent import Agent
from recovery.agent.checks.gpu import collective_check, gpu_compute_check, gpu_state_check
from recovery.agent.checks.host import command_check, disk_check, free_memory, memory_check
from recovery.agent.checks.runner import Check, ChecksFailed, HealthChecks, Seen
from recovery.agent.checks.selection import node_checks
from recovery.agent.config import AgentConfig, load
from recovery.settings import ConfigError

NO_GPU = Path("/nonexistent/nvidia0")


class Published:
    """The node events a `HealthChecks` publishes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, data: dict[str, Any]) -> None:
        self.events.append((type_, data))

    def checked(self) -> list[NodeChecked]:
        return [NodeChecked.model_validate(data) for type_, data in self.events if type_ == "node.checked"]


class Gated:
    """A check that passes or fails as told, once released (released at once unless `held`), counting its runs."""

    def __init__(self, ok: bool = True, held: bool = False) -> None:
        self.ok = ok
        self.runs = 0
        self.waiting = 0
        self.release: anyio.Event | None = None
        self.held = held

    async def __call__(self) -> Seen:
        self.runs += 1
        if self.held:
            self.release = self.release or anyio.Event()
            self.waiting += 1
            await self.release.wait()
        return Seen(self.ok, "as told")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(condition: Any, what: str, timeout: float = 10.0) -> None:
    """Wait for `condition` with a deadline (polling: the checks run on their own tasks)."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.005)  # polling interval of a deadline-bounded wait
    assert condition(), what


def result(record: NodeChecked | None, name: str) -> Any:
    assert record is not None
    [found] = [r for r in record.results if r.check == name]
    return found


# -- each check -------------------------------------------------------------------------------------------------
async def test_a_check_past_its_budget_fails_saying_so() -> None:
    published = Published()
    health = HealthChecks("n0", [Check("slow", 0.05, anyio.sleep_forever), Check("quick", 5, Gated())], published,
                          fresh_s=60)
    started = time.monotonic()
    record = await health.run("join")
    assert time.monotonic() - started < 5
    assert record is not None and not record.ok
    assert result(record, "slow").saw == "took more than 0.05s" and result(record, "quick").ok
    assert published.checked() == [record]


async def test_a_failing_command_fails_with_the_end_of_its_output() -> None:
    check = command_check("nhc", "echo checking; echo 'ERROR: ib0 down' >&2; exit 3", 10)
    seen = await check.probe()
    assert not seen.ok and seen.saw == "exit 3: checking | ERROR: ib0 down"
    assert await command_check("fine", "echo all good", 10).probe() == Seen(True, "all good")


async def test_a_command_past_its_budget_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "child-lived"
    health = HealthChecks("n0", [command_check("hangs", f"(sleep 1; touch {marker}) & sleep 60", 0.2)], Published(),
                          fresh_s=60)
    started = time.monotonic()
    record = await health.run("join")
    assert time.monotonic() - started < 1
    assert result(record, "hangs").saw == "took more than 0.2s"
    with anyio.move_on_after(1.5):  # past the child's own sleep: it would have written the marker by now
        while not marker.exists():
            await anyio.sleep(0.05)  # polling the marker's absence, within the bound above
    assert not marker.exists()


async def test_the_disk_check_on_a_writable_directory_passes_and_names_its_figures(tmp_path: Path) -> None:
    directory = tmp_path / "cache"  # missing: the check makes it, as the ranks would
    seen = await disk_check(directory, 0.001, 0.001, 10).probe()
    assert seen.ok, seen.saw
    assert "free " in seen.saw and "GiB" in seen.saw and "MiB/s" in seen.saw
    assert list(directory.iterdir()) == []  # its file is gone


async def test_the_disk_check_fails_where_too_little_is_free_or_nothing_can_be_written(tmp_path: Path) -> None:
    seen = await disk_check(tmp_path, 1e9, 0.001, 10).probe()
    assert not seen.ok and "under 1e+09" in seen.saw
    blocked = tmp_path / "file"
    blocked.write_text("")
    seen = await disk_check(blocked / "below", 0.001, 0.001, 10).probe()  # a file where a directory should be
    assert not seen.ok


async def test_a_disk_slower_than_the_bound_twice_fails_and_leaves_no_file(tmp_path: Path) -> None:
    seen = await disk_check(tmp_path, 0.001, 1e9, 10).probe()  # no disk writes a million MiB/s, twice
    assert not seen.ok and "MiB/s, under 1e+09" in seen.saw, seen.saw
    assert list(tmp_path.iterdir()) == []


async def test_the_memory_check_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:     262144 kB\n")  # 0.25 GiB
    assert free_memory(0.5, meminfo) == Seen(False, "MemAvailable 0.25 GiB, under 0.5 GiB")
    assert free_memory(0.2, meminfo).ok
    assert (await memory_check(0.001, 5).probe()).ok  # this host's own


# -- the cache, the gate and faults ------------------------------------------------------------------------------
async def test_a_fresh_pass_answers_the_gate_without_a_new_run() -> None:
    check, clock, published = Gated(), Clock(), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=60, clock=clock)
    await health.run("join")
    assert await health.ready_for("j", "start") is None
    assert check.runs == 1 and len(published.checked()) == 1  # no record for an answer from the cache
    clock.now += 61  # no longer fresh: the gate runs them again
    assert await health.ready_for("j", "start") is None
    assert check.runs == 2 and [r.when for r in published.checked()] == ["join", "start"]


async def test_a_failed_run_is_never_fresh_and_the_gate_says_what_failed() -> None:
    check, published = Gated(ok=False), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=60)
    assert await health.ready_for("j", "start") == "c: as told"
    assert await health.ready_for("j", "start") == "c: as told"
    assert check.runs == 2 and [(r.when, r.job) for r in published.checked()] == [("start", "j"), ("start", "j")]
    with pytest.raises(ChecksFailed, match="health checks failed on n0: c: as told"):
        await health.gate("j")


async def test_a_fault_makes_the_pass_stale_and_runs_the_checks_at_once() -> None:
    check, published = Gated(), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=3600)
    publish = health.watching(published)
    async with anyio.create_task_group() as tg:
        tg.start_soon(health.serve)
        await until(lambda: len(published.checked()) == 1, "the checks at the agent's start")
        assert health.fresh()
        publish("device.fault", {"device": 0, "vendor": "nvidia", "code": "92", "message": "corrected ECC"})
        assert health.fresh()  # a wear signal, not a fault
        publish("network.link_down", {"link": "ib0"})
        assert not health.fresh()
        await until(lambda: len(published.checked()) == 2, "the checks after the fault")
        assert [r.when for r in published.checked()] == ["join", "fault"] and health.fresh()
        assert await health.ready_for("j", "start") is None and check.runs == 2  # the fault's run answers
        tg.cancel_scope.cancel()
    assert [t for t, _ in published.events] == ["node.checked", "device.fault", "network.link_down", "node.checked"]


async def test_an_idle_spare_keeps_its_pass_fresh_logging_only_what_changes() -> None:
    """A spare's checks run again every fresh_s / 2 while no rank runs there, so that a grant finds a fresh pass:
    a pass after a pass is not logged, a failure is (the engine takes the spare out), and so is the pass after it;
    beside running ranks nothing runs."""
    check, published = Gated(), Published()
    health = HealthChecks("s0", [Check("c", 5, check)], published, fresh_s=0.2, spare=True)
    idle, asked = [True], [0]

    def is_idle() -> bool:
        asked[0] += 1
        return idle[0]

    health.idle = is_idle
    async with anyio.create_task_group() as tg:
        tg.start_soon(health.serve)
        await until(lambda: check.runs >= 3, "two refreshes after the join")
        assert [r.when for r in published.checked()] == ["join"]  # passes after a pass: nothing logged
        check.ok = False
        await until(lambda: len(published.checked()) == 2, "the refresh that failed")
        check.ok = True
        await until(lambda: len(published.checked()) == 3, "the refresh that passed again")
        assert [(r.when, r.ok) for r in published.checked()] == [("join", True), ("spare", False), ("spare", True)]
        idle[0] = False  # ranks run here now: no check competes with them
        await until(lambda: health._inflight is None, "a refresh under way to end")
        runs, since = check.runs, asked[0]
        await until(lambda: asked[0] >= since + 2, "two refresh periods with the spare busy")
        assert check.runs == runs
        tg.cancel_scope.cancel()


async def test_two_gates_at_once_share_one_run() -> None:
    check, published = Gated(held=True), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=60)
    answers: list[str | None] = []

    async def gate(job: str) -> None:
        answers.append(await health.ready_for(job, "start"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(gate, "a")
        await until(lambda: check.waiting == 1, "the first run under way")
        tg.start_soon(gate, "b")
        await anyio.wait_all_tasks_blocked()  # the second caller waits on the first one's run
        assert check.release is not None
        check.release.set()
    assert answers == [None, None] and check.runs == 1 and len(published.checked()) == 1


async def test_a_run_started_before_a_fault_is_not_shared_after_it() -> None:
    check, published = Gated(held=True), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(health.run, "join")
        await until(lambda: check.waiting == 1, "the join run under way")
        health.faulted()
        tg.start_soon(health.ready_for, "j", "start")
        await anyio.wait_all_tasks_blocked()
        assert check.release is not None
        check.release.set()
        await until(lambda: check.runs == 2, "a run of its own after the fault")  # released already: it passes
    assert [r.when for r in published.checked()] == ["join", "start"] and health.fresh()


async def test_the_gate_runs_before_a_jobs_first_start_and_before_ranks_move_here() -> None:
    check, clock, published = Gated(), Clock(), Published()
    health = HealthChecks("n0", [Check("c", 5, check)], published, fresh_s=60, clock=clock)
    await health.gate("j")  # the first start of j's ranks here: a run
    clock.now += 120
    await health.gate("j")  # a restart in place, no fault since the pass: nothing to run
    assert check.runs == 1
    await health.gate("j", moved_here=True)  # ranks moved here: the pass is old, a run
    assert check.runs == 2 and [r.when for r in published.checked()] == ["start", "spare"]
    health.faulted()
    await health.gate("j")  # a restart after a fault the checks have not passed since
    assert check.runs == 3


# -- which checks a node runs ------------------------------------------------------------------------------------
def names(cfg: AgentConfig, tmp_path: Path) -> list[str]:
    return [check.name for check in node_checks(cfg, None, [tmp_path / "shm", None], gpu_device=NO_GPU)]


def test_off_runs_nothing_and_announces_nothing(tmp_path: Path) -> None:
    cfg = load(node="n0", health_check="off", checks='[{"name": "nhc", "command": "true"}]')
    assert names(cfg, tmp_path) == []
    health = HealthChecks("n0", [], Published(), fresh_s=60)
    assert health.announcement() == {}
    assert anyio.run(health.run, "join") is None and anyio.run(health.ready_for, "j", "start") is None


def test_a_cpu_node_runs_memory_disks_and_commands_and_leaves_the_gpu_checks_out(tmp_path: Path) -> None:
    cfg = load(node="n0", check_dirs=f"{tmp_path / 'scratch'},{tmp_path / 'shm'}",
               checks='[{"name": "nhc", "command": "true", "budget_s": 5}]')
    assert names(cfg, tmp_path) == ["memory", f"disk:{tmp_path / 'shm'}", f"disk:{tmp_path / 'scratch'}", "nhc"]


async def test_a_gpu_check_on_a_cpu_node_with_health_check_on_fails(tmp_path: Path) -> None:
    cfg = load(node="n0", health_check="on")
    checks = node_checks(cfg, None, [], gpu_device=NO_GPU)
    assert [c.name for c in checks] == ["memory", "gpu-state", "gpu-compute", "collective"]
    for check in checks[1:3]:
        seen = await check.probe()
        assert not seen.ok and "no GPU found" in seen.saw


def test_the_default_on_a_cpu_node_is_cheap(tmp_path: Path) -> None:
    cfg = load(node="n0", runtime_dir=tmp_path, memory_dir=tmp_path / "shm")
    health = HealthChecks("n0", node_checks(cfg, None, [cfg.memory_dir, tmp_path / "cache"], gpu_device=NO_GPU),
                          Published(), fresh_s=60)
    started = time.monotonic()
    record = anyio.run(health.run, "join")
    assert record is not None and record.ok, record
    assert time.monotonic() - started < 1.0


def test_checks_come_from_the_agents_toml_file(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('node = "n0"\ncheck_dirs = ["/scratch"]\n\n[[checks]]\nname = "nhc"\ncommand = "nhc -t 60"\n'
                      'budget_s = 90\n\n[[checks]]\nname = "ib-port"\ncommand = "ibstat"\n')
    cfg = load(SimpleNamespace(config=str(config)))  # type: ignore[arg-type]
    assert [(c.name, c.command, c.budget_s) for c in cfg.checks] == [("nhc", "nhc -t 60", 90.0),
                                                                    ("ib-port", "ibstat", 30.0)]
    assert cfg.check_dirs == [Path("/scratch")]
    with pytest.raises(ConfigError, match="checks"):
        load(node="n0", checks='[{"name": "a", "command": "x"}, {"name": "a", "command": "y"}]')


# -- the agent's gate ----------------------------------------------------------------------------------------------
class Outbox:
    def __init__(self) -> None:
        self.put_: list[tuple[str, bytes]] = []

    def put(self, subject: str, data: bytes, msg_id: str, heartbeat: bool = False) -> None:
        self.put_.append((subject, data))


async def test_ranks_moved_to_a_node_that_fails_its_checks_are_not_started_and_the_ack_says_why(
        tmp_path: Path) -> None:
    cfg = load(node="n1", runtime_dir=tmp_path, memory_dir=tmp_path / "shm",
               checks='[{"name": "nhc", "command": "echo GPU 3 missing; exit 1"}]')
    agent = Agent(cfg)
    outbox = Outbox()
    agent.outbox = outbox  # type: ignore[assignment]
    agent.jobs["j"] = SimpleNamespace(id="j", nodes=["n0"], processes={})  # type: ignore[assignment]
    command = MigrateRanks(id="c1", job="j", attempt=1, deadline_s=60, ranks=[0], from_node="n0", to_node="n1",
                           plan=ResumePlan(checkpoint_step=None, next_step=0))
    await agent._carry_out_once(command)
    said = [data.decode() for _, data in outbox.put_]
    assert any('"node.checked"' in s and '"when":"spare"' in s and "GPU 3 missing" in s for s in said)
    [failed] = [s for s in said if '"status":"failed"' in s]
    assert "health checks failed on n1: nhc: exit 1: GPU 3 missing" in failed
    assert agent.jobs["j"].nodes == ["n0"]  # nothing changed: the ranks were not placed here


# -- on a GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
async def test_gpu_state_reads_the_real_gpus(tmp_path: Path) -> None:
    seen = await gpu_state_check(None, 30).probe()
    assert seen.ok or seen.saw.startswith("GPU "), seen  # each GPU judged, not "neither NVML nor nvidia-smi"
    cfg = load(node="n0")
    assert [c.name for c in node_checks(cfg, None, [tmp_path])][-3:] == ["gpu-state", "gpu-compute", "collective"]


@pytest.mark.gpu
async def test_gpu_compute_passes_on_a_good_gpu() -> None:
    seen = await gpu_compute_check("", 120).probe()
    assert seen.ok and "GPU(s)" in seen.saw, seen


@pytest.mark.gpu
async def test_the_loopback_collective_on_nccl_passes() -> None:
    seen = await collective_check("", "nccl", 180).probe()
    assert seen.ok and "nccl" in seen.saw, seen


async def test_the_loopback_collective_on_gloo_passes() -> None:
    pytest.importorskip("torch")
    seen = await collective_check("", "gloo", 120).probe()
    assert seen.ok and "over 2 process(es) on gloo" in seen.saw, seen

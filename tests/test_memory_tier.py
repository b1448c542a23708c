"""The in-memory checkpoint tier's parts on their own: the SDK's copy into shared memory and its reading back
(`recovery.client.memory`), and the agent's side (`recovery.agent.memory`): the report of each tier, the persisting
in the background, the files handed back for reuse and the memory removed at the job's end."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from recovery.agent.memory import MemoryTier, memory_root
from recovery.client import Client, ResumePlan, ShardSource
from recovery.client.memory import MemorySlots, file_name, read_state, restore, storage_name, write_state
from tests.e2e_support import wait_until


def trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "odd": [torch.tensor(True), torch.zeros(0), torch.arange(10)[::2], torch.tensor(3.5, dtype=torch.float64)]}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_a_state_copied_into_memory_reads_back_bit_for_bit(tmp_path: Path) -> None:
    state = trained_state()
    path = tmp_path / file_name(20, 0, 1)
    write_state(state, path)
    assert_same(state, read_state(path))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


def test_one_off_writes_in_one_directory_leave_each_others_files_alone(tmp_path: Path) -> None:
    """The ranks of a job (or a tool's threads) writing their states into one directory at once: a write in the
    middle of its copy keeps its file while another starts, and neither takes a rank's slot for its own."""
    mid_copy = tmp_path / ".slot.rank-1.999999.1"  # how another process's write named its file
    mid_copy.write_bytes(b"")
    rank_slot = tmp_path / ".slot.rank0.999999.1"
    rank_slot.write_bytes(b"")
    threads = [threading.Thread(target=write_state, args=({"w": torch.full((64,), float(i))},
                                                          tmp_path / storage_name(3, i))) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert mid_copy.exists() and rank_slot.exists()
    for i in range(4):
        assert torch.equal(read_state(tmp_path / storage_name(3, i))["w"], torch.full((64,), float(i)))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(
        [mid_copy.name, rank_slot.name])  # no temporary left


def test_a_slot_handed_back_by_the_agent_is_written_again_in_place(tmp_path: Path) -> None:
    """The second save reuses the first one's file (its pages, and its mapping): no new allocation."""
    slots = MemorySlots(tmp_path, 3, prepare=False)
    state = {"w": torch.randn(1000)}
    first = tmp_path / file_name(10, 0, 3)
    slots.write(state, first)
    inode = first.stat().st_ino
    first.rename(tmp_path / ".free.rank3.agent000001")  # what the agent does once a newer one exists
    state["w"] += 1
    second = tmp_path / file_name(20, 0, 3)
    slots.write(state, second)
    assert second.stat().st_ino == inode and not first.exists()
    assert_same(state, read_state(second))
    slots.close()


def test_the_second_slot_is_allocated_in_the_background_and_the_second_save_writes_into_it(tmp_path: Path) -> None:
    """The newest checkpoint keeps its file until a newer one exists: the second save needs a second file, which is
    ready by then (its pages allocated off the training thread)."""
    slots = MemorySlots(tmp_path, 0)
    slots.write({"w": torch.zeros(1000)}, tmp_path / file_name(10, 0, 0))
    assert slots._preparing is not None
    slots._preparing.join()
    [prepared] = tmp_path.glob(".free.rank0.*")
    inode = prepared.stat().st_ino
    slots.write({"w": torch.ones(1000)}, tmp_path / file_name(20, 0, 0))
    assert (tmp_path / file_name(20, 0, 0)).stat().st_ino == inode
    assert torch.equal(read_state(tmp_path / file_name(20, 0, 0))["w"], torch.ones(1000))
    assert torch.equal(read_state(tmp_path / file_name(10, 0, 0))["w"], torch.zeros(1000))
    slots.close()


def test_a_slot_left_by_a_dead_process_of_the_rank_is_reused(tmp_path: Path) -> None:
    (tmp_path / ".slot.rank1.999.0").write_bytes(b"half a copy")
    slots = MemorySlots(tmp_path, 1, prepare=False)
    slots.write({"w": torch.ones(3)}, tmp_path / file_name(5, 0, 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(5, 0, 1)]
    slots.close()


def test_restore_reads_this_nodes_memory_else_the_persisted_copy(tmp_path: Path) -> None:
    memory, storage = tmp_path / "memory", tmp_path / "storage"
    memory.mkdir()
    storage.mkdir()
    write_state({"w": torch.ones(2)}, memory / file_name(10, 0, 3))
    write_state({"w": torch.full((2,), 2.0)}, storage / storage_name(10, 0))
    here = restore(10, 0, "memory", ["n0", "n1"], "n1", memory, storage)
    assert here is not None and here.tier == "memory" and here.path.parent == memory
    elsewhere = restore(10, 0, "memory", ["n0"], "n1", memory, storage)  # the memory copy is on another node
    assert elsewhere is not None and elsewhere.tier == "storage" and torch.equal(elsewhere.state["w"],
                                                                                torch.full((2,), 2.0))
    assert restore(10, 0, "peer", ["n0"], "n1", memory, storage) is None
    assert restore(15, 0, "memory", ["n1"], "n1", memory, storage) is None


def test_save_async_without_an_agent_memory_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOVERY_MEMORY_DIR", raising=False)
    assert Client(None, 0).save_async({"w": torch.ones(1)}, 5) is None


def test_a_client_restores_the_memory_checkpoint_its_plan_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVERY_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("RECOVERY_NODE", "n1")
    state = trained_state()
    saving = Client(None, 2)
    path = saving.save_async(state, 15)
    assert path == tmp_path / file_name(15, 0, 2)
    plan = ResumePlan(15, 16, [ShardSource(0, "memory", ["n0", "n1"])])
    restored = Client(None, 2, 1, plan).restore()
    assert restored is not None and restored.step == 15 and restored.tier == "memory"
    assert_same(state, restored.state)


async def test_the_agent_reports_memory_then_storage_hands_old_files_back_and_removes_the_memory_at_the_end(
        tmp_path: Path) -> None:
    reported: list[tuple[str, int, str, list[int]]] = []
    root = memory_root(tmp_path / "shm", "n1", tmp_path / "runtime")
    tier = MemoryTier(root, lambda job, step, t, shards: reported.append((job, step, t, shards)))
    storage = tmp_path / "storage"
    directory = tier.job_dir("j")
    assert directory.parent == root and not directory.exists()  # made by the SDK's first save
    directory.mkdir(parents=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(tier.run)
        for step in (5, 10):
            write_state({"w": torch.full((4,), float(step))}, directory / file_name(step, 0, 0))
            tier.saved("j", 0, step, [0], file_name(step, 0, 0), str(storage))
        await wait_until(lambda: tier.persisted == 2 and not tier.jobs["j"].persisting, 30, "both persisted")
        assert reported == [("j", 5, "memory", [0]), ("j", 10, "memory", [0]), ("j", 5, "storage", [0]),
                            ("j", 10, "storage", [0])]
        assert torch.equal(read_state(storage / storage_name(5, 0))["w"], torch.full((4,), 5.0))
        # the newest stays; the older one is back in the rank's pool for its SDK to write into
        assert sorted(p.name for p in directory.iterdir()) == [".free.rank0.agent000001", file_name(10, 0, 0)]
        tier.saved("j", 0, 15, [0], "../escape.mem", None)  # not a file of the job's memory: ignored
        await tier.end("j")
        assert not directory.exists() and (storage / storage_name(10, 0)).exists()
        tg.cancel_scope.cancel()
    tier.close()
    assert not root.exists()
    assert len(reported) == 4 and os.path.exists(storage)

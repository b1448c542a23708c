"""The parts of sharded state in memory on their own (`recovery.client.shards`, `recovery.agent.memory`): which node
holds a rank's copy, what a rank can read, the newest step whose every shard is somewhere, and the agent keeping a
sharded rank's two newest files and the copies it holds for another node's rank. The whole path, on real processes
with a node lost, is tests/test_e2e_sharded.py."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from recovery.agent.memory import MemoryTier, memory_root
from recovery.client.memory import file_name, read_state, state_from_buffer, storage_name, write_state
from recovery.client.shards import Held, buddies, held_here, newest_complete


def test_a_ranks_buddy_is_the_rank_at_its_index_on_the_next_node() -> None:
    assert buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert buddies(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert buddies(["a", "a", "a", "a"]) == [None] * 4  # one node: no other memory to copy to
    # a node of fewer ranks: the index wraps, so every rank has a buddy on another node
    assert buddies(["a", "a", "a", "b"]) == [3, 3, 3, 0]
    # the order nodes first appear in, not their names: a spare that took n0's ranks keeps the same pairs
    assert buddies(["spare0", "spare0", "n1", "n1"]) == [2, 3, 0, 1]


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=24))
def test_no_rank_is_its_own_buddy_nor_on_its_own_node(nodes: list[str]) -> None:
    pairs = buddies(nodes)
    for rank, buddy in enumerate(pairs):
        if len(set(nodes)) == 1:
            assert buddy is None
        else:
            assert buddy is not None and nodes[buddy] != nodes[rank]


def test_the_newest_step_whole_in_memory_wins_over_a_newer_one_that_needs_storage() -> None:
    memory = [[Held(8, 0, "memory"), Held(12, 0, "memory")], [Held(8, 1, "memory")]]
    storage = [[Held(12, 1, "storage")]]
    assert newest_complete(memory, 2, at_most=20) == (8, "memory")
    assert newest_complete(memory + storage, 2, at_most=20) == (8, "memory")
    # a shard in memory nowhere: storage completes the step
    assert newest_complete([[Held(12, 0, "memory")], [Held(12, 1, "storage")]], 2, 20) == (12, "storage")
    # nothing past the live ranks' position, and no step without every shard
    assert newest_complete(memory, 2, at_most=7) is None
    assert newest_complete([[Held(8, 0, "memory")]], 2, 20) is None


def test_a_rank_reads_its_nodes_memory_and_the_storage(tmp_path: Path) -> None:
    directory, storage = tmp_path / "shm", tmp_path / "storage"
    directory.mkdir()
    storage.mkdir()
    write_state({"w": torch.ones(2)}, directory / file_name(4, 1, 3))
    (directory / ".held.rank1.77.tmp").write_bytes(b"half a copy")  # not whole yet: not counted
    write_state({"w": torch.zeros(2)}, storage / storage_name(4, 2))
    found = held_here(directory, storage)
    assert sorted(found) == [Held(4, 1, "memory"), Held(4, 2, "storage")]
    assert held_here(None, None) == {}


def test_a_received_copy_reads_as_the_file_does(tmp_path: Path) -> None:
    path = tmp_path / "x.mem"
    write_state({"w": torch.arange(6.0).reshape(2, 3), "step": 4}, path)
    data = bytearray(path.read_bytes())
    state = state_from_buffer(data)
    assert torch.equal(state["w"], read_state(path)["w"]) and state["step"] == 4
    try:
        state_from_buffer(bytearray(b"RCVMEM01" + b"\x00" * 4))
    except ValueError as exc:
        assert "no in-memory checkpoint" in str(exc)
    else:
        raise AssertionError("a truncated copy was read")


def test_the_agent_keeps_two_files_of_a_sharded_rank_and_drops_the_oldest_copy_it_holds(tmp_path: Path) -> None:
    reported: list[tuple[str, int, str, list[int]]] = []
    tier = MemoryTier(memory_root(tmp_path / "shm", "n1", tmp_path / "rt"),
                      lambda job, step, t, shards: reported.append((job, step, t, shards)))
    directory = tier.job_dir("j")
    directory.mkdir(parents=True)
    for step in (4, 8, 12):
        write_state({"w": torch.full((2,), float(step))}, directory / file_name(step, 2, 2))
        tier.saved("j", 2, step, [2], file_name(step, 2, 2), None, keep=2)
        # the copy of rank 0 (on another node) that rank 2 received and wrote here
        write_state({"w": torch.full((2,), -float(step))}, directory / file_name(step, 0, 0))
        tier.saved("j", 2, step, [0], file_name(step, 0, 0), None, held_for=0, keep=2)
    names = sorted(p.name for p in directory.iterdir())
    # rank 2's oldest file back to its pool; the oldest copy of rank 0 removed (no process here reuses it)
    assert names == [".free.rank2.agent000001", file_name(8, 0, 0), file_name(8, 2, 2), file_name(12, 0, 0),
                     file_name(12, 2, 2)], names
    assert ("j", 12, "memory", [0]) in reported and ("j", 12, "memory", [2]) in reported
    tier.close()

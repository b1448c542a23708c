"""A sharded job's memory copies leave the product as a DCP checkpoint: two gloo ranks train FSDP2 on a 1-D mesh and
save their shards as `ShardedTraining.save_async` does (the shards and where each sits in its whole tensor); the
files of the step, one per shard, are written with `torch.distributed.checkpoint` (`python -m
recovery.client.shards`), and `dcp.load` reads them into an unsharded model and optimizer equal to the whole ones the
ranks gathered. The dying checkpoint of such a job, rank 1 lost in a crash: the survivor writes its own shard and
the lost rank's from the copy its node holds, and `dcp.load` reads the step whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from recovery.client import dcp_pieces
from recovery.client.memory import file_name, read_state, storage_name, write_state
from recovery.client.shards import dying_checkpoint, local_shards, main

WORLD = 2
JOIN_S = 120


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    whole = {name: t.full_tensor() for name, t in model.state_dict().items()}
    moments = {index: {key: v.full_tensor() if hasattr(v, "full_tensor") else v for key, v in entry.items()}
               for index, entry in optimizer.state_dict()["state"].items()}
    return {"model": whole, "moments": moments}


def train_and_save(rank: int, directory: str, init_file: str) -> None:
    """Three steps, then the shards saved as storage copies and as node 0's memory (rank 0's own copy, and rank 1's
    held for it by its buddy on node 0); two steps more, then each rank's live shards at step 5."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, _ = build()
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(1, 6):
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
            if step in (3, 5):
                state, layout = local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()})
                state["layout"] = layout
                whole = gathered(model, optimizer)
                if step == 3:
                    write_state(state, Path(directory) / storage_name(3, rank))
                    write_state(state, Path(directory) / "node0" / file_name(3, rank, rank))
                else:
                    write_state(state, Path(directory) / f"live{rank}.mem")
                if rank == 0:
                    torch.save(whole, Path(directory) / f"whole{step}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both ranks' files, from one run shared by the tests."""
    base = tmp_path_factory.mktemp("fsdp")
    copies = base / "storage"
    (copies / "node0").mkdir(parents=True)
    context = mp.start_processes(train_and_save, args=(str(copies), str(base / "init")), nprocs=WORLD,
                                 join=False, start_method="spawn")
    try:
        while not context.join(JOIN_S):
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return copies


def assert_loads_as(checkpoint: Path, whole: dict[str, Any], step: int) -> None:
    """`dcp.load` of `checkpoint` into an unsharded model and optimizer gives `whole` (what the ranks gathered)."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = build()
    model(torch.zeros(1, 6)).sum().backward()
    optimizer.step()  # the optimizer's state exists, to be loaded into
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, whole["model"][name]), name
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, whole["moments"][index][key]), (index, key)
    assert optimizer.state_dict()["state"][0]["step"].item() == step


def test_a_dying_checkpoint_takes_the_lost_ranks_shard_from_its_buddys_memory_and_loads_with_dcp(
        trained: Path, tmp_path: Path) -> None:
    storage = tmp_path / "dying"
    live = read_state(trained / "live0.mem")
    layout = live.pop("layout")
    # rank 1 is lost at step 5; rank 0, at step 5, is asked for a dying checkpoint: its shard at 5 alone makes no
    # whole step, but its node holds its own copy of step 3 and rank 1's (it is rank 1's buddy)
    answer = dying_checkpoint(storage, 5, 0, WORLD, (live, layout), trained / "node0", wards=[1])
    assert answer == {"tier": "dying", "shards": [0], "location": str(storage / dcp_pieces.name(5)), "shared": True}
    assert dcp_pieces.pieces(storage / dcp_pieces.name(5), WORLD) == [0]
    assert not (storage / dcp_pieces.name(5) / dcp_pieces.METADATA).exists()  # never a half checkpoint to load
    assert_loads_as(storage / dcp_pieces.name(3), torch.load(trained / "whole3.pt"), 3)
    # rank 1, had it been preempted rather than lost, writes its own live shard at 5: that step is whole too
    live1 = read_state(trained / "live1.mem")
    assert dying_checkpoint(storage, 5, 1, WORLD, (live1, live1.pop("layout")), None, [])["shards"] == [1]
    assert_loads_as(storage / dcp_pieces.name(5), torch.load(trained / "whole5.pt"), 5)


def test_the_shards_of_a_step_load_with_dcp_as_the_whole_state(trained: Path, tmp_path: Path) -> None:
    copies = tmp_path / "storage"
    copies.mkdir()
    for rank in range(WORLD):
        (copies / storage_name(3, rank)).write_bytes((trained / storage_name(3, rank)).read_bytes())
    assert main([str(copies), "--to", str(tmp_path / "dcp")]) == 0
    assert_loads_as(tmp_path / "dcp", torch.load(trained / "whole3.pt"), 3)


def test_a_step_missing_a_shard_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state, layout = {"w": torch.zeros(2)}, {("w",): ((4,), (0,))}
    write_state({**state, "layout": layout}, tmp_path / storage_name(5, 0))
    write_state({"w": torch.ones(2), "layout": {("w",): ((4,), (2,))}}, tmp_path / storage_name(5, 2))
    assert main([str(tmp_path), "--to", str(tmp_path / "out"), "--step", "5"]) == 1
    assert "shard(s) [1] not found" in capsys.readouterr().err
    os.remove(tmp_path / storage_name(5, 2))
    # shard 0 alone looks whole by its files, but it holds half of `w`: refused, not written with zeros
    assert main([str(tmp_path), "--to", str(tmp_path / "out")]) == 1
    assert "a shard is missing" in capsys.readouterr().err

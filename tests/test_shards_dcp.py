"""A sharded job's memory copies leave the product as a DCP checkpoint: two gloo ranks train FSDP2 on a 1-D mesh and
save their shards as `ShardedTraining.save_async` does (the shards and where each sits in its whole tensor); the
files of the step, one per shard, are written with `torch.distributed.checkpoint` (`python -m
recovery.client.shards`), and `dcp.load` reads them into an unsharded model and optimizer equal to the whole ones the
ranks gathered."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from recovery.client.memory import storage_name, write_state
from recovery.client.shards import local_shards, main

WORLD = 2
JOIN_S = 120


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_and_save(rank: int, directory: str, init_file: str) -> None:
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
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
            optimizer.step()
        state, layout = local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()})
        state["layout"] = layout
        write_state(state, Path(directory) / storage_name(3, rank))
        whole = {name: t.full_tensor() for name, t in model.state_dict().items()}
        moments = {index: {key: v.full_tensor() if hasattr(v, "full_tensor") else v for key, v in entry.items()}
                   for index, entry in optimizer.state_dict()["state"].items()}
        if rank == 0:
            torch.save({"model": whole, "moments": moments}, Path(directory) / "whole.pt")
    finally:
        dist.destroy_process_group()


def test_the_shards_of_a_step_load_with_dcp_as_the_whole_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    copies = tmp_path / "storage"
    copies.mkdir()
    context = mp.start_processes(train_and_save, args=(str(copies), str(tmp_path / "init")), nprocs=WORLD,
                                 join=False, start_method="spawn")
    try:
        while not context.join(JOIN_S):
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert main([str(copies), "--to", str(tmp_path / "dcp")]) == 0
    model, optimizer = build()
    model(torch.zeros(1, 6)).sum().backward()
    optimizer.step()  # the optimizer's state exists, to be loaded into
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    whole = torch.load(copies / "whole.pt")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, whole["model"][name]), name
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, whole["moments"][index][key]), (index, key)
    assert optimizer.state_dict()["state"][0]["step"].item() == 3


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

"""FSDP2's shards on the device they train on, through the paths a sharded job's recovery takes: copied into node
memory (CUDA tensors straight into the file), resharded back into a model built again on the mesh
(`recovery.client.reshard`), and written as pieces of a DCP checkpoint with no collective (`dcp_pieces`), which
`dcp.load` reads into an unsharded model on the CPU. On the CPU over gloo (two ranks) everywhere; on a GPU over NCCL
(one rank: NCCL takes one rank a GPU) where one is lent (`gpu`, `tools/gpu_check.py`)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_reshard import spawn


def build(device: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("shard",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of the model and of the optimizer's state, gathered whole onto the CPU."""
    moments = {index: {key: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for key, v in entry.items()}
               for index, entry in optimizer.state_dict()["state"].items()}
    return {"model": {name: t.full_tensor().cpu() for name, t in model.state_dict().items()}, "moments": moments}


def rank_main(rank: int, base: str, device: str, backend: str, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from recovery.client import dcp_pieces
    from recovery.client.memory import file_name, read_state, write_state
    from recovery.client.reshard import Reshard, load_into
    from recovery.client.shards import local_shards

    root = Path(base)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{root / 'init'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        model, optimizer = build(device, seed=0)
        for step in range(1, 4):
            optimizer.zero_grad()
            batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(device)
            model(batch).square().mean().backward()
            optimizer.step()
        state, layout = local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()})
        assert all(t.device.type == device for t in state["model"].values())
        write_state({**state, "layout": layout}, root / "mem" / file_name(3, rank, rank))
        dcp_pieces.write_piece(state, layout, rank, world, root / "step3.dcp")
        expected = whole(model, optimizer)
        dist.barrier()
        # the model built again on the mesh, its shards filled from every rank's copy in node memory
        again, moments = build(device, seed=1)
        _init_optim_state(moments)
        into = Reshard.of(again, moments)
        for shard in range(world):
            into.add(read_state(root / "mem" / file_name(3, shard, shard)))
        load_into(again, moments, into.result())
        assert all(t.to_local().device.type == device for t in again.state_dict().values())
        torch.save({"expected": expected, "resharded": whole(again, moments)}, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("device", "backend", "world"), [
    ("cpu", "gloo", 2),
    pytest.param("cuda", "nccl", 1, marks=pytest.mark.gpu),
])
def test_shards_on_the_device_go_through_node_memory_and_dcp_pieces_and_come_back_bit_for_bit(
        tmp_path: Path, device: str, backend: str, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    from recovery.client import dcp_pieces

    (tmp_path / "mem").mkdir()
    spawn(rank_main, world, str(tmp_path), device, backend, world)
    found = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    expected = found[0]["expected"]
    for result in found:
        for name, tensor in expected["model"].items():
            assert torch.equal(result["resharded"]["model"][name], tensor), name
        for index, entry in expected["moments"].items():
            for key, value in entry.items():
                assert torch.equal(result["resharded"]["moments"][index][key], value), (index, key)
    # the pieces, written with no collective, make a DCP checkpoint an unsharded CPU model loads
    checkpoint = tmp_path / "step3.dcp"
    assert (checkpoint / dcp_pieces.METADATA).exists(), sorted(p.name for p in checkpoint.iterdir())
    loaded = {"model": {name: torch.empty_like(t) for name, t in expected["model"].items()}}
    dcp.load(loaded, checkpoint_id=str(checkpoint), no_dist=True)
    for name, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name

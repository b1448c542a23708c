"""A 1-D FSDP job's state resharded onto a mesh of another size (`recovery.client.reshard`): first hand-made shards
split as FSDP2 splits them (uneven chunks, empty last shards), shrinking and growing, and boxes in two dimensions;
then four gloo ranks train FSDP2 and keep their shards in two nodes' memory and on storage, and two ranks resume from
them on a mesh of two, the full tensors of the model and of the optimizer's state equal bit for bit to the four
ranks' (the old shards read from the rank's own node, sent by a peer from its node's memory, or from storage)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from recovery.client.memory import file_name, storage_name, write_state
from recovery.client.reshard import Reshard, from_live, load_into, resume_resharded
from recovery.client.shards import Layout, Path_, local_shards

WHOLE: dict[Path_, torch.Tensor] = {
    ("model", "0.weight"): torch.arange(30, dtype=torch.float32).reshape(5, 6),
    ("model", "0.bias"): torch.arange(5, dtype=torch.float64) / 7,
    ("model", "2.weight"): torch.arange(15, dtype=torch.bfloat16).reshape(3, 5),
    ("optimizer", "state", 0, "exp_avg"): -torch.arange(30, dtype=torch.float32).reshape(5, 6),
}
OLD_WORLD, NEW_WORLD = 4, 2
JOIN_S = 150.0
"""the longest the ranks of one phase may take, spawn included, before they are killed and the test fails"""


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """Each rank's (offset, length) of a dimension of `size` split as FSDP2 splits it (torch.chunk): chunks of the
    size rounded up, the last ones short or empty, an empty one at the dimension's end (as DTensor places it)."""
    chunk = -(-size // parts)
    return [(min(i * chunk, size), max(0, min(chunk, size - i * chunk))) for i in range(parts)]


def at(value: Any, place: Path_) -> Any:
    for key in place:
        value = value[key]
    return value


def states(parts: int, step: float, lr: float, fill: float | None = None) -> list[tuple[dict[str, Any], Layout]]:
    """Every rank's shards of WHOLE on a mesh of `parts` (`fill`: of that value, as a model just built holds), and
    their layout; the optimizer's `step` and its param group as given."""
    found = []
    for rank in range(parts):
        state: dict[str, Any] = {
            "model": {},
            "optimizer": {"state": {0: {"step": torch.tensor(step)}}, "param_groups": [{"lr": lr, "params": [0]}]},
        }
        layout: Layout = {}
        for place, whole in WHOLE.items():
            offset, length = split(whole.shape[0], parts)[rank]
            local = whole[offset : offset + length].clone()
            at(state, place[:-1])[place[-1]] = local if fill is None else torch.full_like(local, fill)
            layout[place] = (tuple(whole.shape), (offset,) + (0,) * (whole.dim() - 1))
        found.append((state, layout))
    return found


def pieces(parts: int, step: float = 3.0, lr: float = 0.01) -> list[dict[str, Any]]:
    """The old shards' files as `memory.read_state` returns them: the state with its layout."""
    return [{**state, "layout": layout} for state, layout in states(parts, step, lr)]


@pytest.mark.parametrize(("old", "new"), [(4, 2), (4, 3), (2, 4), (4, 1)])
def test_every_new_shard_is_filled_from_the_old_shards_it_meets(old: int, new: int) -> None:
    for rank, (state, layout) in enumerate(states(new, step=1.0, lr=0.5, fill=-1.0)):
        reshard = Reshard(state, layout)
        for piece in reversed(pieces(old)):  # in any order
            assert reshard.add(piece)
        result = reshard.result()
        assert "layout" not in result
        for place, whole in WHOLE.items():
            offset, length = split(whole.shape[0], new)[rank]
            assert torch.equal(at(result, place), whole[offset : offset + length]), (rank, place)
            assert at(result, place).dtype == whole.dtype
            assert bool((at(state, place) == -1).all()), "the new state's own tensors (live parameters) are untouched"
        assert result["optimizer"]["state"][0]["step"].item() == 3.0


def test_boxes_of_two_dimensions_meet_wherever_they_overlap() -> None:
    whole = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    old = [((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (2, 2)), ((3, 2), (2, 2))]  # a grid of 2 x 2 blocks
    new = [((0, 0), (5, 1)), ((0, 1), (5, 3)), ((2, 1), (0, 3))]  # two bands of columns, and an empty shard
    for offset, shape in new:
        state = {"w": torch.full(shape, -1.0)}
        reshard = Reshard(state, {("w",): ((5, 4), offset)})
        for start, size in old:
            block = whole[start[0] : start[0] + size[0], start[1] : start[1] + size[1]]
            assert reshard.add({"w": block.clone(), "layout": {("w",): ((5, 4), start)}})
        expected = whole[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
        assert torch.equal(reshard.result()["w"], expected)


def test_a_missing_old_shard_is_named_not_filled_with_zeros() -> None:
    state, layout = states(2, step=1.0, lr=0.5, fill=-1.0)[0]
    reshard = Reshard(state, layout)
    for index, piece in enumerate(pieces(4)):
        if index != 1:  # rows 2 and 3 of every tensor: rank 0 of two holds rows 0 to 2
            reshard.add(piece)
    with pytest.raises(ValueError, match=r"^model\.0\.weight: .* 12 of this rank's 18 elements .* shard is missing"):
        reshard.result()


def test_an_old_shard_added_twice_counts_once_and_one_overlapping_in_part_is_refused() -> None:
    state, layout = states(2, step=1.0, lr=0.5, fill=-1.0)[1]
    reshard = Reshard(state, layout)
    old = pieces(4)
    assert reshard.add(old[2])
    assert not reshard.add(old[2])  # the same file from another tier: ignored
    with pytest.raises(ValueError, match=r"^model\.0\.weight: an old shard of \(2, 6\) at \(3, 0\) overlaps"):
        reshard.add(pieces(2)[1])  # another mesh's shard: its rows 3 and 4 overlap old shard 2's row 4
    for piece in old:
        reshard.add(piece)
    result = reshard.result()
    assert torch.equal(result["model"]["0.weight"], WHOLE["model", "0.weight"][3:])


def test_a_tensor_of_another_whole_shape_is_refused_by_its_place() -> None:
    state, layout = states(2, step=1.0, lr=0.5, fill=0.0)[0]
    piece = pieces(4)[0]
    piece["layout"] = {**piece["layout"], ("optimizer", "state", 0, "exp_avg"): ((6, 6), (0, 0))}
    with pytest.raises(ValueError, match=r"^optimizer\.state\.0\.exp_avg: \(6, 6\) on the old mesh, \(5, 6\) on"):
        Reshard(state, layout).add(piece)


def test_what_is_not_sharded_comes_from_the_first_old_shard_added_else_from_the_new_state() -> None:
    state, layout = states(1, step=1.0, lr=0.5, fill=0.0)[0]
    state["optimizer"]["param_groups"][0]["foreach"] = None  # an option the old optimizer had not
    reshard = Reshard(state, layout)
    old = pieces(4, step=3.0, lr=0.01)
    old[0]["optimizer"]["state"][0]["step"] = torch.tensor(99.0)  # never disagree; here to tell the first apart
    for piece in [old[2], old[0], old[1], old[3]]:
        reshard.add(piece)
    result = reshard.result()
    assert result["optimizer"]["state"][0]["step"].item() == 3.0
    assert result["optimizer"]["param_groups"] == [{"lr": 0.01, "params": [0], "foreach": None}]
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.5


# -- on real processes: four ranks' shards, resumed by two ---------------------------------------------------------


def sharded(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model on a mesh of `world`: sizes that no mesh of 2 to 4 splits evenly, so some shards are empty."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    whole = {name: t.full_tensor() for name, t in model.state_dict().items()}
    moments = {
        index: {key: v.full_tensor() if hasattr(v, "full_tensor") else v for key, v in entry.items()}
        for index, entry in optimizer.state_dict()["state"].items()
    }
    return {"model": whole, "moments": moments}


def train_on_four(rank: int, base: str) -> None:
    """Three steps, then every rank's shards in its node's memory (ranks 0 and 1 on node A, 2 and 3 on node B, whose
    copies node A holds as their buddy's) and on storage; a fourth step's in node A's memory, past the resume's
    limit. Rank 0 keeps the whole state of step 3."""
    import torch.distributed as dist

    root = Path(base)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'init4'}", rank=rank, world_size=OLD_WORLD, timeout=timedelta(seconds=30)
    )
    try:
        model, optimizer = sharded(OLD_WORLD, seed=0)
        for step in range(1, 5):
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
            state, layout = local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()})
            state["layout"] = layout
            write_state(state, root / "A" / file_name(step, rank, rank))
            if step == 3:
                if rank >= 2:
                    write_state(state, root / "B" / file_name(step, rank, rank))
                write_state(state, root / "storage" / storage_name(step, rank))
                whole = gathered(model, optimizer)
                if rank == 0:
                    torch.save(whole, root / "whole3.pt")
    finally:
        dist.destroy_process_group()


CASES: dict[str, list[tuple[str, str | None, str | None]]] = {
    # each rank's node, its node's memory and its storage
    "one node": [("n0", "A", None), ("n0", "A", None)],
    "a peer sends": [("n0", "A", None), ("n1", "B", None)],
    "storage": [("n0", "B", None), ("n1", None, "storage")],
}
SOURCES = {
    "one node": ["memory", "memory"],
    "a peer sends": ["memory", "peer memory (n0)"],
    "storage": ["storage", "storage"],  # shards 0 and 1 are in no memory: rank 1 sends rank 0 its storage copies
}


def resume_on_two(rank: int, base: str) -> None:
    """Each case: the model built again on a mesh of two, its optimizer's state made, then resumed from the four
    ranks' shards; what each rank resumed and the whole state kept for the test."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    root = Path(base)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'init2'}", rank=rank, world_size=NEW_WORLD, timeout=timedelta(seconds=30)
    )
    try:
        found = {}
        for case, where in CASES.items():
            model, optimizer = sharded(NEW_WORLD, seed=1)
            _init_optim_state(optimizer)
            node, directory, storage = where[rank]
            resumed = resume_resharded(
                rank,
                NEW_WORLD,
                OLD_WORLD,
                3,
                node,
                None if directory is None else root / directory,
                None if storage is None else root / storage,
                lambda model=model, optimizer=optimizer: Reshard.of(model, optimizer),
                lambda state, model=model, optimizer=optimizer: load_into(model, optimizer, state),
            )
            assert resumed is not None
            found[case] = (resumed.step, resumed.source, gathered(model, optimizer))
        torch.save(found, root / f"resumed{rank}.pt")
        # the last case's shards, as a survivor keeps them live when its group goes down: a scale out's source
        state, layout = local_shards({"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()})
        torch.save((state, layout), root / f"live{rank}.pt")
    finally:
        dist.destroy_process_group()


def grow_to_four(rank: int, base: str) -> None:
    """A scale out from two ranks to four: ranks 0 and 1 kept the two shards live, ranks 2 and 3 are new; every
    rank's new shard is filled from the survivors' live shards, sent point to point, no file read."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    root = Path(base)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'init4b'}", rank=rank, world_size=OLD_WORLD, timeout=timedelta(seconds=30)
    )
    try:
        model, optimizer = sharded(OLD_WORLD, seed=2)
        _init_optim_state(optimizer)
        kept = torch.load(root / f"live{rank}.pt", weights_only=False) if rank < NEW_WORLD else None
        resumed = from_live(
            rank,
            OLD_WORLD,
            NEW_WORLD,
            kept,
            rank if rank < NEW_WORLD else -1,
            3,
            lambda: Reshard.of(model, optimizer),
            lambda state: load_into(model, optimizer, state),
        )
        assert resumed is not None
        torch.save((resumed.step, resumed.source, gathered(model, optimizer)), root / f"grown{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(function: Any, world: int, *args: Any) -> None:
    """`world` ranks running `function(rank, *args)`, waited for; every one that is left is killed, whatever
    happens."""
    context = mp.start_processes(function, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{function.__name__}: {world} ranks not done in {JOIN_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The four ranks' files and whole state, and what each of the two ranks resumed, case by case."""
    base = tmp_path_factory.mktemp("reshard")
    for directory in ("A", "B", "storage"):
        (base / directory).mkdir()
    spawn(train_on_four, OLD_WORLD, str(base))
    spawn(resume_on_two, NEW_WORLD, str(base))
    spawn(grow_to_four, OLD_WORLD, str(base))
    return base, [torch.load(base / f"resumed{rank}.pt", weights_only=False) for rank in range(NEW_WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_resume_four_ranks_shards_bit_for_bit(resumed: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    base, ranks = resumed
    expected = torch.load(base / "whole3.pt", weights_only=False)
    for rank, found in enumerate(ranks):
        step, source, whole = found[case]
        assert (step, source) == (3, f"{SOURCES[case][rank]} (resharded from {OLD_WORLD} shards)")
        assert whole["model"].keys() == expected["model"].keys()
        for name, tensor in expected["model"].items():
            assert torch.equal(whole["model"][name], tensor), name
            assert tensor.shape[0] % OLD_WORLD or tensor.shape[0] % NEW_WORLD  # uneven: an empty or short shard
        assert whole["moments"].keys() == expected["moments"].keys()
        for index, entry in expected["moments"].items():
            assert whole["moments"][index].keys() == entry.keys()
            for key, value in entry.items():
                assert torch.equal(whole["moments"][index][key], value), (index, key)
        assert whole["moments"][0]["step"].item() == 3


def test_a_scale_out_reshards_the_survivors_live_shards_onto_the_new_ranks_bit_for_bit(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, _ = resumed
    expected = torch.load(base / "whole3.pt", weights_only=False)
    for rank in range(OLD_WORLD):
        step, source, whole = torch.load(base / f"grown{rank}.pt", weights_only=False)
        assert (step, source) == (3, f"live shards (resharded from {NEW_WORLD} shards)")
        for name, tensor in expected["model"].items():
            assert torch.equal(whole["model"][name], tensor), (rank, name)
        for index, entry in expected["moments"].items():
            for key, value in entry.items():
                assert torch.equal(whole["moments"][index][key], value), (rank, index, key)

"""In-process recovery for sharded data parallelism (FSDP2's `fully_shard`) with replicas: HSDP, a 2-D device mesh
(replicate, shard) whose replica groups hold the same shards. When a rank dies, the survivors keep their
processes; every process builds the mesh and the model again on the next generation's group, the survivors keep
their own shards, and the restarted rank receives its shards of the parameters and of the optimizer state, the
step and the data position from the rank that holds the same shards in another replica group. Importing it
connects to the node's agent, then imports torch: import it before torch.

The loop is `recovery.client.ddp`'s, with a function that builds the model and its optimizer on a mesh:

    import recovery.client.fsdp as resilient

    training = resilient.init_process_group(mesh_shape=(2, 2), timeout_s=60)   # was dist.init_process_group
    def build(mesh):                                                            # the model, sharded on `mesh`
        model = Net()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    training.build(build)                                                       # was model, optimizer = build(mesh)
    def train(max_epochs):
        model, optimizer = training.model, training.optimizer                   # rebuilt after a fault
        for epoch in resilient.epochs(0, max_epochs):
            for index, (source, target) in resilient.batches(loader, epoch):
                ...
    resilient.run(train, max_epochs)

Why the model is built again rather than kept: its DTensors and FSDP's state hold the process groups of the mesh,
which a new generation replaces. Building it costs a model's construction (no collective: FSDP2 moves no data at
`fully_shard`); the shards it then holds are the live ones, copied in place.

Where no replica of a lost rank's shards is alive (a 1-D mesh, or every replica of one shard lost at once) the
process cannot be recovered in place: `build` and `run` raise `NoLiveReplica`, the process ends, and the job
restarts as a stock one, from the script's own checkpoint.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable
from typing import Any

import recovery.client as recovery
from recovery.client.ddp import StopRequested, Training, _make_current, batches, epochs, run

_connected = recovery.connect()  # before torch is imported; a client whose calls do nothing without an agent

import torch  # noqa: E402  # after connecting: importing torch takes seconds
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from recovery.client.torch import ProcessGroupRecovery, _sockets  # noqa: E402

Build = Callable[[DeviceMesh], tuple[torch.nn.Module, torch.optim.Optimizer]]


class NoLiveReplica(RuntimeError):
    """A rank behind the others has no live replica of its shards to take them from."""


def _local(value: Any) -> Any:
    """`value` with every DTensor replaced by its local shard (a plain tensor): what a rank holds of it."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    return value


class ShardedTraining(Training):
    """One rank's sharded training: its group, its mesh, the model and optimizer `build` made on it, and its
    position in the data. `model` and `optimizer` are new objects after each recovery."""

    def __init__(self, group: ProcessGroupRecovery, mesh_shape: tuple[int, ...],
                 mesh_dim_names: tuple[str, ...]) -> None:
        super().__init__(group)
        self.mesh_shape, self.mesh_dim_names = tuple(mesh_shape), tuple(mesh_dim_names)
        self.mesh: DeviceMesh | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._build: Build | None = None
        self._kept: dict[str, Any] | None = None  # this rank's shards, taken as its group went down

    # -- the model ----------------------------------------------------------------------------------------
    def build(self, build: Build) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """`build(mesh)` on this generation's mesh; in a process started into a running job, its shards, step and
        position then come from the live replica of its shards furthest ahead."""
        self._build = build
        while True:
            failed, error = False, ""
            try:
                self._agree()
                assert self.model is not None and self.optimizer is not None
                return self.model, self.optimizer
            except RuntimeError as exc:  # a peer died while this process joined: recover as the survivors do
                if isinstance(exc, NoLiveReplica) or not self.group.collective_failed(exc):
                    raise
                failed, error = True, str(exc)
            if failed:
                self.group.recover(error)

    def _make(self) -> None:
        assert self._build is not None
        device = self.group.device.type
        before = _sockets()
        self.mesh = init_device_mesh(device, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        self.model, self.optimizer = self._build(self.mesh)
        self.group.shut_with_group(before)  # the mesh's subgroups: freed on a failure as the default group is
        self._module, self._optimizer = self.model, self.optimizer
        self.optimizer.register_step_pre_hook(self._commit)
        if self._kept is not None:  # a survivor: its own shards, as they were when the group went down
            self.load(self._kept)
            self._kept = None

    def _commit(self, *_: Any) -> None:
        """Before the optimizer's step, every rank's gradients are complete: one collective of the whole world, so
        that a rank's death during the step's collectives fails the step on every survivor, not only on the ranks
        that shared a group with it. Otherwise a replica group not next to the dead rank steps while the other
        does not, and the shards of the step before, which the restarted rank needs, are gone."""
        if self.group.device.type == "cuda":
            self.group.settled()
        dist.all_reduce(torch.ones(1, device=self.group.device))

    def _release(self) -> None:
        """Before the group is destroyed: keep this rank's shards (plain tensors), drop what holds the groups."""
        if self.model is not None and self.optimizer is not None:
            self._kept = self.state()
        self.model = self.optimizer = self._module = self._optimizer = None
        self.mesh = None

    def _rewrap(self, fresh: bool) -> None:
        """Nothing to wrap again: `_agree` built the model on the new mesh."""

    # -- the state ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's shards: the model's parameters and buffers and the optimizer's state, each a plain tensor."""
        assert self.model is not None and self.optimizer is not None
        return {"model": _local(dict(self.model.state_dict())), "optimizer": _local(self.optimizer.state_dict())}

    def load(self, state: dict[str, Any]) -> None:
        """Copy shards that `state` returned (here or on a replica) into the current model and optimizer."""
        assert self.model is not None and self.optimizer is not None
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                target.copy_(state["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved = state["optimizer"]
        for index, entries in saved["state"].items():
            param = params[index]
            for key, value in list(entries.items()):
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == \
                        param.to_local().shape and key != "step":
                    entries[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                      shape=param.shape, stride=param.stride())
        self.optimizer.load_state_dict(saved)

    # -- the agreement ------------------------------------------------------------------------------------
    def _replicas(self, rank: int) -> list[int]:
        """The ranks that hold the same shards as `rank` (its column of the mesh: the other replica groups)."""
        shards = 1
        for size in self.mesh_shape[1:]:
            shards *= size
        return [replica * shards + rank % shards for replica in range(self.mesh_shape[0]) if
                replica * shards + rank % shards != rank]

    def _agree(self) -> bool:
        """Build the model on this generation's mesh; then agree on the position: every rank behind the others
        takes the shards of its live replica furthest ahead (point to point, in the same order on every rank).
        True if no process holds a position (a new formation)."""
        self._make()
        group = self.group
        positions = self._positions()
        steps = [step for step, _ in positions]
        best = max(steps)
        if best < 0:
            return True
        for rank in range(group.world_size):  # every rank walks the same pairs, in rank order
            if steps[rank] == best:
                continue
            sources = [r for r in self._replicas(rank) if steps[r] == best]
            if not sources:
                raise NoLiveReplica(f"rank {rank} is behind (step {steps[rank]}) and no replica of its shards is at "
                                    f"step {best}: the job restarts from its checkpoint")
            source = sources[0]
            if group.rank == source:
                _send(self.state(), rank, group.device)
            elif group.rank == rank:
                self.load(_receive(source, group.device))
        self.step, self.steps_per_epoch = best, positions[steps.index(best)][1] or self.steps_per_epoch
        return False


def _send(state: Any, to: int, device: Any) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=to)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=to)


def _receive(source: int, device: Any) -> Any:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=source)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=source)
    payload = payload.cpu()
    return torch.load(io.BytesIO(ctypes.string_at(payload.data_ptr(), payload.numel())), weights_only=False)


_current: ShardedTraining | None = None


def init_process_group(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] = ("replicate", "shard"),
                       backend: str = "gloo", timeout_s: float = 30.0, client: recovery.Client | None = None,
                       **options: Any) -> ShardedTraining:
    """Connect to the agent and form the default process group of this process's generation; the mesh is
    `mesh_shape` (replica groups first), built with the model by `ShardedTraining.build`."""
    global _current
    if len(mesh_shape) < 2 or mesh_shape[0] < 2:
        raise ValueError(f"mesh {mesh_shape}: in-process recovery of sharded state needs replicas (a first dimension "
                         "of at least 2, HSDP); a 1-D FSDP mesh restarts as a stock job")
    group = ProcessGroupRecovery(client or _connected, backend, timeout_s, **options)
    group.form()
    _current = ShardedTraining(group, mesh_shape, mesh_dim_names)
    _make_current(_current)
    return _current


def current() -> ShardedTraining:
    """The process's training, made by `init_process_group`: `epochs`, `batches` and `run` act on it."""
    if _current is None:
        raise RuntimeError("call recovery.client.fsdp.init_process_group first")
    return _current


__all__ = ["NoLiveReplica", "ShardedTraining", "StopRequested", "batches", "current", "epochs", "init_process_group",
           "run"]

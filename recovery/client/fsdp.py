"""In-process recovery for sharded data parallelism (FSDP2's `fully_shard`). When a rank dies, the survivors keep
their processes; every process builds the mesh and the model again on the next generation's group, and the
survivors keep their own shards. Then:

- HSDP, a 2-D device mesh (replicate, shard) whose replica groups hold the same shards: the restarted rank receives
  its shards of the parameters and of the optimizer state, the step and the data position from the rank that holds
  the same shards in another replica group. No step is lost.
- FSDP on a 1-D mesh (no replica), or an HSDP job that lost every replica of one shard at once: with `save_every`,
  each rank's shards were copied every that many steps into its node's memory and, in the background, into a buddy
  node's (`recovery.client.shards`); every rank goes back to the newest step whose shards are all in memory on a
  live node, a lost node's shards sent from its buddy's. Storage (where the agents persist the copies) is read only
  when memory holds no whole step.

Importing it connects to the node's agent, then imports torch: import it before torch. The loop is
`recovery.client.ddp`'s, with a function that builds the model and its optimizer on a mesh:

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

For FSDP without replicas: `init_process_group(mesh_shape=(world,), save_every=50, storage=...)`, and the job's
layout says every rank holds a shard of its own (`layout: {dp: <world>, fsdp: true}`, or `{dp: 1, tp: <world>}`),
so that the control plane's resume plan counts them. With `fsdp: true` and `elastic`, a scale reshards in process:
the survivors keep their processes, build the model on the new mesh and fill each new shard from the old shards'
(`recovery.client.reshard`): live where every old shard still is (a scale out), else from the newest step whole in
node memory (a lost node's shards from the copies its buddy holds), else on storage. The script builds its loader
from the current world with the global batch divided among the ranks, so each step takes the same samples.

With `storage`, a dying checkpoint asked of a rank (a preemption: the exiting ranks', and the running ranks' the
control plane asks for the other shards) is written as this rank's pieces of one DCP checkpoint,
`<storage>/step<step>.dcp` (`recovery.client.shards.dying_checkpoint`); a whole job restarted resumes from the plan's
step, a dying checkpoint's loaded by `dcp.load` onto the new mesh.

Why the model is built again rather than kept: its DTensors and FSDP's state hold the process groups of the mesh,
which a new generation replaces. Building it costs a model's construction (no collective: FSDP2 moves no data at
`fully_shard`); the shards it then holds are the live ones, copied in place.

Where neither a live replica nor a whole step in memory or on storage exists, the process cannot be recovered in
place: `build` and `run` raise `NoLiveReplica`, the process ends, and the job restarts as a stock one, from the
script's own checkpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import recovery.client as recovery
from recovery.client.ddp import StopRequested, Training, _make_current, batches, epochs, run

_connected = recovery.connect()  # before torch is imported; a client whose calls do nothing without an agent

import torch  # noqa: E402  # after connecting: importing torch takes seconds
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from recovery.client import reshard, shards  # noqa: E402
from recovery.client._client import NODE_ENV  # noqa: E402
from recovery.client.torch import ProcessGroupRecovery, _sockets  # noqa: E402

Build = Callable[[DeviceMesh], tuple[torch.nn.Module, torch.optim.Optimizer]]
logger = logging.getLogger("recovery.client")


class NoLiveReplica(RuntimeError):
    """A rank behind the others has no live replica of its shards to take them from."""


def _local(value: Any) -> Any:
    """`value` with every DTensor replaced by a copy of its local shard (a plain tensor): what a rank holds of it."""
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
                 mesh_dim_names: tuple[str, ...], save_every: int = 0, storage: str | None = None) -> None:
        super().__init__(group)
        self.mesh_shape, self.mesh_dim_names = tuple(mesh_shape), tuple(mesh_dim_names)
        self.shards = mesh_shape[1] if len(mesh_shape) > 1 else group.world_size
        """distinct shards of the state: the ranks of one replica group (every rank, on a 1-D mesh); a scale changes
        the number of replica groups, never this"""
        self.save_every = save_every
        self.storage = None if storage is None else Path(storage).resolve()
        self.resumed: shards.Resumed | None = None
        """the step and the source of this rank's shards at its last resume from a checkpoint, if any"""
        self._copies: shards.BuddyCopies | None = None
        if save_every:
            self.at_step.append(self._save_due)
        self.mesh: DeviceMesh | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._build: Build | None = None
        self._kept: dict[str, Any] | None = None  # this rank's shards, taken as its group went down
        self._kept_shard = -1  # ... which shards they are
        self._kept_layout: shards.Layout = {}  # ... and where each sits in its whole tensor
        self._wards: list[int] = []  # the ranks whose copies this rank's node holds (`shards.buddies`)
        self._resharding = 0  # the old world's shards, while a scale of a 1-D mesh is to reshard them
        self._world_from = -1  # the step this world's shards begin after: older copies are of another world's
        self._initialising = False
        if self.storage is not None:
            # a dying checkpoint, asked at a preemption or at a fault: DCP pieces, no collective (the group may be down)
            self.client.on_save(self._dying)

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
        self._fit_world()
        before = _sockets()
        self.mesh = init_device_mesh(device, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        self.model, self.optimizer = self._build(self.mesh)
        if self.save_every:  # the same collectives on every rank: the nodes, then the copies' own group
            directory = self.client.memory_directory
            nodes: list[Any] = [None] * self.group.world_size
            dist.all_gather_object(nodes, (os.environ.get(NODE_ENV, ""), directory is not None))
            if all(kept for _, kept in nodes):  # else no copies at all: a buddy without memory would never take one
                self._copies = shards.BuddyCopies(self.client, self.group.rank, [n for n, _ in nodes],
                                                  directory or Path("."))
                self._wards = list(self._copies.wards)
        self.group.shut_with_group(before)  # the mesh's subgroups: freed on a failure as the default group is
        self._module, self._optimizer = self.model, self.optimizer
        self.optimizer.register_step_pre_hook(self._commit)
        if self._kept is not None and not self._resharding:  # a survivor: its own shards, as when the group went down
            self.load(self._kept)
            self._kept = None

    def _fit_world(self) -> None:
        """The mesh of this generation's world. On HSDP's 2-D mesh a scale (an elastic job that lost a node and found
        no spare) changes the number of replica groups, never the shards of one: a survivor renumbered onto other
        shards than it holds drops its own and is behind, its shards from a replica, or from memory. On a 1-D mesh
        every shard changes: the state is resharded onto the new world (`_agree`, `recovery.client.reshard`)."""
        world = self.group.world_size
        if len(self.mesh_shape) > 1:
            if world % self.shards:
                raise NoLiveReplica(f"a world of {world} ranks is no whole number of replica groups of {self.shards} "
                                    f"shards: the job restarts from its checkpoint")
            self.mesh_shape = (world // self.shards, *self.mesh_shape[1:])
        elif world != self.mesh_shape[0]:
            self._resharding = self._resharding or self.shards  # a scale interrupted keeps the shards it started from
            self.mesh_shape, self.shards = (world,), world
            return
        if self._kept is not None and self._kept_shard != self.group.rank % self.shards:
            self._kept, self.step = None, None

    def _commit(self, *_: Any) -> None:
        """Before the optimizer's step, every rank's gradients are complete: one collective of the whole world, so
        that a rank's death during the step's collectives fails the step on every survivor, not only on the ranks
        that shared a group with it. Otherwise a replica group not next to the dead rank steps while the other
        does not, and the shards of the step before, which the restarted rank needs, are gone."""
        if self._initialising:
            return
        if self.group.device.type == "cuda":
            self.group.settled()
        dist.all_reduce(torch.ones(1, device=self.group.device))

    def _release(self) -> None:
        """Before the group is destroyed: keep this rank's shards (plain tensors), drop what holds the groups."""
        shards.shut(self._copies)  # its group is shut already: a copy under way ends
        self._copies = None
        if self.model is not None and self.optimizer is not None:
            self._kept, self._kept_shard = self.state(), self.group.rank % self.shards
            self._kept_layout = shards.local_shards({"model": dict(self.model.state_dict()),
                                                     "optimizer": self.optimizer.state_dict()})[1]
        self.model = self.optimizer = self._module = self._optimizer = None
        self.mesh = None

    def _rewrap(self, fresh: bool) -> None:
        """Nothing to wrap again: `_agree` built the model on the new mesh."""

    # -- the state ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's shards: the model's parameters and buffers and the optimizer's state, each a plain tensor."""
        assert self.model is not None and self.optimizer is not None
        return {"model": _local(dict(self.model.state_dict())), "optimizer": _local(self.optimizer.state_dict())}

    def save_async(self, step: int | None = None) -> Path | None:
        """Copy this rank's shards at `step` (default: the position) into its node's memory, and in the background
        to its buddy's node (`recovery.client.shards`); with `storage` given to `init_process_group`, the agent also
        persists them there. The stall is the copy into memory. None without an agent that keeps memory."""
        assert self.model is not None and self.optimizer is not None
        at = step if step is not None else (self.step or 0)
        # the shards themselves (the save copies them), and where each sits in its whole tensor: the copies of one
        # step make a DCP checkpoint (`python -m recovery.client.shards`)
        state, layout = shards.local_shards({"model": dict(self.model.state_dict()),
                                             "optimizer": self.optimizer.state_dict()})
        state["layout"] = layout
        shard = self.group.rank % self.shards
        path = self.client.save_async(state, at, shards=[shard], storage=self.storage, keep=shards.KEEP)
        if path is not None and self._copies is not None:
            self._copies.copy(at, shard, path)
        return path

    def _dying(self, step: int) -> dict[str, Any]:
        """The agent asked for a dying checkpoint at `step` (this rank's last): its shards, live or as kept when its
        group went down, and its wards' copies, as DCP pieces on storage (`shards.dying_checkpoint`)."""
        assert self.storage is not None
        live: tuple[Any, shards.Layout] | None = None
        if self.model is not None and self.optimizer is not None and self.step == step:
            state, layout = shards.local_shards({"model": dict(self.model.state_dict()),
                                                 "optimizer": self.optimizer.state_dict()})
            live = state, layout
        elif self._kept is not None and self.step == step:
            live = self._kept, self._kept_layout
        shard = self._kept_shard if live is not None and self.model is None else self.group.rank % self.shards
        return shards.dying_checkpoint(self.storage, step, shard, self.shards, live, self.client.memory_directory,
                                       self._wards)

    def run(self, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`ddp.Training.run`; then the last copy to the buddy ends (its peer sends or takes it too: every rank saved
        the same steps) before the script destroys the process group, which would abort a thread still inside it."""
        try:
            return super().run(train, *args, **kwargs)
        finally:
            if self._copies is not None:
                self._copies.wait(shards.COPY_JOIN_S * 3)
                self._copies.close()
                self._copies = None

    def _save_due(self, step: int) -> None:
        if step % self.save_every == 0:
            self.save_async(step)

    def load(self, state: dict[str, Any]) -> None:
        """Copy shards that `state` returned (here or on a replica) into the current model and optimizer."""
        assert self.model is not None and self.optimizer is not None
        reshard.load_into(self.model, self.optimizer, state)

    # -- a scale of a 1-D mesh --------------------------------------------------------------------------
    def _empty_shards(self) -> reshard.Reshard:
        """This rank's shards on the new mesh, to fill: the optimizer's state made first (a step of zero gradients,
        no commit collective), so that its moments have shards to fill too."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        assert self.model is not None and self.optimizer is not None
        self._initialising = True
        try:
            _init_optim_state(self.optimizer)
        finally:
            self._initialising = False
        return reshard.Reshard.of(self.model, self.optimizer)

    def _reshard(self, old: int, best: int) -> None:
        """A scale of a 1-D mesh from `old` shards to this world: every rank's shard changes. Where the old world's
        shards are all live at `best` (a scale out: every old rank kept), they are resharded from the survivors and
        no step is lost; else (a scale in: the lost ranks' shards are gone with them) from the newest step whole in
        memory, a lost node's shards from their buddy's copies, or else on storage."""
        group = self.group
        kept = (self._kept, self._kept_layout) if self._kept is not None and self.step == best else None
        resumed = reshard.from_live(group.rank, group.world_size, old, kept, self._kept_shard, best,
                                    self._empty_shards, self.load, group.device)
        if resumed is None:
            resumed = reshard.resume_resharded(group.rank, group.world_size, old, best, os.environ.get(NODE_ENV, ""),
                                               self.client.memory_directory, self.storage, self._empty_shards,
                                               self.load)
        self._kept, self._resharding = None, 0
        if resumed is None:
            raise NoLiveReplica(f"a scale from {old} shards to {group.world_size}: no step is whole in the old shards, "
                                f"live, in memory or on storage: the job restarts from its checkpoint")
        self.resumed, self.step, self._world_from = resumed, resumed.step, resumed.step
        logger.warning("rank %d resumed at step %d, its shards from %s", group.rank, resumed.step, resumed.source)

    # -- the agreement ------------------------------------------------------------------------------------
    def _replicas(self, rank: int) -> list[int]:
        """The ranks that hold the same shards as `rank` (its column of the mesh: the other replica groups)."""
        return [r for r in range(rank % self.shards, self.group.world_size, self.shards) if r != rank]

    def _agree(self) -> bool:
        """Build the model on this generation's mesh; then agree on the position: every rank behind the others
        takes the shards of its live replica furthest ahead (point to point, in the same order on every rank).
        True if no process holds a position (a new formation)."""
        self._make()
        group = self.group
        positions = self._positions()
        steps = [step for step, _ in positions]
        best = max(steps)
        old = reshard.old_shards(self._resharding, group.device) if len(self.mesh_shape) == 1 else 0
        if best < 0:
            return not self._resume_fresh()
        per_epoch = max(p[1] for p in positions) or self.steps_per_epoch
        if old:
            self._reshard(old, best)
            self.steps_per_epoch = per_epoch
            return False
        behind = [rank for rank in range(group.world_size) if steps[rank] != best]
        if any(all(steps[r] != best for r in self._replicas(rank)) for rank in behind):
            self._resume_from_checkpoint(best, behind)
            self.steps_per_epoch = per_epoch
            return False
        for rank in behind:  # every rank walks the same pairs, in rank order
            source = next(r for r in self._replicas(rank) if steps[r] == best)
            if group.rank == source:
                reshard.send_state(self.state(), rank, group.device)
            elif group.rank == rank:
                self.load(reshard.receive_state(source, group.device))
        self.step, self.steps_per_epoch = best, per_epoch
        return False

    def _resume_fresh(self) -> bool:
        """A new formation (every process new: the whole job restarted) with a resume plan: every rank loads its
        shards of the plan's step, or of the newest whole step before it, from memory, storage or a dying DCP
        checkpoint. False where there is none: the script's own checkpoint, if it keeps one, serves."""
        plan = self.client.resume_plan()
        if plan is None or plan.checkpoint_step is None or not (self.save_every or self.storage):
            return False
        group = self.group
        if len(self.mesh_shape) == 1 and plan.shards and len(plan.shards) != self.shards:
            # the plan's step is whole in the shards of another world (before a scale): resharded onto this one
            resumed = reshard.resume_resharded(group.rank, group.world_size, len(plan.shards), plan.checkpoint_step,
                                               os.environ.get(NODE_ENV, ""), self.client.memory_directory,
                                               self.storage, self._empty_shards, self.load)
        else:
            resumed = shards.resume(group.rank, group.world_size, self.shards, lambda r: r % self.shards,
                                    plan.checkpoint_step, os.environ.get(NODE_ENV, ""), self.client.memory_directory,
                                    self.storage, self.load, plan.checkpoint_step, self._load_checkpoint)
        if resumed is None:
            return False
        self.resumed, self.step = resumed, resumed.step
        logger.warning("rank %d resumed at step %d, its shards from %s", group.rank, resumed.step, resumed.source)
        return True

    def _load_checkpoint(self, checkpoint: Path) -> None:
        """Every rank at once: a DCP checkpoint (a dying one) loaded into this mesh's model and optimizer, resharded
        by `dcp.load` whatever mesh wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        assert self.model is not None and self.optimizer is not None
        self._initialising = True  # the optimizer's state made by a step of zero gradients: no commit collective
        try:
            _init_optim_state(self.optimizer)
        finally:
            self._initialising = False
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        dcp.load(state, checkpoint_id=os.fspath(checkpoint))  # into the shards in place
        self.optimizer.load_state_dict(state["optimizer"])

    def _resume_from_checkpoint(self, best: int, behind: list[int]) -> None:
        """Some rank behind has no live replica at `best`: every rank goes back to the newest step whose every shard
        is in memory on a live node (or, failing that, on storage), its own shards of it loaded."""
        group = self.group
        plan = self.client.resume_plan()
        # the control plane's plan holds for a process started for this recovery: it has no position, no recovery
        planned = plan.checkpoint_step if plan is not None and self.step is None and not group.recoveries else None
        resumed = shards.resume(group.rank, group.world_size, self.shards, lambda r: r % self.shards, best,
                                os.environ.get(NODE_ENV, ""), self.client.memory_directory,
                                self.storage, self.load, planned, self._load_checkpoint, after=self._world_from)
        if resumed is None:
            raise NoLiveReplica(f"rank(s) {', '.join(map(str, behind))} behind (the others at step {best}) have no "
                                f"live replica of their shards and no step is whole in memory or on storage: the "
                                f"job restarts from its checkpoint")
        self.resumed, self.step = resumed, resumed.step
        logger.warning("rank %d resumed at step %d, its shards from %s", group.rank, resumed.step, resumed.source)


_current: ShardedTraining | None = None


def init_process_group(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None,
                       backend: str = "gloo", timeout_s: float = 30.0, client: recovery.Client | None = None,
                       save_every: int = 0, storage: str | os.PathLike[str] | None = None,
                       **options: Any) -> ShardedTraining:
    """Connect to the agent and form the default process group of this process's generation; the mesh is
    `mesh_shape` (replica groups first: `(replicas, shards)` for HSDP, `(world,)` for FSDP), built with the model by
    `ShardedTraining.build`. `save_every`: every that many steps, each rank's shards go to its node's memory and to
    its buddy node's (`save_async`), what a job without a live replica of a lost shard resumes from; `storage`: a
    directory every node reads, where the agents also persist them."""
    global _current
    if mesh_dim_names is None:
        mesh_dim_names = ("replicate", "shard") if len(mesh_shape) > 1 else ("shard",)
    if len(mesh_shape) != len(mesh_dim_names) or not 1 <= len(mesh_shape) <= 2:
        raise ValueError(f"mesh {mesh_shape} named {mesh_dim_names}: one dimension (FSDP) or two (HSDP: replica "
                         f"groups, then shards), one name each")
    if save_every < 0:
        raise ValueError(f"save_every={save_every}: a number of steps, 0 for none")
    group = ProcessGroupRecovery(client or _connected, backend, timeout_s, **options)
    group.form()
    _current = ShardedTraining(group, tuple(mesh_shape), tuple(mesh_dim_names), save_every,
                               None if storage is None else os.fspath(storage))
    _make_current(_current)
    return _current


def current() -> ShardedTraining:
    """The process's training, made by `init_process_group`: `epochs`, `batches` and `run` act on it."""
    if _current is None:
        raise RuntimeError("call recovery.client.fsdp.init_process_group first")
    return _current


__all__ = ["NoLiveReplica", "ShardedTraining", "StopRequested", "batches", "current", "epochs", "init_process_group",
           "run"]

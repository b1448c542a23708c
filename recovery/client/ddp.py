"""What a DistributedDataParallel script needs to recover in-process: the group (`init_process_group`), its model
wrapped again on every new group (`wrap`), the data loader's position (`epochs`, `batches`: the epoch and the batches
of it already trained, so that a recovered process resumes mid-epoch) and the loop that recovers (`run`). Importing
it connects to the node's agent, then imports torch: import it before torch, so that heartbeats flow while torch
is imported (seconds on a busy host, long enough for a silent rank to be taken for a hung one).

A tutorial-style script changes in a few lines (docs/ml-engineer.md shows the whole diff):

    import recovery.client.ddp as resilient

    resilient.init_process_group(timeout_s=60)              # was dist.init_process_group("gloo")
    model = resilient.wrap(model, optimizer)                # was DDP(model)
    def train(max_epochs):
        for epoch in resilient.epochs(epochs_run, max_epochs):         # was range(epochs_run, max_epochs)
            for index, (source, targets) in resilient.batches(loader, epoch):  # was enumerate(loader)
                train_step(source, targets)
            save_snapshot(epoch)
    resilient.run(train, max_epochs)                        # was train(max_epochs)

When a peer dies, the step's collective raises out of `train`; `run` recovers (see `ProcessGroupRecovery.recover`),
takes the state of the replica furthest ahead, wraps the model again on the new group, and calls `train` again:
`epochs` and `batches` skip what is done, so it goes on at the interrupted step. A process started to replace a
dead rank gets the model and optimizer state and the position from a live replica in `wrap`.

The position counts completed steps: `batches` counts a batch as trained when the loop asks for the next one (or
the epoch ends), and reports the global step `epoch * len(loader) + index + 1` to the agent at that boundary (where
a dying checkpoint asked for is written). The state handed over is the wrapped model's and the optimizer's
`state_dict()`; anything else the script keeps across steps (a learning-rate scheduler, random generators) it keeps
equal on every rank itself. Between `init_process_group` and `wrap` the script runs no collective of its own (the
survivors' recovery and a replacement's start run the same collectives in the same order: the state's agreement,
then DDP's construction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import recovery.client as recovery

_connected = recovery.connect()  # before torch is imported; a client whose calls do nothing without an agent

import torch  # noqa: E402  # after connecting: importing torch takes seconds
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from recovery.client.torch import ProcessGroupRecovery, _broadcast  # noqa: E402

Batch = TypeVar("Batch")
Result = TypeVar("Result")


class StopRequested(Exception):
    """The agent asked this process to stop (a graceful stop): `batches` raises it at a step boundary, `run`
    returns None."""


class Training:
    """One rank's data-parallel training: its group, its wrapped model and its position in the data."""

    def __init__(self, group: ProcessGroupRecovery) -> None:
        self.group = group
        self.step: int | None = None  # steps completed in the job (None: not started, the position is the script's)
        self.steps_per_epoch: int | None = None
        self._model: DistributedDataParallel | None = None
        self._module: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._ddp_kwargs: dict[str, Any] = {}
        self._fixed_buckets = True
        self.at_step: list[Callable[[int], None]] = []
        """called with the step at every step boundary of `batches`, before the step is reported (a save due)"""
        group.holders.append(self._release)

    @property
    def client(self) -> recovery.Client:
        """The process's client (its agent's socket)."""
        return self.group.client

    # -- the model ----------------------------------------------------------------------------------------
    def wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, fixed_buckets: bool = True,
             **ddp_kwargs: Any) -> DistributedDataParallel:
        """`DistributedDataParallel(module, **ddp_kwargs)` on the current group, rebuilt in place on every new group
        (the object stays the script's). In a process started into a running job, the state and the position come
        from the live replica furthest ahead first. One model per process.

        `fixed_buckets`: DDP's gradient buckets hold the parameters in their order from the first step on, in
        every DDP built, on every rank: a recovered run is bitwise equal to one without faults. DDP's own layout
        (False) is rebuilt after the first step in the order the gradients became ready, which overlaps the
        all_reduce with the backward pass better on a big model; a new DDP starts again from its initial layout,
        so the step after a recovery sums the gradients in another order than without the fault (last bits)."""
        if self._optimizer is not optimizer and self.group.device.type == "cuda":
            # NCCL returns to the host before a collective ran, and an aborted one returns no error: before the
            # optimizer uses the gradients, the step's all_reduce must have completed in a live group
            optimizer.register_step_pre_hook(lambda *_: self.group.settled())
        self._module, self._optimizer, self._ddp_kwargs = module, optimizer, ddp_kwargs
        self._fixed_buckets = fixed_buckets
        model = DistributedDataParallel.__new__(DistributedDataParallel)
        while True:
            failed, error = False, ""
            try:
                # A new formation (every process just started, from the script's own snapshot or from scratch) keeps
                # DDP's broadcast of rank 0's parameters; state handed over by a replica must not be overwritten.
                fresh = self._agree()
                DistributedDataParallel.__init__(model, module, init_sync=fresh, **ddp_kwargs)
                self._model = model
                self._fix_buckets()
                return model
            except RuntimeError as exc:  # a peer died while this process joined: recover as the survivors do
                if not self.group.collective_failed(exc):
                    raise
                failed, error = True, str(exc)  # the text only: the exception holds the frames that hold the group
            if failed:
                self._model = None
                model.__dict__.clear()
                self.group.recover(error)

    def _fix_buckets(self) -> None:
        """The buckets in parameter order now (a collective: rank 0's order to every rank), never rebuilt later."""
        if self._fixed_buckets and self._model is not None:
            self._model.reducer._push_all_rebuilt_params()
            self._model.reducer._rebuild_buckets()

    def _release(self) -> None:
        """Drop DDP's hold on the group (its reducer and the group itself), so that destroying it frees it."""
        if self._model is not None:
            self._model.__dict__.clear()

    def _rewrap(self, fresh: bool) -> None:
        if self._model is not None and self._module is not None:
            self._model.__dict__.clear()
            DistributedDataParallel.__init__(self._model, self._module, init_sync=fresh, **self._ddp_kwargs)
            self._fix_buckets()

    def state(self) -> dict[str, Any]:
        """The wrapped module's and optimizer's state dicts: what a replica hands a restarted peer."""
        assert self._module is not None and self._optimizer is not None
        return {"model": self._module.state_dict(), "optimizer": self._optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        """Load what `state` returned on a peer."""
        assert self._module is not None and self._optimizer is not None
        self._module.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])

    def _positions(self) -> list[tuple[int, int]]:
        """(step, steps per epoch) of every rank, in rank order (a collective); step -1: no position held."""
        group = self.group
        mine = torch.tensor([-1 if self.step is None else self.step, self.steps_per_epoch or 0], dtype=torch.int64,
                            device=group.device)
        positions = [torch.zeros(2, dtype=torch.int64, device=group.device) for _ in range(group.world_size)]
        dist.all_gather(positions, mine)
        return [(int(p[0]), int(p[1])) for p in positions]

    def _agree(self) -> bool:
        """Agree on the position with every replica and take the state of the one furthest ahead (the lowest rank
        of those) where they differ; True if no process holds a position (a new formation: each keeps its own)."""
        group = self.group
        positions = self._positions()
        steps = [step for step, _ in positions]
        best = max(steps)
        if best < 0:
            return True
        source = steps.index(best)
        if len(set(steps)) > 1:
            state = _broadcast(self.state() if group.rank == source else None, source, group.rank, group.device)
            if group.rank != source:
                self.load(state)
        self.step, self.steps_per_epoch = best, positions[source][1] or self.steps_per_epoch
        return False

    # -- the position -------------------------------------------------------------------------------------
    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """`range(start, stop)`, from the epoch of the position if that is later (the process resumes)."""
        first = start
        if self.step is not None and self.steps_per_epoch:
            first = max(start, self.step // self.steps_per_epoch)
        yield from range(first, stop)

    def batches(self, loader: Iterable[Batch], epoch: int) -> Iterator[tuple[int, Batch]]:
        """`enumerate(loader)` for `epoch`, without the batches of it already trained: the sampler's epoch is set
        (`set_epoch`, as a DistributedSampler needs), and every batch whose loop body completed is a step."""
        per_epoch = len(loader)  # type: ignore[arg-type]
        self.steps_per_epoch = per_epoch
        if self.step is None or self.step < epoch * per_epoch:
            self.step = epoch * per_epoch
        done = self.step - epoch * per_epoch
        if done >= per_epoch:
            return
        sampler = getattr(loader, "sampler", None)
        if hasattr(loader, "set_epoch"):  # a loader that keeps its own epoch (Accelerate's DataLoaderShard)
            loader.set_epoch(epoch)
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index < done:
                continue  # trained before a recovery: the loader still yields it, in its order
            yield index, batch
            self.step = epoch * per_epoch + index + 1
            for hook in self.at_step:
                hook(self.step)
            self.client.report_step(self.step)
            if self.client.should_stop():
                raise StopRequested(f"the agent asked this process to stop after step {self.step}")

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, train: Callable[..., Result], *args: Any, **kwargs: Any) -> Result | None:
        """`train(*args, **kwargs)`, called again after each recovery until it returns (None after a stop the
        agent asked for). A failure that is the script's own (not the group's) is raised."""
        recovered = False
        while True:
            failed, error = False, ""
            try:
                if recovered:  # the same collectives as a replacement's `wrap`, in its order
                    self._rewrap(self._agree())
                return train(*args, **kwargs)
            except StopRequested:
                return None
            except RuntimeError as exc:
                if not self.group.collective_failed(exc):
                    raise
                failed, error = True, str(exc)
            if failed:  # outside the except block, whose traceback holds the frames that hold the group
                self.group.recover(error)
                recovered = True


_current: Training | None = None


def init_process_group(backend: str = "gloo", timeout_s: float = 30.0, client: recovery.Client | None = None,
                       **options: Any) -> Training:
    """Connect to the agent and form the default process group of this process's generation (instead of
    `torch.distributed.init_process_group`). `timeout_s` bounds a collective only where nothing else ends it: a
    dead peer's survivors are freed at once (see `ProcessGroupRecovery`). `options`: ProcessGroupRecovery's."""
    global _current
    group = ProcessGroupRecovery(client or _connected, backend, timeout_s, **options)
    group.form()
    _current = Training(group)
    return _current


def current() -> Training:
    """The process's training, made by `init_process_group` (or by an integration: `recovery.client.fsdp`,
    `recovery.client.accelerate`); the functions below are its methods."""
    if _current is None:
        raise RuntimeError("call recovery.client.ddp.init_process_group (or an integration's) first")
    return _current


def _make_current(training: Training) -> None:
    """An integration's training is the process's: `epochs`, `batches` and `run` below act on it."""
    global _current
    _current = training


def wrap(module: torch.nn.Module, optimizer: torch.optim.Optimizer, fixed_buckets: bool = True,
         **ddp_kwargs: Any) -> DistributedDataParallel:
    return current().wrap(module, optimizer, fixed_buckets, **ddp_kwargs)


def epochs(start: int, stop: int) -> Iterator[int]:
    return current().epochs(start, stop)


def batches(loader: Iterable[Batch], epoch: int) -> Iterator[tuple[int, Batch]]:
    return current().batches(loader, epoch)


def run(train: Callable[..., Result], *args: Any, **kwargs: Any) -> Result | None:
    return current().run(train, *args, **kwargs)


__all__ = ["StopRequested", "Training", "batches", "current", "epochs", "init_process_group", "run", "wrap"]

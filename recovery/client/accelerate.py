"""In-process recovery for a Hugging Face Accelerate script: its `Accelerator`, its `prepare`, its own loop.
Importing it connects to the node's agent, then imports torch: import it before torch.

Four lines change (examples/accelerate/train.py marks them):

    import recovery.client.accelerate as resilient

    accelerator = resilient.Accelerator(timeout_s=60)                  # was Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    def train():
        for epoch in resilient.epochs(0, epochs):                      # was range(epochs)
            for index, batch in resilient.batches(loader, epoch):      # was enumerate(loader)
                ...                                                    # accelerator.backward, optimizer.step
    resilient.run(train)                                               # was train()

What it does: the process group is the SDK's (`ProcessGroupRecovery`, formed before Accelerate's state, which
takes it as it is); `prepare` first agrees on the position with the live ranks, and a process started into a
running job loads the live replica's model, optimizer and scheduler states before Accelerate wraps the model, so
DDP's first broadcast spreads the live state; DDP's buckets are laid in parameter order on every rank. When a peer
dies, the step's collective raises out of `train`; `run` waits for the next generation, hands the restarted rank
the state, builds DDP again on the new group and calls `train` again, and `epochs` and `batches` skip what is done
(see `recovery.client.ddp`). The data loader's shuffling is Accelerate's seedable sampler (a function of the seed
and the epoch), so a resumed epoch draws the order of the fault-free one.

Not covered: more than one model (FSDP, DeepSpeed and Megatron plug-ins), and collectives the script runs between
`Accelerator()` and `prepare`.
"""

from __future__ import annotations

from typing import Any

import recovery.client as recovery
from recovery.client.ddp import StopRequested, Training, _make_current, batches, epochs, run

_connected = recovery.connect()  # before torch is imported; a client whose calls do nothing without an agent

import accelerate  # noqa: E402  # after connecting: it imports torch
import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from recovery.client.torch import ProcessGroupRecovery  # noqa: E402


class AcceleratedTraining(Training):
    """A rank's training under Accelerate: the state handed over is the model's, every optimizer's and every
    scheduler's given to `prepare`; DDP is Accelerate's, rebuilt in place with the same arguments."""

    def __init__(self, group: ProcessGroupRecovery) -> None:
        super().__init__(group)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []

    def track(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], schedulers: list[Any]) -> None:
        """The objects given to `prepare` whose state a replica hands over (before Accelerate wraps them)."""
        self._module, self._optimizers, self._schedulers = module, optimizers, schedulers
        self._optimizer = optimizers[0] if optimizers else None
        if self.group.device.type == "cuda":
            for optimizer in optimizers:  # NCCL: the step's all_reduce completed in a live group (see `wrap`)
                optimizer.register_step_pre_hook(lambda *_: self.group.settled())

    def adopt(self, model: DistributedDataParallel) -> None:
        """The DDP that Accelerate built: rebuilt in place on every new group, with its arguments."""
        self._model = model
        self._ddp_kwargs = {"device_ids": model.device_ids, "output_device": model.output_device,
                            "broadcast_buffers": model.broadcast_buffers,
                            "find_unused_parameters": model.find_unused_parameters,
                            "gradient_as_bucket_view": model.gradient_as_bucket_view,
                            "static_graph": model.static_graph}
        self._fix_buckets()

    def _rewrap(self, fresh: bool) -> None:
        # As Accelerate built it: with DDP's broadcast of rank 0's parameters, equal on every rank after the
        # agreement, so a restarted rank's `prepare` and the survivors run the same collectives.
        super()._rewrap(fresh=True)

    def state(self) -> dict[str, Any]:
        """The model's, every optimizer's and every scheduler's state dicts."""
        assert self._module is not None
        return {"model": self._module.state_dict(), "optimizers": [o.state_dict() for o in self._optimizers],
                "schedulers": [s.state_dict() for s in self._schedulers]}

    def load(self, state: dict[str, Any]) -> None:
        """Load what `state` returned on a peer."""
        assert self._module is not None
        self._module.load_state_dict(state["model"])
        for optimizer, saved in zip(self._optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` on the SDK's process group. `timeout_s` bounds only a collective that nothing else
    ends (a dead peer frees the survivors at once); `client`: the process's SDK client. Unless the script passes
    its own `dataloader_config`, the data loaders shuffle with Accelerate's seedable sampler."""

    def __init__(self, *args: Any, timeout_s: float = 60.0, client: recovery.Client | None = None,
                 **kwargs: Any) -> None:
        global _current
        kwargs.setdefault("dataloader_config", accelerate.DataLoaderConfiguration(use_seedable_sampler=True))
        backend = "nccl" if torch.cuda.is_available() and not kwargs.get("cpu", False) else "gloo"
        group = ProcessGroupRecovery(client or _connected, backend, timeout_s)
        group.form()  # Accelerate's state takes the default group as it finds it
        self.training = AcceleratedTraining(group)
        _current = self.training
        _make_current(self.training)
        super().__init__(*args, **kwargs)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """`Accelerator.prepare`, after the agreement with the live ranks (the state of the one furthest ahead
        loaded here where this process is behind), with DDP's buckets fixed."""
        modules = [a for a in args if isinstance(a, torch.nn.Module)]
        if len(modules) != 1:
            return super().prepare(*args, device_placement=device_placement)
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        training = self.training
        training.track(modules[0], optimizers, schedulers)
        while True:
            failed, error = False, ""
            try:
                training._agree()
                prepared = super().prepare(*args, device_placement=device_placement)
                models = prepared if isinstance(prepared, tuple) else (prepared,)
                for model in models:
                    if isinstance(model, DistributedDataParallel):
                        training.adopt(model)
                return prepared
            except RuntimeError as exc:  # a peer died while this process joined: recover as the survivors do
                if not training.group.collective_failed(exc):
                    raise
                failed, error = True, str(exc)
            if failed:
                training.group.recover(error)


_current: AcceleratedTraining | None = None


def current() -> AcceleratedTraining:
    """The process's training, made by `Accelerator()`: `epochs`, `batches` and `run` act on it."""
    if _current is None:
        raise RuntimeError("make a recovery.client.accelerate.Accelerator first")
    return _current


__all__ = ["AcceleratedTraining", "Accelerator", "StopRequested", "batches", "current", "epochs", "run"]

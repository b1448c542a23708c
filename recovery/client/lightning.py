"""In-process recovery under PyTorch Lightning's own loop: a strategy that a `Trainer(strategy="ddp")` script
swaps in, with no other change. Importing it connects to the node's agent, then imports Lightning: import it
first, so that heartbeats flow while Lightning and torch are imported (seconds on a busy host, long enough for a
silent rank to be taken for a hung one).

    from recovery.client.lightning import RecoveryDDPStrategy           # before `import lightning`

    trainer = Trainer(strategy=RecoveryDDPStrategy(timeout_s=60), ...)   # was strategy="ddp"
    trainer.fit(model, datamodule, ckpt_path="last")

What it changes, under `recovery-run`:

- The process group is the SDK's (`ProcessGroupRecovery`): when a rank dies, the survivors keep their processes,
  and the dead rank alone is started again (from a warm standby where the node has one).
- A survivor whose optimizer step failed on the group waits for the new generation, hands the restarted rank the
  live state (Lightning's whole checkpoint, built in memory: weights, optimizer and scheduler states, the loops'
  progress, the callbacks' states) and runs the same step again, on the same batch. The restarted rank goes
  through `fit` as after a restart from a checkpoint, but from that state, and its data loader skips the batches
  of the epoch already trained: the run is bitwise equal to one without the fault.
- Each optimizer step is reported (`steps`), each checkpoint Lightning saves too (`checkpoints`), and a graceful
  stop the agent asks for ends `fit` at the next step boundary (`trainer.should_stop`).

Without an agent (plain `torchrun`) the group forms on `MASTER_ADDR`/`MASTER_PORT` and it is Lightning's DDP.

The rules that keep a survivor and a restarted rank in step: between a (re)formation and that process's next
completed optimizer step, the strategy's own collectives outside a step (`barrier`, `broadcast`, `reduce`,
`all_gather`: Lightning's set-up, its checkpoint callback, `self.log(..., sync_dist=True)`) run on this process
alone, since the other side does not run them; a failure of the group in one of them outside a step recovers
there. A collective the script runs itself through `torch.distributed` outside `training_step` is not covered.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import recovery.client as recovery

_connected = recovery.connect()  # before Lightning and torch are imported (seconds): heartbeats flow meanwhile

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from recovery.client.torch import ProcessGroupRecovery, _broadcast  # noqa: E402

try:  # the unified package first, then the standalone one: the same classes
    import lightning.pytorch as pl
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # pragma: no cover - depends on what the environment installed
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.utilities.data import _set_sampler_epoch  # type: ignore[no-redef]
    from lightning_fabric.utilities.seed import reset_seed  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy  # type: ignore[no-redef]

logger = logging.getLogger(__name__)


class _Resumable:
    """A training data loader whose next iteration is the running ranks' epoch (its sampler's epoch set before the
    first batch: Lightning prefetches before it sets it), without the batches of it already trained (Lightning
    restores the loop's progress but restarts a plain loader's epoch). Everything else is the loader's own."""

    def __init__(self, loader: Any) -> None:
        self.__dict__["_loader"] = loader
        self.__dict__["skip"] = 0
        self.__dict__["epoch"] = None

    def __iter__(self) -> Iterator[Any]:
        skip, epoch = self.__dict__["skip"], self.__dict__["epoch"]
        self.__dict__.update(skip=0, epoch=None)
        if epoch is not None:
            _set_sampler_epoch(self._loader, epoch)
        iterator = iter(self._loader)
        for _ in range(skip):  # the sampler's order, as the fault-free run drew it
            next(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("skip", "epoch"):
            self.__dict__[name] = value
        else:
            setattr(self._loader, name, value)


class RecoveryDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy on the SDK's process group: a dead peer's survivors keep their processes and train
    on at the interrupted step; a restarted rank takes the live state. `timeout_s` bounds only a collective that
    nothing else ends (a peer alive but silent); a dead peer frees the survivors at once. `client`: the process's
    SDK client (default: `recovery.client.connect()`). Other arguments are `DDPStrategy`'s."""

    strategy_name = "recovery_ddp"

    def __init__(self, timeout_s: float = 60.0, client: recovery.Client | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recovery_timeout_s = timeout_s
        self._client = client
        self.group: ProcessGroupRecovery | None = None
        self._module: torch.nn.Module | None = None  # the LightningModule DDP wraps (the same object every time)
        self._ddp: DistributedDataParallel | None = None  # the wrapper, rebuilt in place on every new group
        self._local = False  # collectives outside a step run on this process alone (see the module's docstring)
        self._in_step = False
        self._handed: dict[str, Any] | None = None  # the live state a restarted rank received, until loaded
        self._training_data = False  # the fit loop is setting its training data loaders up

    @property
    def client(self) -> recovery.Client:
        """The process's SDK client (the one this module connected at its import, unless one was given)."""
        if self._client is None:
            self._client = _connected
        return self._client

    # -- the group ----------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Form the SDK's process group of this process's generation (instead of `env://`), then agree with the
        live ranks: a restarted rank receives Lightning's whole state from the one furthest ahead."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        self.group = ProcessGroupRecovery(self.client, self._process_group_backend, self.recovery_timeout_s)
        self.group.holders.append(self._release)
        self.group.form()
        self._agree(joining=True)

    def _position(self) -> int:
        """Batches of the run this process has processed (-1: not training, its state is not live)."""
        trainer = self.lightning_module.trainer if self._module is not None else None
        if trainer is None or self._ddp is None:
            return -1
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)

    def _agree(self, joining: bool) -> bool:
        """Right after a (re)formation, on every member: exchange positions; where a live replica exists, the one
        furthest ahead hands its whole state to the members behind. True if this process then joins running ones
        (it loads what it received and keeps its collectives local until its first step)."""
        group = self.group
        assert group is not None
        import torch.distributed as dist

        mine = torch.tensor([self._position()], dtype=torch.int64, device=group.device)
        positions = [torch.zeros(1, dtype=torch.int64, device=group.device) for _ in range(group.world_size)]
        dist.all_gather(positions, mine)
        steps = [int(p[0]) for p in positions]
        best = max(steps)
        if best < 0:
            return False  # a new formation: every process starts from the script's own checkpoint, as under torchrun
        source = steps.index(best)
        behind = any(step != best for step in steps)
        if behind:
            state = self._live_state() if group.rank == source else None
            state = _broadcast(state, source, group.rank, group.device)
            if group.rank != source and steps[group.rank] < best:
                if not joining:
                    # A survivor whose step failed where another's completed: Lightning's loop cannot be moved on
                    # in place. It ends, and is restarted as a rank that joins (the others recover once more).
                    raise RuntimeError(f"rank {group.rank} is at batch {steps[group.rank]}, behind the live ranks' "
                                       f"{best}: it restarts and joins them")
                self._handed = state
        self._local = True
        logger.info("rank %d: %s at batch %d (state of rank %d)", group.rank,
                    "joining the running ranks" if joining else "recovered", best, source)
        return True

    def _live_state(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    def _release(self) -> None:
        """Drop DDP's hold on the group before it is destroyed; Lightning sees the bare module meanwhile."""
        if self._ddp is not None:
            self._ddp.__dict__.clear()
            self.model = self._module

    # -- the model ----------------------------------------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        self._module = model
        fresh = True
        if self._handed is not None:  # a restarted rank: the live replica's weights, then the rest once set up
            trainer = self.lightning_module.trainer
            connector = trainer._checkpoint_connector
            connector._loaded_checkpoint = self._handed
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()  # the optimizers, schedulers and loops follow (restore_training_state)
            self._handed = None
            fresh = False
        self._ddp = DistributedDataParallel.__new__(DistributedDataParallel)
        self._build(fresh)
        return self._ddp

    def _build(self, fresh: bool) -> None:
        """DDP on the current group around the same module; its buckets in parameter order on every rank, never
        rebuilt (a recovered run sums gradients in the order a fault-free one does)."""
        assert self._ddp is not None and self._module is not None
        DistributedDataParallel.__init__(self._ddp, module=self._module, device_ids=self.determine_ddp_device_ids(),
                                         init_sync=fresh, **self._ddp_kwargs)
        self._ddp.reducer._push_all_rebuilt_params()
        self._ddp.reducer._rebuild_buckets()
        self.model = self._ddp

    def _recover(self, error: str) -> None:
        """After the group failed: the next generation, the same collectives as a restarted rank's set-up (its
        positions, the live state, DDP's construction), then on."""
        assert self.group is not None
        self.group.recover(error)
        gc.collect()  # the failed generation's groups, whose last references went with the failed step
        self._agree(joining=False)
        self._build(fresh=False)
        if self.root_device.type == "cuda":
            self._register_ddp_hooks()

    # -- the step -----------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step, run again on the same batch after a recovery (the closure recomputes the loss
        and the gradients in the new group); then it is reported, and a stop the agent asked for ends `fit` here."""
        while True:
            failed, error = False, ""
            self._in_step = True
            try:
                output = super().optimizer_step(optimizer, closure, model, **kwargs)
                break
            except RuntimeError as exc:
                if self.group is None or not self.group.collective_failed(exc):
                    raise
                failed, error = True, str(exc)  # the text only: the exception's frames hold the group
            finally:
                self._in_step = False
            if failed:
                self._recover(error)
        self._local = False
        trainer = self.lightning_module.trainer
        client = self.client
        client.report_step(int(trainer.global_step) + 1)  # the step counted in `global_step` after this call
        if client.should_stop():
            trainer.should_stop = True
        return output

    def _outside_step(self, collective: Callable[[], Any], alone: Callable[[], Any]) -> Any:
        """A collective of the strategy's own: on this process alone until its first step after a (re)formation;
        a failure of the group here (not inside a step, whose retry covers it) recovers and goes on alone."""
        if self._local or self.group is None:
            return alone()
        if self._in_step:
            return collective()
        failed, error = False, ""
        try:
            return collective()
        except RuntimeError as exc:
            if not self.group.collective_failed(exc):
                raise
            failed, error = True, str(exc)
        if failed:
            self._recover(error)
        return alone()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier; on this process alone between a (re)formation and its next step."""
        self._outside_step(lambda: super(RecoveryDDPStrategy, self).barrier(*args, **kwargs), lambda: None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; `obj` itself between a (re)formation and this process's next step."""
        return self._outside_step(lambda: super(RecoveryDDPStrategy, self).broadcast(obj, src), lambda: obj)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce; `tensor` itself between a (re)formation and this process's next step."""
        return self._outside_step(lambda: super(RecoveryDDPStrategy, self).reduce(tensor, group, reduce_op),
                                  lambda: tensor)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's decision of every rank; this process's between a (re)formation and its next step."""
        return self._outside_step(lambda: super(RecoveryDDPStrategy, self).reduce_boolean_decision(decision, all),
                                  lambda: decision)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Lightning's all_gather; this process's tensor for every rank between a (re)formation and its next
        step."""
        world = self.world_size

        def alone() -> torch.Tensor:
            return torch.stack([tensor] * world)

        return self._outside_step(lambda: super(RecoveryDDPStrategy, self).all_gather(tensor, group, sync_grads),
                                  alone)

    # -- the data and the loop ----------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """A training loader that a restarted rank resumes in the running ranks' epoch, at their batch."""
        dataloader = super().process_dataloader(dataloader)
        if not self._training_data:
            return dataloader
        resumable = _Resumable(dataloader)
        if self._local:  # a restarted rank: the loop resumes in the running ranks' epoch, at their batch
            loop = self.lightning_module.trainer.fit_loop
            done = int(loop.epoch_loop.batch_progress.current.processed)
            resumable.epoch = int(loop.epoch_progress.current.processed)
            resumable.skip = done if 0 < done < len(resumable) else 0
        return resumable

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's set-up, with the fit loop's training data and SIGTERM flag made to follow the rules above."""
        super().setup(trainer)
        setup_data = trainer.fit_loop.setup_data

        def training_data() -> None:
            self._training_data = True
            try:
                setup_data()
            finally:
                self._training_data = False

        trainer.fit_loop.setup_data = training_data  # type: ignore[method-assign]
        # Lightning broadcasts rank 0's SIGTERM flag before each batch, outside the strategy: a restarted rank's
        # first one has no partner among survivors that are running the step again.
        loop = trainer.fit_loop.epoch_loop
        broadcast_flag = loop._broadcast_sigterm_tensor

        def sigterm_flag() -> None:
            if not self._local:
                broadcast_flag()

        loop._broadcast_sigterm_tensor = sigterm_flag  # type: ignore[method-assign]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save, then reported (`checkpoint_saved`, tier `storage`): a restart of the whole job
        resumes from the checkpoint Lightning's `ckpt_path="last"` loads, and the report names it."""
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:  # the whole state: one shard, which every replica holds
            self.client.checkpoint_saved(int(checkpoint.get("global_step", 0)), "storage", [0], str(filepath))

    def teardown(self) -> None:
        """Lightning's teardown, then the SDK's group closed (its watcher stopped) and the groups of earlier
        generations freed now: a gloo group left to the interpreter's finalisation may abort the process."""
        super().teardown()
        if self.group is not None:
            self.group.close()
            self.group = None
        gc.collect()


__all__ = ["RecoveryDDPStrategy"]

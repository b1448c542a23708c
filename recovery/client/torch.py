"""PyTorch helpers of the SDK: in-process recovery of a data-parallel job's survivors on gloo. torch is imported
inside the functions, so that `import recovery.client` never imports it.

A partial restart replaces only the dead ranks. The survivors notice on gloo (a collective with a dead peer raises a
`RuntimeError` within tens of milliseconds) and do not exit:

    group = ProcessGroupRecovery(client)
    group.form()                                    # the process group of the generation the agent gave us
    step = group.synchronize(0, get_state, set_state, live=plan is None)  # a restarted rank: a replica's state
    while step < steps:
        failed = False
        try:
            group.check()                           # a newer generation: peers replaced behind a live group
            train_one_step(step)                    # its collectives raise RuntimeError when a peer dies
        except RuntimeError:
            failed = True                           # leave the except block first: see `recover`
        if failed:
            group.recover()
            step = group.synchronize(step, get_state, set_state)
            continue
        step += 1
        client.report_step(step)

Generations live on the job's rendezvous store (never in a training process, so rank 0 may die like any other: the
agent of the job's first node serves it, or the platform off the training nodes, see `recovery.agent.rendezvous`),
under the job's run id: each generation's process group uses its own key prefix (`gen<g>/`), and a process started in
a new generation announces it under `recovery/generation`, which the survivors wait for. Where a survivor cannot notice
(blocked in a collective with a peer that is stopped rather than dead, or stuck in C++), the agent kills the
stuck peer, which turns it into the case above, or the process group's timeout ends the wait. Where the peers were
replaced while their processes live on (their node's agent died, so the engine moved them), `check` sees the newer
generation at the next step boundary; the old processes ask their agent before joining (`Client.may_join`), find
none or are refused, and exit instead of joining beside their replacements.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from recovery.client._client import Client

GENERATION_KEY = "recovery/generation"
POLL_S = 0.01
"""how often a survivor looks for the new generation: a store read, cheap against a restart's second"""


class RecoveryTimeout(TimeoutError):
    """No new generation came in time, or no agent answered whether to join it: the process exits, and the agent's
    report of it escalates."""


class RecoveryFenced(RuntimeError):
    """The agent does not run this process any more (its rank was replaced while the process outlived the agent
    that started it): it must not join the new generation beside its replacement, and exits."""


class GenerationChanged(RuntimeError):
    """A newer generation was announced while this process's collectives still worked: peers were replaced without
    this process noticing a failure (their node's agent died, not their processes). Handled as a failed collective:
    `recover`."""


class ProcessGroupRecovery:
    """The default process group of one rank, formed again in every generation. Not thread-safe."""

    def __init__(self, client: Client, backend: str = "gloo", timeout_s: float = 30.0,
                 wait_for_generation_s: float = 300.0, check_every_s: float = 1.0) -> None:
        self.client = client
        self.check_every_s = check_every_s
        self._checked = 0.0
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.wait_for_generation_s = wait_for_generation_s
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self._store: Any = None
        self.recoveries = 0

    @property
    def store(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=self.timeout, wait_for_workers=False)
            # Every key under the job's run id: a store the platform runs off the training nodes serves many jobs.
            run_id = os.environ.get("TORCHELASTIC_RUN_ID")
            self._store = dist.PrefixStore(f"{run_id}/", store) if run_id else store
        return self._store

    def _announced(self) -> int:
        store = self.store
        return int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else -1

    def form(self) -> None:
        """Join the process group of the client's generation, announcing the generation if it is new."""
        import torch.distributed as dist

        generation = self.client.generation
        if self._announced() < generation:
            self.store.set(GENERATION_KEY, str(generation))
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}/", self.store),
                                rank=self.rank, world_size=self.world_size, timeout=self.timeout)

    def check(self) -> None:
        """At a step boundary, before the step's collectives: raise `GenerationChanged` if a newer generation was
        announced (read at most every `check_every_s`, one store read). Ranks replaced while their processes kept
        running (the agent of their node died) are otherwise never noticed: the survivors would train on with those
        processes while the replacements wait to form the new group."""
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        if self._announced() > self.client.generation:
            raise GenerationChanged(f"generation {self._announced()} announced; this process is in "
                                    f"{self.client.generation}")

    def recover(self) -> None:
        """After a collective failed: tear the group down, wait for the next generation, form it.

        Call it outside the `except` block that caught the failure: the traceback holds the frames that hold
        the process group, so a teardown inside it frees nothing, and peers then wait out the group's timeout."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()  # at once: peers still blocked on us get "connection closed" now
        deadline = time.monotonic() + self.wait_for_generation_s
        while (generation := self._announced()) <= self.client.generation:
            if time.monotonic() > deadline:
                raise RecoveryTimeout(f"no generation after {self.client.generation} within "
                                      f"{self.wait_for_generation_s:g}s")
            # A dying checkpoint asked of this survivor (a healthy replica, MindIO TTP's power-off checkpoint) is
            # written while it waits: its state is that of its last reported step, and the restart may wait for it.
            self.client.at_boundary()
            time.sleep(POLL_S)  # polling the agent's store, within the deadline above
        # Only a process the node's agent runs may join: one that outlived its agent may have been replaced.
        answer = self.client.may_join(generation, max(0.0, deadline - time.monotonic()))
        if answer is None:
            raise RecoveryTimeout(f"no agent answered whether this process may join generation {generation} within "
                                  f"{self.wait_for_generation_s:g}s")
        if not answer:
            raise RecoveryFenced(f"the agent does not run this process any more: not joining generation "
                                 f"{generation}")
        self.client.generation = generation
        self.form()
        self.recoveries += 1
        self.client.joined(generation)

    def synchronize(self, step: int, get_state: Callable[[], Any], set_state: Callable[[Any], None],
                    live: bool = True) -> int:
        """Agree on the step with every replica and take the state of the one furthest ahead (the lowest rank of
        those): a restarted rank receives its state from a live replica (the `peer` tier), and survivors that
        disagree on whether the interrupted step completed all continue from the one where it did. Returns the
        step to train next. A process started to receive its state (`live=False`: a restarted rank whose plan
        names the `peer` tier) is never the source. Pure data parallelism: every rank holds the whole state."""
        import torch
        import torch.distributed as dist

        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(steps, torch.tensor([step if live else -1], dtype=torch.int64))
        values = [int(s.item()) for s in steps]
        best = max(values)
        if best < 0:
            raise RuntimeError("no replica holds live state: restart from a checkpoint instead")
        source = values.index(best)
        if len(set(values)) > 1:  # every replica at one step holds one state (a restart from a checkpoint)
            state = _broadcast(get_state() if self.rank == source else None, source, self.rank)
            if self.rank != source:
                set_state(state)
        return best

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _broadcast(state: Any, source: int, rank: int) -> Any:
    """`state` from `source` to every rank, serialised with torch.save (tensors byte for byte; broadcast_object_list
    would need numpy, which a training environment may not have)."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    data = b""
    if rank == source:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        size[0] = len(data)
    dist.broadcast(size, src=source)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == source else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=source)
    if rank == source:
        return state
    return torch.load(io.BytesIO(bytes(payload.untyped_storage())), weights_only=False)


def warm_up() -> None:
    """Pay now what a new process pays on its first step: autograd's first backward pass, an optimizer's first step
    (`torch._dynamo`'s import among it), a state's serialisation both ways. A warm standby calls it before it waits
    (`recovery.client.torch:warm_up` in the agent's `standby_preload`); the global random state is left as it was,
    so a rank handed to the standby draws the numbers a cold start would."""
    import torch

    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)

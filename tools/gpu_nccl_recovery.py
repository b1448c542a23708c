#!/usr/bin/env python
"""The SDK's in-process recovery on NCCL, on the one GPU a machine has: one process, a one-rank NCCL group of
`ProcessGroupRecovery` formed, a newer generation announced in the job store (as an agent's start of a replaced rank
announces it), the group aborted by the SDK's watcher, and formed again in the same process. Prints one JSON object.

NCCL takes one rank per GPU (two ranks on one device are refused: see `two_ranks_on_one_gpu`), so a dead peer cannot
be shown on one GPU; what is shown is every step of a survivor's side of it: the abort under a live group, the step
refused before the optimizer uses an aborted all_reduce's result, the teardown of an aborted communicator, the new
communicator in the same process, and training on with the state intact.

    python tools/gpu_nccl_recovery.py            # needs a GPU; used by tests/test_gpu.py and `bench.py gpu`
    python tools/gpu_nccl_recovery.py --two-ranks
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_T0 = time.monotonic()


def _stage(what: str) -> None:
    """Where the run is, on stderr: a run that hangs shows how far it came (and faulthandler where it waits)."""
    print(f"[{time.monotonic() - _T0:7.3f}s] {what}", file=sys.stderr, flush=True)


def recover_in_process() -> dict[str, object]:
    port = _free_port()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "RECOVERY_STORE_ADDR": "127.0.0.1",
                       "RECOVERY_STORE_PORT": str(port), "TORCHELASTIC_RUN_ID": "gpu-check"})
    import torch
    import torch.distributed as dist

    import recovery.client.ddp as resilient
    from recovery.client.torch import GENERATION_KEY, GenerationChanged

    # the job store, served by this process for its life
    _server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    figures: dict[str, object] = {"backend": "nccl", "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}
    _stage("forming the NCCL group of generation 0")
    started = time.monotonic()
    training = resilient.init_process_group("nccl", timeout_s=30)
    group = training.group
    figures["form_s"] = time.monotonic() - started
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    _stage("formed; wrapping the model in DDP")
    ddp = training.wrap(model, optimizer)
    _stage("training 3 steps")
    data = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        optimizer.zero_grad()
        ddp(data).sum().backward()
        optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # A step under way when the generation changes: its all_reduce queued, then the group aborted under it.
    optimizer.zero_grad()
    ddp(data).sum().backward()
    _stage("announcing generation 1")
    announced = time.monotonic()
    group.store.set(GENERATION_KEY, "1")  # as a process started into generation 1 announces it
    while not group.aborted and time.monotonic() - announced < 10:
        time.sleep(0.001)  # polling the flag the watcher sets, within the deadline above
    figures["announce_to_abort_s"] = time.monotonic() - announced
    figures["aborted"] = group.aborted
    _stage(f"aborted={group.aborted}; the optimizer's step")
    refused = False
    try:
        optimizer.step()  # the SDK's pre-step hook: the all_reduce's result comes from an aborted group
    except GenerationChanged:
        refused = True
    figures["optimizer_step_refused"] = refused
    figures["state_unchanged_by_refused_step"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    _stage("recovering: teardown, generation 1")
    recovering = time.monotonic()
    group.recover()
    _stage("formed generation 1; training on")
    figures["reform_s"] = time.monotonic() - recovering
    figures["generation"] = group.client.generation if group._formed is None else group._formed
    step = group.synchronize(7, lambda: {}, lambda _: None)
    total = torch.ones(4, device="cuda")
    dist.all_reduce(total)
    training._rewrap(fresh=False)
    optimizer.zero_grad()
    ddp(data).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    figures["after_recovery_all_reduce_ok"] = bool(torch.equal(total.cpu(), torch.ones(4)))
    figures["after_recovery_step_agreed"] = step
    figures["trained_after_recovery"] = not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _stage("closing")
    group.close()
    _stage("closed")
    return figures


def two_ranks_on_one_gpu() -> dict[str, object]:
    """Two processes, one NCCL group, both on GPU 0: formed and all_reduced, or NCCL's refusal."""
    import torch.multiprocessing as mp

    port = _free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    workers = [mp.get_context("spawn").Process(target=_two_ranks_worker, args=(rank, port, queue)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    results = []
    try:
        for _ in workers:
            results.append(queue.get())
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    return {"two_ranks_one_gpu": sorted(results, key=str)}


def _two_ranks_worker(rank: int, port: int, queue: object) -> None:
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30), device_id=torch.device("cuda", 0))
        value = torch.ones(1, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        queue.put(f"formed: all_reduce gave {value.item():g}")  # type: ignore[attr-defined]
        dist.destroy_process_group()
    except Exception as exc:  # NCCL's refusal is the finding
        queue.put(f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--two-ranks", action="store_true", help="try two ranks of one NCCL group on one GPU")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("GPU_CHECK_STACKS_AFTER_S", "60")), exit=True)
    print(json.dumps(two_ranks_on_one_gpu() if args.two_ranks else recover_in_process()), flush=True)
    os._exit(0)  # NCCL's and the store's threads may outlive a clean exit's joins


if __name__ == "__main__":
    main()

"""The rendezvous store of a job, never in a training process (rank 0 may die like any other).

Served one of two ways, as the job's entrypoint says (`rendezvous`):

- `agent`: by a small process the agent of the job's first node owns; it ends when its standard input closes, which
  is when the agent exits, however it exits. It is lost with that node.
- `external`: by a store the platform runs off the training nodes, beside the control plane (for example next to the
  daemon, behind the name the jobs' MASTER_ADDR gives), for the jobs that must survive the loss of any node; one
  store serves many jobs, each under its own key prefix (`recovery.client.torch`). Its own loss costs no running job
  anything (gloo's connections do not go through the store) until the next re-forming of a process group.

Why not move the store with the first node: the processes that survive a node loss keep their process and would have
to learn a new address from somewhere that also survived, and the engine knows no node's address. A store whose
address never changes is the simplest thing that every process, old or new, can always find.

    python -m recovery.agent.rendezvous --host 0.0.0.0 --port 29500            # the agent's: until stdin closes
    python -m recovery.agent.rendezvous --host 0.0.0.0 --port 29400 --serve    # the platform's: until SIGTERM

It prints `ready <port>` once the store listens. torch is imported here only, in this process.

It also serves every job's *torch stores*: a fresh TCPStore per formation of a job (the generation in which all its
ranks start: the first start, a job-level restart, a rescale), which the ranks' MASTER_ADDR/MASTER_PORT point at, as
torchrun gives every restart round a store of its own (torch's `env://` with `TORCHELASTIC_USE_AGENT_STORE=True`
connects every rank to MASTER_ADDR:MASTER_PORT as a client and uses its keys without a per-attempt prefix, so a
store that outlives a formation would hand the next one the dead formation's addresses). An agent asks for one by
pushing `whole <generation> <run id>` (its ranks start a new formation) or `join <generation> <run id>` (they join
the running one: a partial restart) onto the queue `recovery/torch-store/requests` of this store, and reads the
port under `<run id>/recovery/torch-store/<generation>`: every agent of the job gets the same answer without asking
the engine, whichever asks first. A formation's store is closed `--torch-store-linger-s` after a newer formation of
its job took over (its processes were stopped before the new ones started), and every store of a job that long
after `end 0 <run id>` (its agents say the job completed or failed). The key `recovery/torch-store/served`
says that this store serves them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

REQUESTS = "recovery/torch-store/requests"
SERVED = "recovery/torch-store/served"
DEFAULT_LINGER_S = 60.0
IDLE_POP = timedelta(hours=12)


def torch_store_key(run_id: str, generation: int) -> str:
    """Where the port of the torch store of `run_id`'s ranks started in `generation` is announced."""
    return f"{run_id}/recovery/torch-store/{generation}"


class TorchStores:
    """The torch stores of the jobs this rendezvous serves, one per formation (see the module's docstring)."""

    def __init__(self, host: str, linger_s: float, timeout: timedelta) -> None:
        self.host = host
        self.linger_s = linger_s
        self.timeout = timeout
        self.formations: dict[str, dict[int, Any]] = {}  # run id -> formation generation -> its TCPStore
        self.current: dict[str, int] = {}  # run id -> its newest formation
        self._lock = threading.Lock()

    def port_for(self, kind: str, generation: int, run_id: str) -> int:
        """The port of the store the ranks of `run_id` started in `generation` use."""
        from torch.distributed import TCPStore

        with self._lock:
            stores = self.formations.setdefault(run_id, {})
            if kind == "end":  # the job ended: none of its stores is needed any more
                self.current.pop(run_id, None)
                self._close_later(run_id, list(stores))
                return 0
            if kind == "join" and run_id in self.current:
                return int(stores[self.current[run_id]].port)  # a partial restart: the formation it joins
            if generation not in stores:
                stores[generation] = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                              timeout=self.timeout)
            if generation > self.current.get(run_id, -1):
                self.current[run_id] = generation
                self._close_later(run_id, [g for g in stores if g < generation])
            return int(stores[generation].port)

    def _close_later(self, run_id: str, generations: list[int]) -> None:
        if generations:
            closing = threading.Timer(self.linger_s, self._close, (run_id, generations))
            closing.daemon = True
            closing.start()

    def _close(self, run_id: str, generations: list[int]) -> None:
        with self._lock:
            stores = self.formations.get(run_id, {})
            for generation in generations:
                stores.pop(generation, None)  # the last reference: the server stops listening

    def serve(self, store: Any) -> None:
        """Answer the requests queued on `store` (a client of the job store, for this thread alone), forever."""
        # A blocking pop that times out logs two warnings of torch's: wait long (a poll timeout in milliseconds must
        # stay within 32 bits), so that an idle store does not write them every 30 s.
        store.set_timeout(IDLE_POP)
        while True:
            try:
                request = store.queue_pop(REQUESTS, block=True).decode()
            except Exception:  # the pop's timeout: nothing was asked meanwhile
                continue
            try:
                kind, generation, run_id = request.split(" ", 2)
                port = self.port_for(kind, int(generation), run_id)
            except Exception as exc:  # a bad request must not stop the others' answers
                print(f"bad torch-store request {request!r}: {exc}", file=sys.stderr, flush=True)
                continue
            if kind != "end":
                store.set(torch_store_key(run_id, int(generation)), str(port))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recovery.agent.rendezvous")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--serve", action="store_true", help="serve until SIGTERM or SIGINT, not until stdin closes")
    parser.add_argument("--torch-store-linger-s", type=float, default=DEFAULT_LINGER_S,
                        help="how long a job's torch store stays open after a newer formation of the job took over")
    args = parser.parse_args()
    # Every rank holds a connection to the job's stores: at 16,384 ranks the common soft limit of 1,024 open files
    # would refuse most of them. The hard limit is the node's to set; up to it is ours to take.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux caps open files at nr_open anyway
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a limit we cannot raise leaves the store as it was
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    from torch.distributed import TCPStore  # the only torch in the agent's processes, imported to serve the store

    stop = threading.Event()
    if args.serve:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    torch_stores = TorchStores(args.host, args.torch_store_linger_s, timedelta(seconds=30))
    store.set(SERVED, "1")
    threading.Thread(target=torch_stores.serve, args=(store.clone(),), name="torch-stores", daemon=True).start()
    print(f"ready {store.port}", flush=True)
    if args.serve:
        while not stop.wait(1.0):  # a timed wait, so that the signal's handler runs promptly
            pass
    else:
        sys.stdin.read()  # until the agent closes the pipe
    # Out at once: destroying the stores while the torch-stores thread still serves from a clone ends the process in
    # a C++ terminate with its trace on stderr. A server has nothing to flush but its output.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

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
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recovery.agent.rendezvous")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--serve", action="store_true", help="serve until SIGTERM or SIGINT, not until stdin closes")
    args = parser.parse_args()
    from torch.distributed import TCPStore  # the only torch in the agent's processes, imported to serve the store

    stop = threading.Event()
    if args.serve:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print(f"ready {store.port}", flush=True)
    if args.serve:
        while not stop.wait(1.0):  # a timed wait, so that the signal's handler runs promptly
            pass
    else:
        sys.stdin.read()  # until the agent closes the pipe
    del store


if __name__ == "__main__":
    main()

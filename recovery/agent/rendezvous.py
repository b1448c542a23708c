"""The rendezvous store of a job, served by a small process its agent owns, so that it never lives in a training
process (rank 0 may die like any other) and it lasts as long as the agent: the process ends when its standard
input closes, which is when the agent exits, however it exits.

    python -m recovery.agent.rendezvous --host 0.0.0.0 --port 29500

It prints `ready <port>` once the store listens. torch is imported here only, in this process.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recovery.agent.rendezvous")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    from torch.distributed import TCPStore  # the only torch in the agent's processes, imported to serve the store

    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print(f"ready {store.port}", flush=True)
    sys.stdin.read()  # until the agent closes the pipe
    del store


if __name__ == "__main__":
    main()

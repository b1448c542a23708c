"""`recovery-slurm`: the Slurm executor. It drains in Slurm the nodes the engine isolates, resumes them when the
engine releases them, and requeues an allocation that lost a node no spare can replace (docs/slurm.md).

    recovery-slurm --nats-url nats://nats-0:4222 --state-file /var/lib/recovery/slurm.seq

Run one per cluster, next to slurmctld, as SlurmUser or an account with AdminLevel=Operator. Every flag is also an
environment variable RECOVERY_SLURM_<FLAG> (`RECOVERY_SLURM_NATS_URL`...).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from recovery.service import jsonlog
from recovery.slurm.bridge import SlurmBridge
from recovery.slurm.scontrol import Scontrol


def _env(name: str, default: str) -> str:
    return os.environ.get(f"RECOVERY_SLURM_{name.upper()}", default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-slurm", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default=_env("nats_url", "nats://127.0.0.1:4222"),
                        help="the control plane's NATS (a cluster: its servers, comma-separated)")
    parser.add_argument("--stream", default=_env("stream", "RECOVERY"), help="the log's stream (default RECOVERY)")
    parser.add_argument("--state-file", default=_env("state_file", ""),
                        help="where the last decision acted on is kept, so that a restart goes on from there "
                             "(default: none; a restart starts at the end of the log)")
    parser.add_argument("--scontrol", default=_env("scontrol", "scontrol"), help="the scontrol program")
    parser.add_argument("--slurm-conf", default=_env("slurm_conf", ""),
                        help="SLURM_CONF for scontrol (default: the system's)")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"))
    parser.add_argument("--log-format", default=_env("log_format", "json"), choices=("json", "text"))
    return parser


async def serve(bridge: SlurmBridge) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(bridge.run)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        tg.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    jsonlog.setup(args.log_level, args.log_format, None)
    env = {"SLURM_CONF": args.slurm_conf} if args.slurm_conf else {}
    bridge = SlurmBridge(args.nats_url, Scontrol(args.scontrol, env), args.stream,
                         Path(args.state_file) if args.state_file else None)
    anyio.run(serve, bridge)
    return 0


if __name__ == "__main__":
    sys.exit(main())

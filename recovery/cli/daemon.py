"""`recovery-daemon`: the long-running I/O shell around the pure engine, on NATS JetStream.

    recovery-daemon                              # embedded nats-server in ./recovery-data, HTTP on :9464
    recovery-daemon --nats-url nats://nats:4222 --config /etc/recovery.toml
    recovery-daemon --demo --duration 60         # plus a simulated cluster, shown live in the terminal

The daemon itself is `recovery.service.daemon`; the demo is `recovery.service.demo`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# isort: split
from recovery.service import lean_nats  # noqa: F401  # first: nats-py without what the daemon never uses

# isort: split
import anyio
import orjson

from recovery.service import config as config_mod
from recovery.service import jsonlog, ownership
from recovery.service.config import ConfigError
from recovery.service.process import run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-daemon", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Every flag is also a TOML key and an environment variable "
                                            "RECOVERY_<KEY>; flags win over the environment, which wins over "
                                            "the file.")
    config_mod.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_mod.load(args)
    except ConfigError as exc:
        print(f"recovery-daemon: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.buffer.write(orjson.dumps(cfg.model_dump(mode="json"), option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    if cfg.demo:
        # Imported here for start-up time: the demo brings rich and the simulator, which a daemon does without.
        from recovery.service.demo import run_demo

        return run_demo(cfg)
    jsonlog.setup(cfg.log_level, cfg.log_format, cfg.log_file)
    if cfg.partitions > 1:
        return anyio.run(ownership.run, cfg)
    return anyio.run(run, cfg)


if __name__ == "__main__":
    sys.exit(main())

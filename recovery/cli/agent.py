"""`recovery-agent`: the node agent. It launches and supervises the ranks placed on its node, relays what they
report, and carries out the commands addressed to its node.

    recovery-agent --node gpu-17 --nats-url nats://nats-0:4222
    recovery-agent --config /etc/recovery/agent.toml

SIGTERM or SIGINT stops it as a platform stops a node it takes away: each live rank saves a dying checkpoint at
its step boundary and waits there, then gets SIGTERM, then SIGKILL (`preempt_grace_s` in all); the agent stays
`preempt_linger_s` to acknowledge the engine's commands about them, then exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import anyio

from recovery.agent import config as config_mod
from recovery.agent.agent import Agent
from recovery.agent.config import ConfigError
from recovery.agent.exits import crash_reason, record_exit
from recovery.service import jsonlog


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-agent", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Every flag is also a TOML key and an environment variable "
                                            "RECOVERY_AGENT_<KEY>; flags win over the environment, which wins "
                                            "over the file.")
    config_mod.add_arguments(parser)
    return parser


async def serve(agent: Agent) -> str:
    """Run the agent until a signal stops it: what stopped it."""
    stopped_by = "stopped"
    async with anyio.create_task_group() as tg:
        await tg.start(agent.run)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                stopped_by = f"stopped by {signal.Signals(signum).name}"
                break
        await agent.preempt()
        tg.cancel_scope.cancel()
    return stopped_by


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_mod.load(args)
        agent = Agent(cfg)
    except ConfigError as exc:
        print(f"recovery-agent: {exc}", file=sys.stderr)
        return 2
    jsonlog.setup(cfg.log_level, "json", None)
    try:
        stopped_by = anyio.run(serve, agent)
    except BaseException as exc:
        # kept for the next agent on this node to say (recovery.agent.exits): otherwise only this agent's own log
        # would tell a crash of the control plane's own part from a host that went down
        record_exit(agent.runtime_dir, crash_reason(exc))
        raise
    record_exit(agent.runtime_dir, stopped_by)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fleet's shape as the `fleet` benches and their simulated agents (`tools/bench_fleet_agents.py`) agree on it:
node names, ranks per node, jobs of 25 nodes, the agents' control subjects; and what the log stream holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js.api import StreamState

BENCH = "fleet"
AGENTS = Path(__file__).resolve().parent / "bench_fleet_agents.py"
"""the simulated agents' script: a process of its own per slice of the fleet"""
RPN = 8
"""ranks per node"""
NODES_PER_JOB = 25
CONTROL = "bench.fleet"
"""core-NATS subjects of the bench's own control of its simulated agents (nothing of the product's)"""


def node_name(index: int) -> str:
    return f"f{index:05d}"


def job_name(index: int) -> str:
    return f"fleet-{index:04d}"


def log_state(url: str, subjects_filter: str | None = None) -> StreamState:
    """The log stream's state now (with `subjects_filter`, the subjects it stored under it, and how many on each)."""
    async def read() -> StreamState:
        import nats

        nc = await nats.connect(url.split(","))
        try:
            return (await nc.jetstream(timeout=30).stream_info("RECOVERY", subjects_filter=subjects_filter)).state
        finally:
            await nc.close()

    return asyncio.run(read())


def stream_messages(url: str) -> int:
    """Messages the log holds now (inputs and outputs)."""
    return int(log_state(url).messages)

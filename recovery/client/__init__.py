"""The SDK a training script uses to talk to its node's `recovery-agent`: standard library only.

    import recovery.client as recovery

    client = recovery.connect()               # from the environment the agent gave this process
    plan = client.resume_plan()               # where to resume, or None on a first start
    client.on_save(lambda step: save(step))   # a dying checkpoint, when the agent asks for one
    for step in range(plan.next_step if plan else 0, steps):
        train_one_step(step)
        client.report_step(step + 1)          # steps completed; also runs a requested save here
    client.close()

Without an agent (no `RECOVERY_AGENT_SOCKET` in the environment) every call is a cheap no-op, so the same script
runs under a plain launcher. Heartbeats go from a background thread, so a rank that stops making progress but
still runs (blocked in a collective) is told from one that stopped altogether (SIGSTOP, a dead host).
`recovery.client.torch` holds the PyTorch helpers (in-process recovery of the survivors of a partial restart).
"""

from __future__ import annotations

from recovery.client._channel import AgentChannel
from recovery.client._client import Client, ResumePlan, ShardSource, connect

__all__ = ["AgentChannel", "Client", "ResumePlan", "ShardSource", "connect"]

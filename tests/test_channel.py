"""The agent's Unix socket for a job's processes (`recovery.agent.channel`) binds wherever the agent's runtime
directory is: a path too long for a Unix socket (108 bytes on Linux) is served at a short one that stands for it, and
the SDK reaches it through the path its environment names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from recovery.agent.channel import UNIX_PATH_MAX, ProcessChannel
from recovery.client._channel import AgentChannel


async def test_a_job_channel_under_a_runtime_directory_too_deep_for_a_unix_socket_is_served_and_reached(
        tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    wanted = deep / "a-job-with-a-long-name.sock"
    assert len(bytes(wanted)) > UNIX_PATH_MAX  # binding it would raise `AF_UNIX path too long`
    heard: list[dict[str, Any]] = []

    async def handler(message: dict[str, Any]) -> None:
        heard.append(message)

    channel = ProcessChannel(wanted, handler)
    assert len(bytes(channel.path)) <= UNIX_PATH_MAX
    assert ProcessChannel(wanted, handler).path == channel.path  # an agent started again serves the same one
    async with anyio.create_task_group() as tg:
        await tg.start(channel.serve)
        client = await anyio.to_thread.run_sync(AgentChannel, str(channel.path), lambda message: None)
        await anyio.to_thread.run_sync(client.send, {"op": "hello", "rank": 3, "attempt": 0, "pid": 1})
        try:
            with anyio.fail_after(30):
                while not heard:
                    await anyio.sleep(0.01)  # polling the handler's list, within the deadline above
        finally:
            client.close()
            tg.cancel_scope.cancel()
    assert heard[0]["op"] == "hello" and heard[0]["rank"] == 3
    assert not channel.path.exists()  # removed once served: nothing is left in the shared directory

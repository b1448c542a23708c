"""The daemon's parts: long-running tasks of one anyio task group, each in a cancel scope of its own, so that the
daemon ends them one at a time, in order, and a part that fails (or ends by itself) stops the daemon."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator

import anyio
from anyio.abc import TaskGroup

logger = logging.getLogger("recovery.daemon")


class Part:
    """One long-running piece of the daemon. Ending it asks first (`stop_requested`; the processor finishes its
    batch) and cancels it if it does not end in time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.scope = anyio.CancelScope()
        self.stop_requested = anyio.Event()
        self.ended = anyio.Event()

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    async def end(self, grace: float = 0.0) -> bool:
        """Ask the part to end, give it `grace` seconds, then cancel it; return once it has ended, True if it
        ended by itself."""
        self.stop_requested.set()
        if grace > 0 and not self.ended.is_set():
            with anyio.move_on_after(grace):
                await self.ended.wait()
        if self.ended.is_set():
            return True
        self.scope.cancel()
        await self.ended.wait()
        return False


class Parts:
    """The parts started in a task group, by name in the order they started. `failed(name, error)` is told when a
    part raises, or ends before it was asked to."""

    def __init__(self, failed: Callable[[str, BaseException], None]) -> None:
        self.group: TaskGroup | None = None
        self._failed = failed
        self._parts: dict[str, Part] = {}

    def start(self, name: str, body: Callable[[], Awaitable[None]]) -> Part:
        assert self.group is not None, "start parts inside the daemon's task group"
        part = self._parts[name] = Part(name)
        self.group.start_soon(self._run, part, body, name=f"recovery-{name}")
        return part

    async def _run(self, part: Part, body: Callable[[], Awaitable[None]]) -> None:
        try:
            with part.scope:
                await body()
        except Exception as exc:
            self._failed(part.name, exc)
        else:
            if not part.stopping:
                self._failed(part.name, RuntimeError(f"{part.name} ended by itself"))
        finally:
            part.ended.set()
            logger.info("part stopped", extra={"fields": {"part": part.name}})

    def get(self, name: str) -> Part | None:
        return self._parts.get(name)

    def __getitem__(self, name: str) -> Part:
        return self._parts[name]

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[Part]:
        return iter(list(self._parts.values()))

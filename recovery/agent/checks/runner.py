"""Running the node's health checks: all at once, each within its budget; the outcome cached while it is fresh, one
run shared by the callers that ask at once, and every run logged as `node.checked`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from events.health import CheckMoment, CheckResult, NodeChecked
from recovery.agent.jobs import CommandFailed

logger = logging.getLogger("recovery.agent")

Publish = Callable[[str, dict[str, Any]], None]
"""publish(event type, data) of a node event: the agent's `node_event`"""

FAULTS = frozenset({"device.fault", "network.link_down", "network.nic_errors"})
"""the node events after which the node's checks are run again before it takes ranks"""
WEAR_XIDS = frozenset({"92"})
"""device faults that are wear signals, not faults: a corrected ECC error leaves the GPU as good as it was"""
SAW_MAX = 1024  # `CheckResult.saw`'s bound


class Seen(NamedTuple):
    """What one check found: whether the node passes it, and what it saw (the figures it judged, or why not)."""

    ok: bool
    saw: str


@dataclass(frozen=True, slots=True)
class Check:
    """One health check: its name in `node.checked`, how long it may take, and the probe that looks."""

    name: str
    budget_s: float
    probe: Callable[[], Awaitable[Seen]]


class ChecksFailed(CommandFailed):
    """The node failed its health checks: the ranks that were to start here are not started."""


@dataclass
class _Run:
    epoch: int  # the faults seen when it started
    done: anyio.Event = field(default_factory=anyio.Event)
    record: NodeChecked | None = None  # None: it was cancelled before it ended


class HealthChecks:
    """The node's health checks (`checks`, none: the agent runs none and says so), run by `run` and asked of by
    the gate `ready_for` before ranks start. A passing run answers for `fresh_s`, unless a fault the agent reports
    (`faulted`) comes after it started."""

    def __init__(self, node: str, checks: Sequence[Check], publish: Publish, *, fresh_s: float, spare: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.checks = list(checks)
        self.publish = publish
        self.fresh_s = fresh_s
        self.spare = spare
        self.clock = clock
        self.last: NodeChecked | None = None
        self._epoch = 0  # faults seen: a run started before the last one says nothing of the node now
        self._passed: tuple[float, int] | None = None  # the last passing run's start (clock) and epoch
        self._inflight: _Run | None = None
        self._fault_seen: anyio.Event | None = None  # made on the event loop, by `serve`
        self._started: set[str] = set()  # the jobs whose ranks passed the gate here in this agent's life
        self.idle: Callable[[], bool] = lambda: False
        """whether no rank runs on the node now (the agent's): an idle spare's checks are run again in the
        background every `fresh_s / 2`, so that a grant finds a fresh pass and waits for no check"""

    @property
    def enabled(self) -> bool:
        return bool(self.checks)

    def announcement(self) -> dict[str, Any]:
        """What `node.joined` / `node.ready` say of the checks: that a `node.checked` follows (nothing without)."""
        return {"checks": True} if self.enabled else {}

    def fresh(self) -> bool:
        """The last run passed, no fault came since it started, and it is younger than `fresh_s`."""
        return self._clean() and self._passed is not None and self.clock() - self._passed[0] < self.fresh_s

    def _clean(self) -> bool:
        return self._passed is not None and self._passed[1] == self._epoch

    # -- running -----------------------------------------------------------------------------------------
    async def run(self, when: CheckMoment, job: str = "", *, changes_only: bool = False) -> NodeChecked | None:
        """Run every check and publish what they found as one `node.checked` (`changes_only`: only when the node
        passes where it failed last, or fails); a caller that comes while a run started since the last fault is in
        flight waits for it and gets its record instead. None without checks."""
        if not self.enabled:
            return None
        while (current := self._inflight) is not None:
            shared = current.epoch == self._epoch
            await current.done.wait()
            if shared and current.record is not None:
                return current.record
        run = self._inflight = _Run(self._epoch)
        try:
            started = self.clock()
            results: list[CheckResult | None] = [None] * len(self.checks)

            async def one(index: int, check: Check) -> None:
                results[index] = await _within_budget(check)

            async with anyio.create_task_group() as tg:
                for index, check in enumerate(self.checks):
                    tg.start_soon(one, index, check)
            record = NodeChecked(when=when, job=job, results=[r for r in results if r is not None])
            self._passed = (started, run.epoch) if record.ok else None
            unchanged = record.ok and self.last is not None and self.last.ok
            self.last = run.record = record
            if not (changes_only and unchanged):
                self.publish("node.checked", record.model_dump(mode="json"))
            if not record.ok:
                logger.warning("health checks (%s) failed on %s: %s", when, self.node, record.summary())
            return record
        finally:
            if self._inflight is run:
                self._inflight = None
            run.done.set()

    async def ready_for(self, job: str, when: CheckMoment) -> str | None:
        """The gate before ranks of `job` start here: None when the node passes (a fresh pass answers at once, and
        logs nothing), else what failed, in one line."""
        if not self.enabled or self.fresh():
            return None
        record = await self.run(when, job)
        return None if record is None or record.ok else record.summary()

    async def gate(self, job: str, *, moved_here: bool = False) -> None:
        """The gate where it is due: before the first start of `job`'s ranks here in this agent's life, before
        ranks moved here (to a spare, or any node), and before any start after a fault the checks have not passed
        since. Raises ChecksFailed, naming what failed."""
        if not self.enabled or (job in self._started and not moved_here and self._clean()):
            return
        failure = await self.ready_for(job, "spare" if moved_here or self.spare else "start")
        if failure is not None:
            raise ChecksFailed(f"health checks failed on {self.node}: {failure}")
        self._started.add(job)

    # -- faults --------------------------------------------------------------------------------------------
    def faulted(self) -> None:
        """A device or network fault on the node: the last pass says nothing any more, and `serve` runs the
        checks again at once, while the survivors are stopped, so that a restart's gate finds them done or in
        flight."""
        self._epoch += 1
        if self._fault_seen is not None:
            self._fault_seen.set()

    def watching(self, publish: Publish) -> Publish:
        """`publish` for the agent's probes: each fault they report also makes the checks stale."""
        def publish_then_check(type_: str, data: dict[str, Any]) -> None:
            publish(type_, data)
            if type_ in FAULTS and not (type_ == "device.fault" and str(data.get("code")) in WEAR_XIDS):
                self.faulted()

        return publish_then_check

    async def serve(self) -> None:
        """The agent's part: the checks at its start (`join`), then after each fault (`fault`), and on an idle
        spare every `fresh_s / 2` (`spare`, logged only when the outcome changes: a spare that went bad leaves the
        pool, one that passes again comes back), until cancelled."""
        if not self.enabled:
            return
        self._fault_seen = anyio.Event()
        await self.run("join")
        while True:
            with anyio.move_on_after(self.fresh_s / 2 if self.spare else math.inf):
                await self._fault_seen.wait()
            if self._fault_seen.is_set():
                self._fault_seen = anyio.Event()  # faults during the run below: one more run after it
                await self.run("fault")
            elif self.idle():  # never beside running ranks: a GPU check would compete with them
                await self.run("spare", changes_only=True)


async def _within_budget(check: Check) -> CheckResult:
    """One check's result: what its probe saw, or a failure past its budget or where the probe broke."""
    started = time.monotonic()
    seen = Seen(False, f"took more than {check.budget_s:g}s")
    with anyio.move_on_after(check.budget_s):
        try:
            seen = await check.probe()
        except Exception as exc:  # a probe that breaks fails its check, never the run or the agent
            logger.warning("health check %s broke", check.name, exc_info=True)
            seen = Seen(False, f"{type(exc).__name__}: {exc}")
    took = round(time.monotonic() - started, 3)
    return CheckResult(check=check.name, ok=seen.ok, saw=_one_line(seen.saw), took_s=took)


def _one_line(saw: str) -> str:
    flat = " ".join(saw.split())  # no control character reaches the record (`Text`)
    return flat if len(flat) <= SAW_MAX else flat[:SAW_MAX - 1] + "…"

"""A node's health checks, as its agent logs them (`node.checked`): which checks ran, when and why, what each saw.

Checks run before ranks land on a node: when its agent joins (a new node, one repaired or back from a drain), before
a job's ranks first start there, before a spare takes a job's ranks, and after a device or network fault on the nodes
a recovery would put ranks on again (while the survivors are stopped). The record is a fact of the log, so a replay
places ranks as the daemon did; the engine gives a node no ranks while its last checks failed
(`recovery.core.nodes`), nor a node that said checks would follow (`checks` on `node.joined` / `node.ready`) until
they passed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from events.values import Flag, Frozen, Label, Name, Seconds, Text

CheckMoment = Literal["join", "start", "spare", "fault"]
"""why the checks ran: the agent joined (`join`), a job's ranks were about to start on the node for the first time
(`start`), a spare was about to take a job's ranks (`spare`), a device or network fault on the node (`fault`)"""

MAX_CHECKS = 64
"""checks one record may hold: the built-in ones and the platform's own commands, with room"""


class CheckResult(Frozen):
    """One check's outcome."""

    check: Name = Field(description="the check's name: a built-in one (`memory`, `disk:<dir>`, `gpu-state`, "
                                    "`gpu-compute`, `collective`) or a configured command's")
    ok: Flag
    saw: Text = Field("", max_length=1024, description="what it saw: the figures it judged, or why it failed")
    took_s: Seconds = Field(0.0, description="how long it ran")


class NodeChecked(Frozen):
    """The node's agent ran its health checks; `ok` when every one passed."""

    when: CheckMoment
    job: Label = Field("", description="the job whose ranks the checks were run for ('' for a join or a fault)")
    results: list[CheckResult] = Field(min_length=1, max_length=MAX_CHECKS)

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    def failed(self) -> list[CheckResult]:
        return [result for result in self.results if not result.ok]

    def summary(self) -> str:
        """The failed checks and what each saw, in one line (empty when every check passed)."""
        return "; ".join(f"{r.check}: {r.saw}".rstrip(": ") for r in self.failed())

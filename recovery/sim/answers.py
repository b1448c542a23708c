"""Executors' answers a recorded night shows: a command the recorded executor carried out, failed, or never
answered, replayed for the command of the same kind and order that the simulated engine sends.

A recorded log's acks answer its own commands, whose ids the simulated engine does not repeat; what carries over is
that the executor of the n-th command of a kind (the n-th in-place restart, the n-th move) was done after that long,
failed with that reason after that long, or never answered. Under other policies the same holds: the n-th command of
that kind takes as long, or fails, and a policy that never sends one meets no failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DONE = "done"
"""the executor carried the command out: the simulated one carries it out after as long (its model may refuse it)"""
FAILED = "failed"
SILENT = "silent"
"""the executor never answered (the recorded attempt ran out its deadline)"""


@dataclass(frozen=True, slots=True)
class RecordedAnswer:
    """The recorded executor's answer to the `nth` (from 1) command of `kind` (as `answer_kind` names it)."""

    kind: str
    nth: int
    status: str
    """`DONE` (a done ack `after_s` after the command), `FAILED` (a failed ack `after_s` after it) or `SILENT` (no ack
    at all)"""
    after_s: float = 0.0
    reason: str = ""
    result: tuple[tuple[str, Any], ...] = ()
    """the failed ack's result, as recorded (a reset that failed names its devices: the engine reads them)"""

    @property
    def label(self) -> str:
        if self.status == SILENT:
            what = "never answered"
        elif self.status == DONE:
            what = f"done after {self.after_s:g} s"
        else:
            what = f"failed after {self.after_s:g} s" + (f" ({self.reason})" if self.reason else "")
        return f"{self.kind} #{self.nth} {what}"


def answer_kind(kind: str, mode: str | None = None, reset: bool = False) -> str:
    """A command's kind as answers are matched: a graceful stop and a kill, a restart with and without a device reset
    are different commands to an executor."""
    if kind == "stop_ranks":
        return f"stop_ranks:{mode or 'kill'}"
    if kind == "restart_ranks" and reset:
        return "restart_ranks:reset"
    return kind

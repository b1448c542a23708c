"""What the engine writes back into the log: decisions (with their commands and timers) and rejections."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from events.commands import Command
from events.values import Frozen


class TimerRequest(Frozen):
    id: str
    due: int = Field(description="nanoseconds of log time")
    every: int | None = Field(None, description="periodic: fire again this many nanoseconds after each due")


class Decision(Frozen):
    """One step the engine took for a job, with the record that caused it and the policy that chose it."""

    job: str
    cause_seq: int
    index: int = Field(description="position among the decisions caused by the same record")
    kind: str
    previous: str
    state: str
    incident: str | None = None
    policy: str | None = Field(None, description="name@version of the policy that chose this")
    reason: str = ""
    commands: list[Command] = Field(default_factory=list)
    timers: list[TimerRequest] = Field(default_factory=list)
    cancelled_timers: list[str] = Field(default_factory=list)
    detail: dict[str, Any] = Field(default_factory=dict)


class Rejection(Frozen):
    """An input the engine refused, and why; the daemon sends it to the dead-letter subject."""

    seq: int
    subject: str
    code: str
    reason: str
    event_id: str | None = None
    job: str | None = None
    node: str | None = None

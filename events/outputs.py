"""What the engine writes back into the log: decisions (with their commands and timers) and rejections.

Numbers here are strict (no boolean, no string) but carry no bounds: they are what the engine computed or copied
from a record, and the engine keeps them in range itself (a due time that would not fit 64 bits becomes an
`unencodable` rejection, not a validation error half way through a record). Strings are not pattern-checked
either: a rejection repeats the id it refused, which may be exactly the control character it refused it for.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from events.commands import Command
from events.names import DecisionKind
from events.values import Frozen, StrictInt


class TimerRequest(Frozen):
    id: str
    due: StrictInt = Field(description="nanoseconds of log time (the engine keeps it below 2^63)")
    every: StrictInt | None = Field(None, description="periodic: fire again this many nanoseconds after each due")


class Decision(Frozen):
    """One step the engine took for a job, with the record that caused it and the policy that chose it."""

    job: str
    cause_seq: StrictInt
    index: StrictInt = Field(description="position among the decisions caused by the same record")
    kind: DecisionKind
    previous: str = Field(description="the job's lifecycle state before this decision")
    state: str = Field(description="the job's lifecycle state after it: submitted, running, recovering, paused, "
                                   "completed, failed or cancelled")
    phase: str | None = Field(None, description="the phase of the recovery under way after this decision (planning, "
                                                "settling, waiting, saving, stopping, rescheduling, restoring, paused, "
                                                "closed), None while no incident is open")
    incident: str | None = None
    policy: str | None = Field(None, description="name@version of the policy that chose this")
    reason: str = ""
    commands: list[Command] = Field(default_factory=list)
    timers: list[TimerRequest] = Field(default_factory=list)
    cancelled_timers: list[str] = Field(default_factory=list)
    detail: dict[str, Any] = Field(default_factory=dict)


class Rejection(Frozen):
    """An input the engine refused, and why; the daemon sends it to the dead-letter subject."""

    seq: StrictInt
    subject: str
    code: str
    reason: str
    event_id: str | None = None
    job: str | None = None
    node: str | None = None

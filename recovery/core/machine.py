"""The per-job recovery state machine, defined once at class level with `transitions`.

One `Machine` serves every job: jobs are plain objects with a `state` attribute, and a trigger is fired
through the machine's event table (`fire(job, "stop")`). A `Machine` per job would cost ~20 KB and
~0.5 ms each, and `add_model` is quadratic in the number of models.
"""

from __future__ import annotations

from typing import Any, Protocol

from transitions import Machine, MachineError

STATES = [
    "submitted",  # accepted, processes not started yet
    "running",
    "suspect",  # a signal may be a fault: waiting for confirmation or for it to clear
    "saving",  # healthy replicas write a dying checkpoint
    "stopping",  # processes that must go are being stopped
    "rescheduling",  # restart, migrate, scale or retry commands are out
    "restoring",  # processes are back and loading: waiting for progress past the resume point
    "waiting",  # not enough healthy nodes: waiting for nodes to join
    "settling",  # a fault widened the incident mid-attempt: collecting further faults before the next attempt
    "paused",  # stopped by an operator, resumable
    "completed",
    "failed",
    "cancelled",
]
FINAL = frozenset({"completed", "failed", "cancelled"})
_ACTIVE = [s for s in STATES if s not in FINAL]
_RECOVERING = ["running", "suspect", "saving", "stopping", "rescheduling", "restoring", "waiting", "settling"]

TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "start", "source": "submitted", "dest": "running"},
    {"trigger": "suspect", "source": "running", "dest": "suspect"},
    {"trigger": "clear", "source": "suspect", "dest": "running"},
    {"trigger": "save", "source": _RECOVERING, "dest": "saving"},
    {"trigger": "stop", "source": _RECOVERING, "dest": "stopping"},
    {"trigger": "reschedule", "source": [*_RECOVERING, "paused"], "dest": "rescheduling"},
    {"trigger": "restore", "source": "rescheduling", "dest": "restoring"},
    {"trigger": "wait", "source": _RECOVERING, "dest": "waiting"},
    {"trigger": "settle", "source": _RECOVERING, "dest": "settling"},
    {"trigger": "recovered", "source": ["restoring", "waiting"], "dest": "running"},
    {"trigger": "pause", "source": _RECOVERING, "dest": "paused"},
    {"trigger": "complete", "source": _ACTIVE, "dest": "completed"},
    {"trigger": "fail", "source": _ACTIVE, "dest": "failed"},
    {"trigger": "cancel", "source": _ACTIVE, "dest": "cancelled"},
]

JOB_MACHINE = Machine(
    model=None, states=STATES, transitions=TRANSITIONS, initial="submitted", auto_transitions=False
)


class HasState(Protocol):
    state: str


class IllegalTransition(RuntimeError):
    """The engine asked for a transition the machine does not allow: a bug, never an input problem."""


def fire(job: HasState, trigger: str) -> None:
    """Fire `trigger` on `job`; a transition the machine does not define raises IllegalTransition."""
    try:
        ok = JOB_MACHINE.events[trigger].trigger(job)
    except MachineError as exc:
        raise IllegalTransition(f"{trigger!r} from {job.state!r}: {exc.value}") from exc
    if not ok:
        raise IllegalTransition(f"{trigger!r} from {job.state!r} was refused")


def mermaid() -> str:
    """The machine drawn as a Mermaid state diagram, generated from the definitions above."""
    lines = ["stateDiagram-v2", "    [*] --> submitted"]
    for t in TRANSITIONS:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for source in sources:
            lines.append(f"    {source} --> {t['dest']}: {t['trigger']}")
    lines.extend(f"    {s} --> [*]" for s in STATES if s in FINAL)
    return "\n".join(lines)

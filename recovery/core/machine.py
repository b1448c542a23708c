"""The two state machines of a job, each defined once at class level with `transitions`.

The job's lifecycle (`Job.state`): submitted, running, recovering, paused and the three final states. Whether
the job has open suspicions is a property of the job (`Job.suspects`), not a state.

The phase of the recovery under way (`Incident.phase`, the one place it is kept): an incident opens in
`planning`; the rescheduling policy's answer moves it to `settling` (collect further faults first), `waiting`
(for nodes) or into an attempt: `saving` (a dying checkpoint), `stopping`, `rescheduling` (the restart commands
are out), `restoring` (waiting for progress past the resume point); an operator's pause parks it in `paused`; it
ends `closed`. An attempt that ends without recovering goes back to `planning`.

One `Machine` serves every job (and one every incident): the models are plain objects with a `state` (or
`phase`) attribute, and a trigger is fired through the machine's event table. A `Machine` per job would cost
~20 KB and ~0.5 ms each, and `add_model` is quadratic in the number of models.
"""

from __future__ import annotations

from typing import Any, Protocol

from transitions import Machine, MachineError

STATES = [
    "submitted",  # accepted, processes not started yet
    "running",
    "recovering",  # an incident is open: see its phase
    "paused",  # stopped by an operator, resumable
    "completed",
    "failed",
    "cancelled",
]
FINAL = frozenset({"completed", "failed", "cancelled"})
_ALIVE = [s for s in STATES if s not in FINAL]

TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "start", "source": "submitted", "dest": "running"},
    {"trigger": "recover", "source": "running", "dest": "recovering"},
    {"trigger": "recovered", "source": "recovering", "dest": "running"},
    {"trigger": "pause", "source": "recovering", "dest": "paused"},
    {"trigger": "resume", "source": "paused", "dest": "recovering"},
    {"trigger": "complete", "source": _ALIVE, "dest": "completed"},
    {"trigger": "fail", "source": "recovering", "dest": "failed"},
    {"trigger": "cancel", "source": _ALIVE, "dest": "cancelled"},
]

PHASES = [
    "planning",  # the rescheduling policy decides the next attempt
    "settling",  # a fault widened the incident mid-attempt: collecting further faults before the next attempt
    "waiting",  # not enough usable nodes for what the policy chose: waiting for nodes to come back
    "saving",  # healthy replicas write a dying checkpoint, or the restart awaits one on its way
    "stopping",  # processes that must go are being stopped
    "rescheduling",  # restart, migrate, scale or retry commands are out
    "restoring",  # processes are back and loading: waiting for progress past the resume point
    "paused",  # an operator's pause stopped the job: the incident stays open until it resumes
    "closed",
]
_OPEN = [p for p in PHASES if p != "closed"]

PHASE_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "settle", "source": "planning", "dest": "settling"},
    {"trigger": "wait", "source": "planning", "dest": "waiting"},
    {"trigger": "plan", "source": [p for p in _OPEN if p != "planning"], "dest": "planning"},
    {"trigger": "save", "source": ["planning", "saving"], "dest": "saving"},  # again when the dying checkpoint failed
    {"trigger": "stop", "source": ["planning", "saving"], "dest": "stopping"},
    {"trigger": "reschedule", "source": ["planning", "saving", "stopping"], "dest": "rescheduling"},
    {"trigger": "restore", "source": "rescheduling", "dest": "restoring"},
    {"trigger": "pause", "source": "rescheduling", "dest": "paused"},
    {"trigger": "close", "source": _OPEN, "dest": "closed"},
]

JOB_MACHINE = Machine(
    model=None, states=STATES, transitions=TRANSITIONS, initial="submitted", auto_transitions=False
)
PHASE_MACHINE = Machine(
    model=None, states=PHASES, transitions=PHASE_TRANSITIONS, initial="planning", auto_transitions=False,
    model_attribute="phase",
)
JOB_DEST = {t["trigger"]: t["dest"] for t in TRANSITIONS}


class HasState(Protocol):
    state: str


class HasPhase(Protocol):
    phase: str


class IllegalTransition(RuntimeError):
    """The engine asked for a transition a machine does not allow: a bug, never an input problem."""


def fire(job: HasState, trigger: str) -> None:
    """Fire `trigger` on `job`'s lifecycle; a transition the machine does not define raises IllegalTransition."""
    _fire(JOB_MACHINE, job, trigger, job.state)


def fire_phase(incident: HasPhase, trigger: str) -> None:
    """Fire `trigger` on an incident's phase; a transition the machine does not define raises IllegalTransition."""
    _fire(PHASE_MACHINE, incident, trigger, incident.phase)


def _fire(machine: Machine, model: Any, trigger: str, now: str) -> None:
    try:
        ok = machine.events[trigger].trigger(model)
    except MachineError as exc:
        raise IllegalTransition(f"{trigger!r} from {now!r}: {exc.value}") from exc
    if not ok:
        raise IllegalTransition(f"{trigger!r} from {now!r} was refused")


def mermaid(machine: str = "job") -> str:
    """A machine (`job` or `phase`) drawn as a Mermaid state diagram, generated from its table above."""
    states, transitions, initial, final = ((STATES, TRANSITIONS, "submitted", FINAL) if machine == "job" else
                                           (PHASES, PHASE_TRANSITIONS, "planning", frozenset({"closed"})))
    lines = ["stateDiagram-v2", f"    [*] --> {initial}"]
    for t in transitions:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for source in sources:
            lines.append(f"    {source} --> {t['dest']}: {t['trigger']}")
    lines.extend(f"    {s} --> [*]" for s in states if s in final)
    return "\n".join(lines)

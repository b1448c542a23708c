"""Subject naming and the validation of the ids that become subject tokens.

A job or node id is one NATS subject token: it may not contain `.` (a token separator), `*` or `>`
(wildcards), whitespace or a control character, or a consumer filter on that id would match the wrong messages
(and a NUL or an escape sequence would reach every log and terminal that shows the id).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated

from pydantic import StringConstraints
from pydantic_core import PydanticCustomError

PREFIX = "recovery"
MAX_TOKEN_LENGTH = 128
CONTROL_CHARS = r"\x00-\x1f\x7f-\x9f"
"""C0 controls (NUL included), DEL and C1 controls, as a regular-expression class body that Python, Rust
(pydantic-core) and JSON Schema (ECMAScript) regular expressions read alike"""
_BAD_TOKEN = re.compile(rf"[.*>\s{CONTROL_CHARS}]")


def check_token(value: str) -> str:
    """Return `value` if it can be a subject token, else raise a `subject_token` validation error."""
    if not value:
        raise PydanticCustomError("subject_token", "id is empty and cannot be a subject token")
    if len(value) > MAX_TOKEN_LENGTH:
        raise PydanticCustomError(
            "subject_token", "id is longer than {limit} characters", {"limit": MAX_TOKEN_LENGTH}
        )
    bad = _BAD_TOKEN.search(value)
    if bad is not None:
        char = bad.group()
        control = ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F
        what = f"control character U+{ord(char):04X}" if control else repr(char)
        raise PydanticCustomError(
            "subject_token",
            "id {value} cannot be a subject token: it contains {char}",
            {"value": repr(value), "char": what},
        )
    return value


TOKEN_PATTERN = rf"^[^.*>\s{CONTROL_CHARS}]{{1,{MAX_TOKEN_LENGTH}}}$"
"""`check_token` as one regular expression, checked in pydantic-core without a call into Python (the control
characters are listed explicitly: Python's whitespace class holds the separators 0x1c-0x1f, Rust's does not).
`events.codec` turns its failure back into `check_token`'s `subject_token` error."""

Token = Annotated[str, StringConstraints(pattern=TOKEN_PATTERN)]
"""A job or node id: validated so that it is exactly one subject token."""


def job_event(job: str, type_: str) -> str:
    return f"{PREFIX}.ev.job.{job}.{type_}"


def node_event(node: str, type_: str) -> str:
    return f"{PREFIX}.ev.node.{node}.{type_}"


def live(node: str) -> str:
    """The core-NATS subject of a node's live beats (`recovery-agent` with `liveness = "live"`): no stream captures
    it, so a healthy node's "still alive" never reaches the log; the daemon's liveness monitor subscribes to `LIVE`."""
    return f"{PREFIX}.live.{node}"



def probe(node: str) -> str:
    """The core-NATS subject a node's agent answers on, whatever its liveness mode: the daemon asks it when something
    suggests the node is lost, and NATS's "no responders" says at once that no agent listens (`node.unreachable`)."""
    return f"{PREFIX}.probe.{node}"


def suspect(node: str) -> str:
    """The core-NATS subject on which a node's agent says that a rank it runs lost a peer's connection (the peer's
    process or host is gone, maybe with its agent): the daemon then probes the job's nodes (`SUSPECTS`)."""
    return f"{PREFIX}.suspect.{node}"


def reports(node: str) -> str:
    """The core-NATS subject of a node's periodic progress reports (`recovery-agent` with `progress = "summary"`): no
    stream captures it; the daemon folds what it hears into one `progress.summary` per job per period (`REPORTS`)."""
    return f"{PREFIX}.progress.{node}"

def decision(job: str) -> str:
    return f"{PREFIX}.dec.{job}"


def dead_letter(reason_code: str) -> str:
    return f"{PREFIX}.dlq.{reason_code}"


def command(node: str, job: str, kind: str) -> str:
    """A command goes to the agent of each node it concerns, on a subject that starts with that node, so that
    NATS permissions can confine an agent to its own node's commands (`node_commands`)."""
    return f"{PREFIX}.cmd.{node}.{job}.{kind}"


def command_parts(subject: str) -> tuple[str, str, str]:
    """(node, job, kind) of a command subject made by `command`; ValueError for any other subject."""
    head = f"{PREFIX}.cmd."
    parts = subject[len(head):].split(".", 2) if subject.startswith(head) else []
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"not a command subject: {subject!r}")
    return parts[0], parts[1], parts[2]


def node_commands(node: str) -> str:
    """The filter an agent reads its node's commands with."""
    return f"{PREFIX}.cmd.{node}.>"


def job_commands(node: str, job: str) -> str:
    """The filter of one job's commands to one node."""
    return f"{PREFIX}.cmd.{node}.{job}.>"


def command_msg_id(command_id: str, node: str) -> str:
    """The `Nats-Msg-Id` of a command's copy for one node: one command reaches several agents, and JetStream
    would drop every copy after the first if they shared the command's id."""
    return f"{command_id}@{node}"


EVENTS = f"{PREFIX}.ev.>"
LIVE = f"{PREFIX}.live.*"
SUSPECTS = f"{PREFIX}.suspect.*"
REPORTS = f"{PREFIX}.progress.*"
DECISIONS = f"{PREFIX}.dec.>"
DEAD_LETTERS = f"{PREFIX}.dlq.>"
COMMANDS = f"{PREFIX}.cmd.>"


_OUTPUT_PREFIXES = (f"{PREFIX}.dec.", f"{PREFIX}.dlq.")
_EVENTS_PREFIX = f"{PREFIX}.ev."

# -- partitions -------------------------------------------------------------------------------------------------
# With P > 1 partitions, the log stream maps every job event it stores into its partition's subject space
# (`recovery.p.<k>.ev.job.<job>.<type>`, k = `partition_of(job, P)`: JetStream's `partition()` transform, so that
# no publisher needs to know P); node events stay on their subject and every partition reads them.
PARTITIONED_EVENTS = f"{PREFIX}.p"
JOB_EVENTS = f"{PREFIX}.ev.job"
NODE_EVENTS = f"{PREFIX}.ev.node.>"
FENCES = f"{PREFIX}.fence"


def partition_of(token: str, count: int) -> int:
    """The partition JetStream's `partition(count, ...)` transform gives a subject token: FNV-1a (32 bits) of its
    bytes, modulo `count`."""
    h = 0x811C9DC5
    for byte in token.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % count


def partition_transform(count: int) -> tuple[str, str]:
    """(source, destination) of the log stream's subject transform that puts each job event in its partition."""
    return f"{JOB_EVENTS}.*.>", f"{PARTITIONED_EVENTS}.{{{{partition({count},1)}}}}.ev.job.{{{{wildcard(1)}}}}.>"


def stored_job_events(type_: str, partitioned: bool) -> str:
    """The subjects a log stores every job's events of `type_` under: `recovery.ev.job.*.<type_>`, or with
    partitions `recovery.p.*.ev.job.*.<type_>` (where the transform moved them). A reader of the log filters on
    these; a core-NATS subscriber sees the published subject, which the transform does not change."""
    if partitioned:
        return f"{PARTITIONED_EVENTS}.*.ev.job.*.{type_}"
    return job_event("*", type_)


STRAYS_PARTITION = 0
"""the partition that reads and dead-letters stray inputs (`stray_input`): one, so that each gets one dead letter"""


def partition_inputs(index: int) -> list[str]:
    """What partition `index` reads: its jobs' events and every node's. Partition `STRAYS_PARTITION` reads all of
    `recovery.ev.>` instead of the node events alone: the transform has moved every job event out of it, so what
    is left there beside the node events is the stray inputs, which a single daemon dead-letters and so must one
    of several partitions (none reading them, they were stored, answered by nobody and unseen by `verify`)."""
    return [f"{PARTITIONED_EVENTS}.{index}.ev.>", EVENTS if index == STRAYS_PARTITION else NODE_EVENTS]


def partition_reads(index: int) -> Callable[[str], bool]:
    """`partition_inputs(index)` as a test of a stored subject, for a partition that reads the whole log and passes
    over what is not its own: JetStream serves a consumer of two filters some twenty times slower than one of none
    (`docs/platform.md`), and every partition would read every node's events through one."""
    own = f"{PARTITIONED_EVENTS}.{index}.ev."
    shared = _EVENTS_PREFIX if index == STRAYS_PARTITION else NODE_EVENTS[:-1]

    def reads(subject: str) -> bool:
        return subject.startswith(own) or subject.startswith(shared)

    return reads


def stray_input(subject: str) -> bool:
    """Is `subject` under `recovery.ev.` but neither a job event's (`recovery.ev.job.<job>.<type>`, which the
    partition transform moves into its partition) nor a node event's: `recovery.ev.job.X`, `recovery.ev.other.x`?"""
    if not subject.startswith(_EVENTS_PREFIX):
        return False
    rest = subject[len(_EVENTS_PREFIX):]
    return not (rest.startswith("node.") or (rest.startswith("job.") and rest.count(".") >= 2))


def unpartitioned(subject: str) -> str:
    """The subject a partitioned job event was published on (`recovery.p.<k>.ev.job...` -> `recovery.ev.job...`);
    any other subject as it is."""
    if not subject.startswith(PARTITIONED_EVENTS + "."):
        return subject
    _, _, index, rest = subject.split(".", 3)
    return f"{PREFIX}.{rest}" if index.isdigit() and rest.startswith("ev.") else subject


def fence(stream_kind: str, key: str) -> str:
    """The subject a partition's owner claims in one stream (`log` or `cmd`): each output it publishes there
    expects that subject's last sequence to be its own claim, so that a stale owner's publishes are refused."""
    return f"{FENCES}.{stream_kind}.{key}"


def is_output(subject: str) -> bool:
    """Decisions and dead letters are the engine's own output, kept in the log for audit."""
    return subject.startswith(_OUTPUT_PREFIXES)

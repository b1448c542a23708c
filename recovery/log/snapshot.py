"""Engine snapshots: the engine's whole state as bytes, for the daemon's snapshot bucket, and back.

Restoring a snapshot and applying the rest of the log gives exactly the decisions a full replay gives. The header
names the format, the code (the package version and a digest of the sources the state's meaning depends on) and
the `name@version` of every policy the engine's jobs hold, so that a daemon started with other code or other
policies replays from the start instead.

Everything it needs is imported with the module: the daemon dumps a snapshot in a forked child, where an import
could wait forever on a lock that a thread of the parent held at the fork.
"""

from __future__ import annotations

import functools
import hashlib
import pickle  # the snapshot bucket is written only by the daemon itself: not untrusted input
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from orjson import dumps as orjson_dumps
from orjson import loads as orjson_loads

import events
import policies
import recovery.core
from policies.base import label
from recovery.core.engine import Engine

SNAPSHOT_FORMAT = 8
"""2: Engine._order and Engine._hungry; 3: Engine._finished and _submissions; 4: the engine in parts; 5: suspicions
hold typed Faults; 6: jobs keep their recent losses and the data they skip, incidents their bad steps; 7: jobs keep
which ranks' processes have spoken; 8: a resharded fsdp job keeps the shards of each world it trained in"""


def dump_snapshot(engine: Engine) -> bytes:
    """The engine's whole state, for the daemon's snapshot bucket: restoring it and applying the rest
    of the log gives exactly the decisions a full replay gives. The header names the format, the code and the
    `name@version` of every policy the engine's jobs hold (plugins included), so that a daemon started with other
    code or other policies replays from the start instead."""
    header = {"format": SNAPSHOT_FORMAT, "last_seq": engine.last_seq, "code": _code_version(),
              "policies": _policy_labels(engine)}
    return orjson_dumps(header) + b"\n" + pickle.dumps(engine, protocol=pickle.HIGHEST_PROTOCOL)


def open_snapshot(blob: bytes) -> Engine | str:
    """The engine in a snapshot, or why it cannot be restored into the running code."""
    head, _, body = blob.partition(b"\n")
    try:
        header = orjson_loads(head)
    except ValueError:
        return "the header is not JSON"
    if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT:
        return f"format {header.get('format') if isinstance(header, dict) else '?'}, this code reads {SNAPSHOT_FORMAT}"
    if header.get("code") != _code_version():
        return f"written by code {header.get('code')}, this is {_code_version()}"
    try:
        engine = pickle.loads(body)
    except Exception as exc:  # a plugin's class gone or changed under its name
        return f"cannot be unpickled by this code: {type(exc).__name__}: {exc}"
    if not isinstance(engine, Engine):
        return f"holds a {type(engine).__name__}, not an engine"
    # A plugin is not part of the code digest: a job's policy whose installed class now has another name or version
    # would decide differently from the one that made the state.
    for job in engine.jobs.values():
        for family in ("detection", "rescheduling", "checkpoint"):
            recorded = job.policies.labels.get(family)
            installed = label(getattr(job.policies, family))
            if recorded != installed:
                return f"job {job.id} ran {family} policy {recorded}; the installed one is {installed}"
    if header.get("policies") != _policy_labels(engine):
        return "the policies named in the header are not those the jobs hold"
    return engine


def load_snapshot(blob: bytes) -> Engine | None:
    """The engine in a snapshot, or None if it was written by other code, another format or other policies."""
    opened = open_snapshot(blob)
    return opened if isinstance(opened, Engine) else None


def _policy_labels(engine: Engine) -> list[str]:
    return sorted({value for job in engine.jobs.values() for value in job.policies.labels.values()})


def snapshot_seq(blob: bytes) -> int | None:
    head, _, _ = blob.partition(b"\n")
    try:
        return int(orjson_loads(head)["last_seq"])
    except (ValueError, KeyError, TypeError):
        return None


@functools.cache
def _code_version() -> str:
    """The package version and a digest of the sources a snapshot's meaning depends on (`events/`, `policies/`,
    `recovery/core/`): an editable install changes classes without a version bump, and an old snapshot must not
    load into new code."""
    try:
        release = version("recovery")
    except PackageNotFoundError:
        release = "unknown"
    digest = hashlib.sha256()
    for package in (events, policies, recovery.core):
        for source in sorted(Path(package.__file__).parent.glob("*.py")):  # type: ignore[arg-type]
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return f"{release}+{digest.hexdigest()[:16]}"

"""Find policies by name through the `recovery.policies` entry points: built-ins and plugins alike."""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points
from typing import Any, Literal

import orjson

from events.values import PolicyRef, PolicySelection
from policies.base import CheckpointPolicy, DetectionPolicy, PolicySet, ReschedulingPolicy, label

GROUP = "recovery.policies"
Family = Literal["detection", "rescheduling", "checkpoint"]


class PolicyError(ValueError):
    """A policy that cannot be found, is of the wrong family, or whose parameters are invalid."""


@cache
def available() -> dict[str, type]:
    """Every installed policy class by entry-point name, sorted by name."""
    found: dict[str, type] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        found[ep.name] = ep.load()
    return found


@cache
def _instance(name: str, family: Family, params_json: bytes) -> Any:
    classes = available()
    if name not in classes:
        raise PolicyError(f"no {family} policy named {name!r} (installed: {', '.join(classes) or 'none'})")
    cls = classes[name]
    if getattr(cls, "family", None) != family:
        raise PolicyError(f"policy {name!r} is a {getattr(cls, 'family', '?')} policy, not {family}")
    try:
        return cls(orjson.loads(params_json))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise PolicyError(f"{family} policy {name!r}: invalid parameters: {exc}") from exc


def load(ref: PolicyRef, family: Family) -> Any:
    """One instance per name and parameters: policies are pure, so jobs with equal choices share one."""
    return _instance(ref.name, family, orjson.dumps(ref.params, option=orjson.OPT_SORT_KEYS))


def load_set(selection: PolicySelection) -> PolicySet:
    detection: DetectionPolicy = load(selection.detection, "detection")
    rescheduling: ReschedulingPolicy = load(selection.rescheduling, "rescheduling")
    checkpoint: CheckpointPolicy = load(selection.checkpoint, "checkpoint")
    return PolicySet(
        detection,
        rescheduling,
        checkpoint,
        {"detection": label(detection), "rescheduling": label(rescheduling), "checkpoint": label(checkpoint)},
    )

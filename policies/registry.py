"""Find policies by name through the `recovery.policies` entry points: built-ins and plugins alike."""

from __future__ import annotations

import logging
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import orjson

from events.values import PolicyRef, PolicySelection
from policies.base import (
    FAMILY_BASES,
    CheckpointPolicy,
    DetectionPolicy,
    Family,
    PolicySet,
    ReschedulingPolicy,
    label,
)

GROUP = "recovery.policies"
logger = logging.getLogger("recovery.policies")


class PolicyError(ValueError):
    """A policy that cannot be found, is of the wrong family, or whose parameters are invalid."""


_METHODS: dict[str, tuple[str, ...]] = {family: tuple(sorted(base.__abstractmethods__))
                                        for family, base in FAMILY_BASES.items()}
"""what each family asks of a policy class: the abstract methods of its base"""


@cache
def _scan() -> tuple[dict[str, type], dict[str, str]]:
    """Every entry point of the group, loaded one at a time: the classes that loaded, and for each one that did not,
    why (named by its distribution and entry point). One broken plugin does not hide the others."""
    found: dict[str, type] = {}
    broken: dict[str, str] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        where = f"entry point {ep.name} = {ep.value}"
        if ep.dist is not None:
            where += f" of distribution {ep.dist.name} {ep.dist.version}"
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # a plugin's import may raise anything
            broken[ep.name] = f"{where} failed to load: {type(exc).__name__}: {exc}"
            logger.warning("policy plugin not loaded: %s", broken[ep.name])
    return found, broken


def available() -> dict[str, type]:
    """Every installed policy class that loads, by entry-point name, sorted by name."""
    return _scan()[0]


def broken() -> dict[str, str]:
    """Installed policies whose entry point failed to load, with the reason."""
    return _scan()[1]


@cache
def _instance(name: str, family: Family, params_json: bytes) -> Any:
    classes = available()
    if name not in classes:
        failed = broken().get(name)
        if failed is not None:
            raise PolicyError(f"{family} policy {name!r} is installed but cannot be used: {failed}")
        raise PolicyError(f"no {family} policy named {name!r} (installed: {', '.join(classes) or 'none'})")
    cls = classes[name]
    if getattr(cls, "family", None) != family:
        raise PolicyError(f"policy {name!r} is a {getattr(cls, 'family', '?')} policy, not {family}")
    # A subclass of the family's base that left a method abstract cannot be made: say which, as for a plain class.
    abstract = getattr(cls, "__abstractmethods__", frozenset())
    missing = [method for method in _METHODS[family]
               if not callable(getattr(cls, method, None)) or method in abstract]
    if missing:
        raise PolicyError(f"{family} policy {name!r} ({cls.__module__}.{cls.__qualname__}) lacks "
                          f"{', '.join(missing)}, which a {family} policy must have")
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

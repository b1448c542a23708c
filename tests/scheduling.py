"""How the suite is shared between pytest-xdist's workers (pyproject's addopts: `-n 2 --dist loadgroup`).

Every test of a module runs on one worker, in the module's order: a module-scoped fixture (a cluster, a daemon) is
set up once, and a test may build on what the one before it did (`tests/test_partitions_tools.py` does). The modules
on the session's end-to-end cluster (`shared_cluster`, `shared_fault_free`, `tests/conftest.py`) run together on one
worker, so that the cluster and its fault-free run are paid for once; they go first, being the suite's longest chain,
and the other worker takes the rest meanwhile (`--no-loadscope-reorder` keeps the collection's order).

xdist's own `loadgroup` reads `xdist_group` marks into the tests' ids, which pytest 9.2 no longer lets a plugin
change: every test went to its own worker, modules split in two. This scheduler tells the groups from the ids and the
modules' sources instead, on xdist's controller, which collects nothing; each worker's collection checks that the
sources say what the fixtures do (`check_groups`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

SHARED_CLUSTER = "shared-cluster"
SHARED_FIXTURES = ("shared_cluster", "shared_fault_free")


@functools.cache
def _names_the_shared_cluster(path: Path) -> bool:
    """Whether a function of the module takes one of the fixtures as a parameter (`(..., shared_cluster: Cluster`)."""
    return re.search(rf"[(,]\s*({'|'.join(SHARED_FIXTURES)})\s*:", path.read_text()) is not None


def group_of(nodeid: str, root: Path) -> str:
    """The group of the test `nodeid`: its module, or SHARED_CLUSTER."""
    module = nodeid.split("::")[0]
    return SHARED_CLUSTER if _names_the_shared_cluster(root / module) else module


def check_groups(items: list[pytest.Item], root: Path) -> None:
    """Put the shared cluster's group first (a stable sort: each module keeps its order); refuse a module whose
    source does not name the fixture its tests use, which the controller would place on either worker."""
    for item in items:
        uses = bool(set(SHARED_FIXTURES) & set(getattr(item, "fixturenames", ())))
        if uses != (group_of(item.nodeid, root) == SHARED_CLUSTER):
            raise pytest.UsageError(f"{item.nodeid}: {'uses' if uses else 'does not use'} the shared cluster, but "
                                    "its module's source says otherwise (tests/scheduling.py)")
    items.sort(key=lambda item: group_of(item.nodeid, root) != SHARED_CLUSTER)


class ModuleGroups(LoadScopeScheduling):
    """xdist's scheduler of scopes, a scope being a `group_of`."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid, self.config.rootpath)

"""The suite's split between pytest-xdist's workers (`tests/scheduling.py`): a module stays whole on one worker, and
the modules on the session's cluster stay together, first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.scheduling import SHARED_CLUSTER, check_groups, group_of

ROOT = Path(__file__).resolve().parent.parent


def test_the_modules_on_the_shared_cluster_are_one_group_and_every_other_module_its_own() -> None:
    assert group_of("tests/test_e2e_retry.py::test_a", ROOT) == SHARED_CLUSTER
    assert group_of("tests/test_e2e_recovery.py::test_b[2]", ROOT) == SHARED_CLUSTER  # through a fixture of its own
    assert group_of("tests/test_partitions_tools.py::test_c", ROOT) == "tests/test_partitions_tools.py"
    assert group_of("tests/test_partitions_tools.py::test_d", ROOT) == group_of("tests/test_partitions_tools.py::e",
                                                                               ROOT)


def test_the_shared_cluster_goes_first_each_module_in_its_order_and_a_module_its_source_misnames_is_refused() -> None:
    def item(nodeid: str, *fixtures: str) -> Any:
        return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))

    items = [item("tests/test_partitions_tools.py::a"), item("tests/test_e2e_retry.py::b", "shared_cluster"),
             item("tests/test_partitions_tools.py::c"), item("tests/test_e2e_dump.py::d", "shared_fault_free")]
    check_groups(items, ROOT)
    assert [i.nodeid.split("::")[1] for i in items] == ["b", "d", "a", "c"]
    with pytest.raises(pytest.UsageError, match="uses the shared cluster"):
        check_groups([item("tests/test_partitions_tools.py::e", "shared_cluster")], ROOT)
    with pytest.raises(pytest.UsageError, match="does not use the shared cluster"):
        check_groups([item("tests/test_e2e_retry.py::f")], ROOT)

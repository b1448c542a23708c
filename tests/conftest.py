"""Shared fixtures. `nats_server` is a real `nats-server -js` on a free port with its store in tmp_path;
`shared_cluster` the end-to-end cluster of `tests/e2e_cluster.py`, started once for the session's end-to-end modules
that leave its nodes as they found them, and `shared_fault_free` the parameters of its fault-free run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery.testing.nats import NatsServer
from tests.e2e_cluster import Cluster, fault_free_run, start_cluster
from tests.scheduling import ModuleGroups, check_groups

# The width of the caller's terminal is not the tests' to inherit: a pytest-xdist worker starts with COLUMNS=80 where
# the run had none, and the commands' output wraps at COLUMNS (`recovery.report.screen`). A test that wants a width
# sets it.
os.environ.pop("COLUMNS", None)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A running JetStream server (`.url`, `.port`, `.store_dir`); `stop()`/`kill()` and `start()` give an
    outage on the same port and store. Stopped at teardown."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One end-to-end cluster for every module that leaves n0-n3 and the spares as it found them: a test that needs
    a node to lose or to join starts agents of its own (`cluster.extra`), stopped with the cluster."""
    with start_cluster(tmp_path_factory.mktemp("e2e-shared")) as state:
        yield state


@pytest.fixture(scope="session")
def shared_fault_free(shared_cluster: Cluster) -> dict[str, Any]:
    return fault_free_run(shared_cluster, "shared-fault-free")


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


_deselected_gpu: set[str] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_gpu(config, items)
    check_groups(items, config.rootpath)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ModuleGroups | None:
    return ModuleGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


def _deselect_gpu(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run only where torch sees a GPU (tools/gpu_check.py runs them on one); elsewhere they are
    deselected, and the summary says how many and why."""
    if not any(item.get_closest_marker("gpu") for item in items) or _gpu_available():
        return
    kept = [item for item in items if item.get_closest_marker("gpu") is None]
    dropped = [item for item in items if item.get_closest_marker("gpu") is not None]
    _deselected_gpu.update(item.nodeid for item in dropped)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its collection is the one that deselected them
        workeroutput["gpu_deselected"] = sorted(_deselected_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller collects nothing itself: each worker says what it deselected (they all collect the same)."""
    _deselected_gpu.update(getattr(node, "workeroutput", {}).get("gpu_deselected", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _deselected_gpu:
        terminalreporter.write_line(f"{len(_deselected_gpu)} test(s) marked gpu deselected: no GPU found "
                                    "(tools/gpu_check.py runs them on a machine with one)")

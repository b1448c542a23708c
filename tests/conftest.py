"""Shared fixtures. `nats_server` is a real `nats-server -js` on a free port with its store in tmp_path;
`shared_cluster` the end-to-end cluster of `tests/e2e_cluster.py`, started once for the session's end-to-end modules
that leave its nodes as they found them, and `shared_fault_free` the parameters of its fault-free run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery.testing.nats import NatsServer
from tests.e2e_cluster import Cluster, fault_free_run, start_cluster


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

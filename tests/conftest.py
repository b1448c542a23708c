"""Shared fixtures. `nats_server` is a real `nats-server -js` on a free port with its store in tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from recovery.testing.nats import NatsServer


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

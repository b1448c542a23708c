"""The agent's torch-free TCPStore client against torch's own server, and the torch stores the job store serves: a
fresh one for every formation of a job, the running one for ranks that join it, the old ones closed."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from recovery.agent.jobs import end_torch_stores, torch_store_port
from recovery.agent.tcpstore import StoreError, TorchStore
from recovery.testing.nats import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def job_store() -> Iterator[int]:
    """`python -m recovery.agent.rendezvous` as an agent hosts it (until its stdin closes), old formations closed
    half a second after a newer one took over."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "recovery.agent.rendezvous", "--host", "127.0.0.1", "--port",
                             str(port), "--torch-store-linger-s", "0.5"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"ready"), "the job store did not start"
        yield port
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def test_the_client_speaks_the_protocol_of_torchs_store() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    async with await TorchStore.connect("127.0.0.1", server.port) as store:
        await store.set("a/b", "one")
        assert server.get("a/b") == b"one"
        server.set("c", "two")
        assert await store.check("c") and not await store.check("c", "missing")
        assert await store.wait("c", 1.0) and await store.get("c") == "two"
        started = time.monotonic()
        assert not await store.wait("missing", 0.3)
        assert 0.25 < time.monotonic() - started < 3.0
        await store.set("after-a-cancelled-wait", "still in step")
        assert await store.get("after-a-cancelled-wait") == "still in step"
        await store.queue_push("q", "request")
        assert server.queue_pop("q", block=True) == b"request"


async def test_no_store_at_the_address_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="no TCPStore"):
        await TorchStore.connect("127.0.0.1", free_port(), timeout_s=1.0)
    assert await torch_store_port("127.0.0.1", free_port(), "j", 0, True, 0.3) is None


async def test_every_formation_gets_a_fresh_store_that_its_late_joiners_share_and_old_ones_close(
        job_store: int) -> None:
    from torch.distributed import TCPStore

    first = await torch_store_port("127.0.0.1", job_store, "job-a", 0, True, 10.0)
    assert first is not None and first != job_store
    # every agent of the formation gets the same store, whichever asks first
    assert await torch_store_port("127.0.0.1", job_store, "job-a", 0, True, 10.0) == first
    other_job = await torch_store_port("127.0.0.1", job_store, "job-b", 0, True, 10.0)
    assert other_job not in (None, first)
    # a rank restarted alone (generation 1) joins the running formation's store
    assert await torch_store_port("127.0.0.1", job_store, "job-a", 1, False, 10.0) == first
    dead = TCPStore("127.0.0.1", first, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    dead.set("/default_pg/0//cpu//0/rank_0", "the dead formation's address")
    # a job-level restart (generation 2): a fresh store, without the dead formation's keys
    fresh = await torch_store_port("127.0.0.1", job_store, "job-a", 2, True, 10.0)
    assert fresh not in (None, first, other_job)
    store = TCPStore("127.0.0.1", fresh, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert not store.check(["/default_pg/0//cpu//0/rank_0"])
    del dead, store
    await closed(first)  # the old formation's, once the linger is over
    assert await torch_store_port("127.0.0.1", job_store, "job-b", 0, True, 10.0) == other_job
    await end_torch_stores("127.0.0.1", job_store, "job-b")  # job-b ended: its last formation's store closes too
    await closed(other_job)
    await (await TorchStore.connect("127.0.0.1", fresh, timeout_s=1.0)).aclose()  # job-a's runs on


async def closed(port: int | None, timeout_s: float = 10.0) -> None:
    assert port is not None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await TorchStore.connect("127.0.0.1", port, timeout_s=1.0)
        except StoreError:
            return
        assert time.monotonic() < deadline, f"the store on {port} is still open"
        time.sleep(0.05)  # polling interval of a deadline-bounded wait

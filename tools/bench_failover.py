"""The `failover` part of `python tools/bench.py daemon`: two daemons on one partition, and how long the standby
takes to answer once the active one is SIGKILLed or SIGTERMed."""

from __future__ import annotations

import time
from pathlib import Path

from bench_harness import Emit, note, sig
from bench_harness_daemon import Daemon


def failover(work: Path, url: str, emit: Emit, ttl_s: float = 10.0) -> None:
    """Two daemons on one partition: time from SIGKILL of the active one, and from its SIGTERM, until the standby
    answers /readyz (the lease's TTL, then restore and replay)."""
    with Daemon(work / "ha-a", url, instance="bench-a", lease_ttl_s=ttl_s) as first, \
            Daemon(work / "ha-b", url, instance="bench-b", lease_ttl_s=ttl_s) as second:
        failover_with(first, second, emit, ttl_s)


def failover_with(first: Daemon, second: Daemon, emit: Emit, ttl_s: float) -> None:
    first.start()
    first.wait_ready()
    second.start()
    deadline = time.monotonic() + 60
    while second.status().get("role") != "standby":
        if time.monotonic() > deadline:
            raise TimeoutError("the second daemon never stood by")
        time.sleep(0.01)  # polling interval of a deadline-bounded wait
    started = time.monotonic()
    first.stop(kill=True)
    second.wait_ready()
    killed = time.monotonic() - started
    first.start()
    while first.status().get("role") != "standby":
        if time.monotonic() > deadline + 60:
            raise TimeoutError("the first daemon never stood by")
        time.sleep(0.01)  # polling interval of a deadline-bounded wait
    started = time.monotonic()
    second.stop()
    first.wait_ready()
    handed = time.monotonic() - started
    first.stop()
    note(f"failover with a {ttl_s:g} s lease: standby ready {killed:.2f} s after SIGKILL of the active daemon, "
         f"{handed:.2f} s after its SIGTERM")
    emit("daemon", "failover_after_kill_s", sig(killed), f"s (lease_ttl_s {ttl_s:g})")
    emit("daemon", "failover_after_sigterm_s", sig(handed), "s")

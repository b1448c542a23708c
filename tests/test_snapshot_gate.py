"""The snapshots of one process's partitions: none is captured while another partition of the process is being
taken over (its failover), for at most `TAKEOVER_HOLD_S`."""

from __future__ import annotations

from recovery.service.snapshots import TAKEOVER_HOLD_S, CaptureGate


def test_no_capture_while_another_partition_is_taken_over() -> None:
    now = [100.0]
    gate = CaptureGate(clock=lambda: now[0])
    a, b, c = object(), object(), object()
    assert gate.open(a) and gate.open(b)
    gate.taking_over(c)
    assert gate.open(c) and not gate.open(a) and not gate.open(b)  # c's takeover holds the others back
    gate.release(c)  # caught up
    assert gate.open(a)

    gate.taking_over(c)
    now[0] += TAKEOVER_HOLD_S - 0.1
    assert not gate.open(a)
    now[0] += 0.1  # a takeover that never catches up holds the others no longer than this
    assert gate.open(a) and gate.open(b)

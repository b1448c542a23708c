"""Isolation is a state with a way out, and a move that did not happen leaves no trace in the placement."""

from __future__ import annotations

from typing import Any

from events.commands import MigrateRanks
from recovery.testing.scenario import Scenario


def lemon(isolation_s: float | None) -> Scenario:
    """A job with a spare whose GPU f1/2 reaches the frequency threshold: isolated, its ranks moved to the spare."""
    s = Scenario()
    s.spare("spare0")
    detection: dict[str, Any] = {"name": "default", "params": {"isolation_s": isolation_s}}
    s.submit("freq", ["f0", "f1"], ranks_per_node=4, dp=8, policies={"detection": detection})
    s.train("freq", 5)
    s.checkpoint("freq", 5, "storage", "storage")
    for _ in range(3):
        s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.ack_all()
    s.train("freq", 2)
    return s


def test_an_isolation_expires_after_the_policy_s_isolation_s_with_a_decision() -> None:
    s = lemon(isolation_s=60)
    node = s.engine.cluster.nodes["f1"]
    assert 2 in node.isolated_devices and not node.usable
    s.train("freq", 61)  # the job trains on meanwhile
    [released] = s.find("hardware.released", "freq")
    assert "expired" in released.reason and released.detail == {"node": "f1", "device": 2, "by": "expiry"}
    assert 2 not in node.bad_devices and 2 not in node.isolated_devices


def test_an_operator_releases_an_isolated_device_and_only_an_isolated_one() -> None:
    s = lemon(isolation_s=None)
    rejected = s.job_event("freq", "operator.release", node="f0", device=1)
    assert [r.code for r in s.rejections] == ["invalid_state"] and rejected
    s.job_event("freq", "operator.release", node="f1", device=2, reason="GPU replaced")
    [released] = s.find("hardware.released", "freq")
    assert released.reason == "an operator released f1 device 2: GPU replaced"
    assert s.engine.cluster.nodes["f1"].usable  # the job left it: it may take ranks again


def test_a_repaired_device_ends_its_isolation_with_a_decision() -> None:
    s = lemon(isolation_s=None)
    s.node_event("f1", "device.recovered", device=2)
    assert not s.find("hardware.released", "freq")  # the job left f1: nobody's decision to make
    s2 = Scenario()
    s2.submit("keep", ["k0", "k1"], ranks_per_node=4, dp=8)
    s2.train("keep", 2)
    for _ in range(3):  # no rank of the job uses device 6: isolated without a move, the job keeps the node
        s2.node_event("k1", "device.fault", device=6, vendor="nvidia", code="63")
    s2.node_event("k1", "device.recovered", device=6)
    [released] = s2.find("hardware.released", "keep")
    assert released.detail["by"] == "repair" and "k1 device 6 recovered" in released.reason


def test_a_move_that_fails_at_the_executor_is_undone_and_its_spare_returns_to_the_pool() -> None:
    s = Scenario()
    s.spare("s0")
    s.submit("mv", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("mv", 5)
    s.checkpoint("mv", 5, "storage", "storage")
    s.node_event("n1", "device.fault", device=0, vendor="nvidia", code="79")
    for _ in range(5):
        moves = [c for c in s.outstanding() if isinstance(c, MigrateRanks)]
        if moves:
            break
        s.ack_all(rounds=1)
    [move] = moves
    assert s.engine.jobs["mv"].nodes == ["n0", "s0"]
    s.ack(move, "failed", "executor error")
    # The ranks never left n1: the next try moves them from n1 again, to the spare given back to the pool. Before,
    # it named s0 as the node to leave, which the job was never on, and s0 was lost to the pool for good.
    for _ in range(5):
        again = [c for c in s.outstanding() if isinstance(c, MigrateRanks) and c.id != move.id]
        if again:
            break
        s.ack_all(rounds=1)
    [retry] = again
    assert (retry.from_node, retry.to_node) == ("n1", "s0")

"""Health checks in the engine (`node.checked`, `recovery.core.nodes`): a node whose checks failed takes no ranks, a
spare that failed is never granted, a node whose agent said checks follow takes no new ranks until they pass, and a
failed check on a node holding a job's ranks moves them to a spare. All from the log: a replay decides the same."""

from __future__ import annotations

from typing import Any

from events.commands import MigrateRanks
from recovery.log.recorder import replay
from recovery.service.fleet import node_rows
from recovery.testing.scenario import Scenario


def _checked(s: Scenario, node: str, ok: bool, when: str = "join", job: str = "", saw: str = "") -> None:
    results: list[dict[str, Any]] = [{"check": "memory", "ok": True, "saw": "61.2 GiB free", "took_s": 0.001},
                                     {"check": "disk:/ckpt", "ok": ok, "saw": saw or "412 GiB free, 850 MB/s",
                                      "took_s": 0.05}]
    s.node_event(node, "node.checked", when=when, job=job, results=results)


def _running_with_spares(*spares: str) -> Scenario:
    s = Scenario()
    for name in spares:
        s.node_event(name, "node.joined", spare=True, devices=8, checks=True)
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("llm", 6)
    s.checkpoint("llm", 6, "storage", "storage")
    return s


def _moved_to(s: Scenario) -> list[str]:
    return [c.to_node for c in s.commands_of("migrate_ranks") if isinstance(c, MigrateRanks)]


def test_a_spare_whose_checks_failed_is_never_granted_the_next_one_is() -> None:
    s = _running_with_spares("s0", "s1")
    _checked(s, "s0", False, saw="0.2 GiB free")  # s0 joined first: without its checks it would be taken
    _checked(s, "s1", True)
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("llm", 25, ranks=range(4))  # n0's ranks live on; n1's not-ready outlasts its 20 s grace
    s.ack_all()
    assert _moved_to(s) == ["s1"], s.kinds("llm")
    rows = {row["node"]: row for row in node_rows(s.engine)}
    assert rows["s0"]["out"] == "failed health checks: disk:/ckpt: 0.2 GiB free"
    assert rows["s1"]["out"] is None and rows["s1"]["job"] == "llm"


def test_a_spare_that_said_checks_follow_is_not_granted_before_they_pass() -> None:
    s = _running_with_spares("s0")
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("llm", 25, ranks=range(4))  # n0's ranks live on; n1's not-ready outlasts its 20 s grace
    s.ack_all()
    assert _moved_to(s) == []  # s0's checks have not come: it takes no ranks, the job waits for a node
    assert s.phase("llm") == "waiting", s.kinds("llm")
    assert {row["node"]: row["out"] for row in node_rows(s.engine)}["s0"] == "health checks not passed yet"
    _checked(s, "s0", True)
    s.ack_all()
    assert _moved_to(s) == ["s0"]


def test_a_failed_check_on_a_node_holding_ranks_moves_them_to_a_spare() -> None:
    s = _running_with_spares("s0")
    _checked(s, "s0", True)
    _checked(s, "n1", False, when="fault", saw="write 0.4 MB/s, below 10")  # after a fault its agent saw
    s.ack_all()
    [fault] = s.find("fault.confirmed", "llm")
    assert "n1 failed its health checks: disk:/ckpt: write 0.4 MB/s" in fault.reason, fault.reason
    assert fault.detail["fault"]["code"] == "health_check" and fault.detail["fault"]["node"] == "n1"
    assert _moved_to(s) == ["s0"]
    s.train("llm", 2)
    assert s.state("llm") == "running"
    again = replay(list(s.log.records()))
    assert again.decisions == again.recorded_decisions == s.decisions


def test_a_spare_failing_its_check_when_granted_hands_the_move_to_the_next_spare() -> None:
    s = _running_with_spares("s0", "s1")
    _checked(s, "s0", True)
    _checked(s, "s1", True)
    s.node_event("n1", "node.not_ready", reason="kernel panic")
    s.idle("llm", 25, ranks=range(4))  # n0's ranks live on; n1's not-ready outlasts its 20 s grace
    [move] = [c for c in s.outstanding("migrate_ranks") if isinstance(c, MigrateRanks) and c.to_node == "s0"]
    # s0's agent checks before the ranks start there and finds it cannot train: no rank starts, the move fails
    _checked(s, "s0", False, when="spare", job="llm", saw="ECC uncorrectable 3")
    s.ack(move, "failed", "health checks failed on s0: disk:/ckpt: ECC uncorrectable 3", node="s0")
    s.advance(3)  # the fault widened the incident: it settles 2 s before the next attempt
    s.ack_all()
    assert _moved_to(s)[-1] == "s1", s.kinds("llm")
    s.train("llm", 2)
    assert s.state("llm") == "running" and "s0" not in s.engine.jobs["llm"].nodes


def test_a_repaired_node_stays_out_until_its_checks_pass() -> None:
    s = Scenario()
    s.submit("host", ["h0", "h1"], ranks_per_node=4, dp=2, tp=4)
    s.train("host", 10)
    s.checkpoint("host", 10, "storage", "storage")
    s.node_event("h1", "node.not_ready", reason="kernel panic")
    s.idle("host", 25, ranks=range(4))
    assert s.phase("host") == "waiting"
    s.node_event("h1", "node.joined", spare=False, devices=8, checks=True)  # repaired, its checks to come
    s.ack_all()
    assert s.phase("host") == "waiting"
    _checked(s, "h1", False, saw="still bad")  # the repair did not hold
    s.ack_all()
    assert s.phase("host") == "waiting"
    _checked(s, "h1", True)  # the next repair did
    s.ack_all()
    s.train("host", 2)
    assert s.state("host") == "running" and s.engine.jobs["host"].nodes == ["h0", "h1"]


def test_an_agent_started_again_beside_its_ranks_keeps_them_while_it_checks() -> None:
    s = _running_with_spares()
    s.node_event("n1", "node.ready", checks=True)  # its agent restarted; the ranks it adopts keep running
    s.job_event("llm", "process.exited", rank=1, exit_code=1)  # a fault meanwhile: a restart in place, not a move
    s.ack_all()
    assert _moved_to(s) == [] and s.engine.jobs["llm"].nodes == ["n0", "n1"]

"""A command addressed to several nodes is done when every node's agent says so, not at the first `done`; a node
an incident declared gone is not waited for."""

from __future__ import annotations

from recovery.testing.scenario import Scenario

NO_LIVE_STATE = {"checkpoint": {"name": "newest-complete", "params": {"dying": False, "peer": False}}}


def test_a_stop_on_two_nodes_waits_for_both_agents_before_the_restart() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.train("j", 10)
    s.job_event("j", "operator.force", granularity="restart_job", reason="driver update")
    [stop] = s.outstanding("stop_ranks")
    s.ack(stop, node="n0")
    assert not s.commands_of("restart_job"), "restarted while n1 was still stopping its ranks"
    assert s.phase("j") == "stopping"
    s.ack(stop, node="n0")  # a duplicate from the same node changes nothing
    assert not s.commands_of("restart_job")
    s.ack(stop, node="n1")
    assert s.commands_of("restart_job")
    assert s.kinds("j").count("ranks.stopped") == 1


def test_a_failed_ack_from_one_node_fails_the_command_whatever_the_other_said() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.train("j", 10)
    s.job_event("j", "operator.force", granularity="restart_job", reason="driver update")
    [stop] = s.outstanding("stop_ranks")
    s.ack(stop, node="n0")
    s.ack(stop, status="failed", reason="rank 3 did not end", node="n1")
    assert "attempt.failed" in s.kinds("j")


def test_an_ack_that_names_no_node_completes_the_command_as_before() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, policies=NO_LIVE_STATE)
    s.train("j", 10)
    s.job_event("j", "operator.force", granularity="restart_job", reason="driver update")
    [stop] = s.outstanding("stop_ranks")
    s.ack(stop)
    assert s.commands_of("restart_job")


def test_a_migration_off_a_silent_node_is_done_when_the_spare_says_so() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.spare("s0")
    s.train("j", 10)
    s.idle("j", 30, ranks=[2, 3])  # only n1's ranks report: n0 is gone with its agent
    [migrate] = s.outstanding("migrate_ranks")
    assert migrate.from_node == "n0" and migrate.to_node == "s0"  # type: ignore[attr-defined]
    s.ack(migrate, node="s0")
    assert s.phase("j") == "restoring"

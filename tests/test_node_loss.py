"""A node lost whatever the job is doing: its agent's silence is found during a recovery too, an attempt that waits
on the lost agent is superseded at once, and the job moves to a spare, for a stock script and for the SDK, whether
the node's silence or its survivors' exits (gloo's `Connection reset by peer`) are heard first. Engine only: the
agents are played by `_Agents`, which answer for the nodes that live and never for the lost one."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.values import FaultClass, Granularity
from policies.base import NS, AttemptSummary, RescheduleContext, StartRung
from policies.rescheduling import LadderRescheduling
from recovery.core.addressing import command_nodes
from recovery.testing.scenario import Scenario

AGENT_SILENCE_S = 5.0  # the default detection's agent_silence_s
WATCHDOG_S = 1.0


class _Agents:
    """The agents of the nodes in `live`: each heartbeats once a second and reports every command addressed to its
    node done; an SDK job's ranks report a step a second while every node of the job lives (a group with a rank on
    a lost node cannot train)."""

    def __init__(self, s: Scenario, job: str, live: set[str], sdk: bool) -> None:
        self.s, self.job, self.live, self.sdk = s, job, live, sdk
        self.acked: set[tuple[str, str]] = set()

    def second(self) -> None:
        s = self.s
        s.advance(1)
        for node in sorted(self.live):
            s.node_event(node, "node.heartbeat", interval_s=1.0)
        job = s.engine.jobs[self.job]
        for command in s.outstanding():
            for node in command_nodes(command, job.node_of, job.nodes):  # type: ignore[arg-type]
                if node in self.live and (command.id, node) not in self.acked:
                    self.acked.add((command.id, node))
                    s.ack(command, node=node)
        if self.sdk and set(job.nodes) <= self.live and job.state in ("running", "recovering"):
            s.steps(self.job, job.step + 1)

    def until(self, done: object, seconds: int) -> int:
        """Play seconds until `done()` holds; the seconds it took."""
        for second in range(1, seconds + 1):
            self.second()
            if done():  # type: ignore[operator]
                return second
        raise AssertionError(f"not done within {seconds} s: {self.s.kinds(self.job)[-8:]}")


def _job(sdk: bool) -> tuple[Scenario, _Agents]:
    s = Scenario()
    s.spare("sp0")
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, max_restarts=3, watchdog_interval_s=WATCHDOG_S)
    agents = _Agents(s, "j", {"n0", "n1", "sp0"}, sdk)
    for _ in range(10):
        agents.second()
    assert s.state("j") == "running" and s.engine.jobs["j"].sdk is sdk
    return s, agents


def _kill_n1(s: Scenario, agents: _Agents, survivors_exit: bool) -> None:
    """n1's agent and ranks are killed; with gloo its survivors on n0 exit at once (`Connection reset by peer`)."""
    agents.live.discard("n1")
    if survivors_exit:
        generation = s.engine.jobs["j"].generation
        for rank in (0, 1):
            s.job_event("j", "process.exited", rank=rank, exit_code=1, attempt=generation)


def _on_spare(s: Scenario) -> bool:
    job = s.engine.jobs["j"]
    return job.nodes == ["n0", "sp0"] and s.state("j") == "running"


@pytest.mark.parametrize("sdk", [False, True], ids=["stock", "sdk"])
@pytest.mark.parametrize("survivors_exit", [False, True], ids=["silence-first", "exits-first"])
def test_a_lost_node_moves_to_the_spare_in_either_order(sdk: bool, survivors_exit: bool) -> None:
    s, agents = _job(sdk)
    _kill_n1(s, agents, survivors_exit)
    # Found within the agent's silence bound and a watchdog tick or two, a settle window, and (a stock script) the
    # grace period its restarted processes must run: never the 60 s an unanswered stop used to wait, three times.
    took = agents.until(lambda: _on_spare(s), 60)
    assert not s.find("job.failed", "j") and not s.find("attempt.timed_out", "j"), s.kinds("j")
    assert s.engine.cluster.nodes["n1"].gone
    restart = s.find("ranks.rescheduling", "j")[-1]
    assert restart.detail["nodes"] == ["n0", "sp0"]
    if not sdk:
        [command] = restart.commands
        assert command.kind == "restart_job"  # a stock script's survivors cannot join restarted peers
        assert took <= AGENT_SILENCE_S + 3 * WATCHDOG_S + 2 + 30 + 2
    else:
        assert took <= AGENT_SILENCE_S + 3 * WATCHDOG_S + 2 + 4


def test_an_attempt_waiting_on_a_lost_agent_is_superseded_at_once() -> None:
    """The survivors' exits open a process-fault incident first: the stock ladder restarts the job and stops the
    lost node's ranks (no exit of theirs was heard), whose agent never answers. Its silence is found while the job
    recovers: the attempt is superseded at once, not timed out, and the next one restarts the job on the spare."""
    s, agents = _job(sdk=False)
    _kill_n1(s, agents, survivors_exit=True)
    killed = s.now
    agents.until(lambda: bool(s.find("fault.added", "j")), 20)
    [added] = s.find("fault.added", "j")
    assert added.reason.startswith("agent of n1 silent") and s.state("j") == "recovering"
    assert (s.now - killed) / NS <= AGENT_SILENCE_S + 2 * WATCHDOG_S
    superseded = s.find("attempt.superseded", "j")
    assert superseded and superseded[-1].cause_seq == added.cause_seq
    assert superseded[-1].detail["granularity"] == "restart_job"
    agents.until(lambda: _on_spare(s), 60)
    assert len(s.find("fault.added", "j")) == 1, "a host declared gone was found again at every tick"


def test_a_node_silent_during_an_in_place_restart_is_found() -> None:
    """An SDK job restarts a crashed rank in place; the other node's agent falls silent while the restart is under
    way. The watchdog goes on through the recovery (the agents heartbeat), and the node's loss widens the incident."""
    s, agents = _job(sdk=True)
    generation = s.engine.jobs["j"].generation
    s.job_event("j", "process.exited", rank=0, exit_code=1, attempt=generation)
    assert s.state("j") == "recovering"
    agents.live.discard("n1")
    agents.until(lambda: _on_spare(s), 30)
    faults = [f["class"] for f in s.engine.jobs["j"].closed[-1]["faults"]]
    assert faults == ["process", "node"]


def test_a_job_whose_agents_send_no_heartbeat_disarms_its_watchdog_while_it_recovers() -> None:
    """Nothing but its agents' silence is watched during a recovery: without their heartbeats the watchdog stops, as
    it always did (the golden logs hold such jobs)."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    s.job_event("j", "process.exited", rank=0, exit_code=1, attempt=0)
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.cancelled_timers and s.engine.jobs["j"].watchdog is None


def test_force_migrate_of_a_stock_script_restarts_it_whole_off_the_lost_node() -> None:
    """`recovery-ctl force j migrate` after n1's loss was found: a stock script's survivors cannot join restarted
    peers, so the move is a job-level restart with n1 replaced by the spare (a migration of n1's ranks alone left
    n0's processes waiting for a group that never forms)."""
    s, agents = _job(sdk=False)
    _kill_n1(s, agents, survivors_exit=False)
    agents.until(lambda: bool(s.find("fault.confirmed", "j")), 20)
    s.job_event("j", "operator.force", granularity="migrate", reason="n1 is dead")
    started = s.find("attempt.started", "j")[-1]
    assert started.reason.startswith("operator forced migrate") and started.detail["granularity"] == "restart_job"
    assert started.detail["vacate"] == ["n1"]
    agents.until(lambda: _on_spare(s), 60)


def test_force_migrate_with_nothing_to_move_is_refused_and_the_job_goes_on() -> None:
    """Nothing is faulty or unusable: a forced migration would send no command and wait for nothing until its
    deadline. It is refused with the reason, and the job is left as it was."""
    s, agents = _job(sdk=True)
    decided = len(s.decisions)
    [rejection] = s.job_event("j", "operator.force", granularity="migrate")
    assert rejection.code == "invalid_request" and "no node to move" in rejection.reason  # type: ignore[union-attr]
    assert len(s.decisions) == decided and s.state("j") == "running"
    agents.second()
    assert s.state("j") == "running"


def test_the_ladder_replans_a_widened_incident_from_a_rung_its_class_has() -> None:
    """A crash's restart_job (process ladder, rung 2) superseded by the node's loss: the node ladder has rungs 0 and
    1 only. The superseded rung is no failure there: it restarts the job on the spare, not 'no rung can recover'."""
    ctx = RescheduleContext(
        fault_class=FaultClass.NODE, scope="node", needs_move=True, any_lost=True,
        previous=(AttemptSummary(Granularity.RESTART_JOB, "superseded", 2),), used={}, restarts_used=0,
        max_restarts=3, nodes_to_replace=1, nodes_to_migrate=1, spares_available=1, dp=4, scale_in_dp=None, sdk=False)
    answer = LadderRescheduling().decide(ctx)
    assert isinstance(answer, StartRung) and answer.granularity is Granularity.RESTART_JOB, answer



def test_a_node_that_joins_again_before_its_not_ready_grace_is_not_confirmed_gone() -> None:
    """A node reported not ready reboots and joins again within the detection's grace (20 s): the suspicion is
    cleared by the join, as by a `node.ready`, and the job never opens an incident for it."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    s.node_event("n1", "node.not_ready", reason="rebooting")
    assert s.find("fault.suspected", "j")
    s.advance(5)
    s.node_event("n1", "node.joined", spare=False, devices=2)
    [cleared] = s.find("fault.cleared", "j")
    assert cleared.reason == "node n1 joined again"
    s.train("j", 30)  # past the grace, the ranks training on
    assert not s.find("fault.confirmed", "j") and s.state("j") == "running"


def test_the_report_dates_a_lost_node_from_when_it_was_last_heard_and_names_its_rank_first(tmp_path: Path) -> None:
    """n1 goes silent; three seconds later its survivors' exits are heard (gloo's reset) and open the incident;
    the node's loss is confirmed after that. The postmortem's first signal is when n1 was last heard, not the first
    exit, and its first failing rank is one of n1's, not a survivor."""
    from recovery.log.file import FileLog
    from recovery.report import build_report, iter_file

    path = tmp_path / "log.jsonl"
    s = Scenario(log=FileLog(path))
    s.spare("sp0")
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, max_restarts=3, watchdog_interval_s=WATCHDOG_S)
    agents = _Agents(s, "j", {"n0", "n1", "sp0"}, sdk=False)
    for _ in range(10):
        agents.second()
    agents.live.discard("n1")
    for _ in range(3):
        agents.second()
    _kill_n1(s, agents, survivors_exit=True)
    agents.until(lambda: _on_spare(s), 60)
    report = build_report(iter_file(path))
    [incident] = report["jobs"][0]["incidents"]
    assert [f["class"] for f in incident["faults"]] == ["process", "node"]
    assert incident["first_failing_rank"] in (2, 3) and incident["fault_class"] == "node", incident
    exits_s = incident["faults"][0]["at_s"]
    assert incident["first_signal_s"] == exits_s - 3 and incident["detection_latency_s"] == 3, incident

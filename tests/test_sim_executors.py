"""The simulated executors and the inputs a recorded night replays: a command done after the recorded time, the
restart of an attempt a newer one superseded, carried out as a real executor does; a spare that joins while the job
trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.commands import RestartRanks
from events.values import ResumePlan
from recovery.cli.replay import main
from recovery.log import EPOCH
from recovery.report.source import iter_file
from recovery.report.whatif import whatif
from recovery.sim import Costs, Fault, SimConfig, Simulator, Training
from recovery.sim.answers import DONE, RecordedAnswer
from recovery.sim.config import NS, Cluster

GOLDEN = Path(__file__).parent / "golden"
SMALL = Cluster(gpus=16, gpus_per_node=4, tp=1, pp=1, spare_nodes=1)
RELIABLE = Costs(fail_probability=0.0, timeout_probability=0.0)
FROM_STORAGE = ResumePlan(checkpoint_step=None, next_step=0)


def _restart(id_: str, attempt: int, ranks: list[int]) -> RestartRanks:
    return RestartRanks(id=id_, job="llm", attempt=attempt, deadline_s=120, ranks=ranks, plan=FROM_STORAGE)


def _acks(sim: Simulator, command_id: str) -> list[tuple[float, str, str]]:
    """(seconds since the run began, status, reason) of every ack of `command_id` in the run's log."""
    return [((r.ts - EPOCH) / NS, r.envelope.data.status, r.envelope.data.reason) for r in sim.log.records()
            if r.envelope.type == "command.ack" and r.envelope.data.command_id == command_id]


def test_a_recorded_done_answer_times_the_command_of_its_kind_and_order_and_the_others_take_the_median() -> None:
    """The second in-place restart was done 7 s after its decision in the recorded night: the simulated second one
    is done 7 s after it was sent (its ack accepted at the usual latency first); the first and third take the cost
    model's time."""
    answers = (RecordedAnswer("restart_ranks", 2, DONE, 7.0),)
    sim = Simulator(SimConfig(cluster=SMALL, costs=RELIABLE, days=0.01, answers=answers))
    world = sim.world
    for n in (1, 2, 3):
        sim.at(sim.now + n * NS, lambda n=n: world.execute(_restart(f"c{n}", n, [0])))
    sim.run()
    cost = RELIABLE.ack_latency_s + RELIABLE.restart_in_place_s
    assert [status for _, status, _ in _acks(sim, "c2")] == ["accepted", "done"]
    (accepted, _, _), (done, _, _) = _acks(sim, "c2")
    assert accepted == pytest.approx(2 + RELIABLE.ack_latency_s) and done == pytest.approx(2 + 7.0)
    assert _acks(sim, "c1")[-1][0] == pytest.approx(1 + cost) and _acks(sim, "c3")[-1][0] == pytest.approx(3 + cost)
    assert world.stats["restart_ranks:recorded"] == 1


def test_a_superseded_attempts_restart_is_carried_out_while_the_next_attempts_ranks_are_down() -> None:
    """Rank 1 exits and its in-place restart is sent (generation 1); rank 2 exits and the next attempt restarts it
    (generation 2), counting on rank 1's new process. The first restart is carried out whatever rank 2 does, as a real
    executor does: its process abandons generation 1 for 2 like a survivor, so generation 2 is not undone."""
    sim = Simulator(SimConfig(cluster=SMALL, costs=RELIABLE, days=0.01))
    world = sim.world
    world.dead.update({1, 2})
    first, second = _restart("c1", 1, [1]), _restart("c2", 2, [2])
    world.execute(first)
    world.execute(second)
    world._complete(first, "ok")
    assert "restart_ranks:refused" not in world.stats
    assert world.dead == {2} and world.generation == 0
    world._complete(second, "ok")
    assert "restart_ranks:refused" not in world.stats
    assert world.dead == set() and world.generation == 2 and world.loading  # generation 2 loads its state
    # done after the newer one: no step back to its own generation, and generation 2 loads on
    world._complete(_restart("c3", 1, [1]), "ok")
    assert world.generation == 2 and world.loading


def test_a_restart_of_the_newest_attempt_is_still_refused_while_other_ranks_are_down() -> None:
    """Nothing newer was sent: rank 2, down and restarted by no one, cannot roll back, so the restart of rank 1
    alone cannot work."""
    sim = Simulator(SimConfig(cluster=SMALL, costs=RELIABLE, days=0.01))
    world = sim.world
    world.dead.update({1, 2})
    first = _restart("c1", 1, [1])
    world.execute(first)
    world._complete(first, "ok")
    assert world.stats.get("restart_ranks:refused") == 1 and world.dead == {1, 2}


def test_a_spare_that_joins_while_the_job_trains_is_heard_after_the_step_the_job_reached() -> None:
    """The engine may scale out onto a spare as soon as it joins, with a plan naming the step its live ranks are at:
    it hears how far the job got before the spare's node.joined, as a real engine has from the ranks' report of each
    step (the simulated job reports only when something happens)."""
    config = SimConfig(cluster=SMALL, costs=RELIABLE, training=Training(step_time_s=1.0), days=0.001,
                       joining=("n00004",))
    join = Fault(index=0, at_ns=int(30.5 * NS), component="join", signal="join", scope="node", position=0, device=0,
                 node="n00004")
    sim = Simulator(config, faults=[join])
    sim.run()
    records = list(sim.log.records())
    [joined] = [i for i, r in enumerate(records) if r.envelope.type == "node.joined" and r.ts > EPOCH]
    steps = [r.envelope.data.step for r in records[:joined] if r.envelope.type == "progress.step"]
    assert steps and steps[-1] == 30


def test_whatif_replays_the_recorded_scale_ins_13_s_and_lists_the_commands_it_timed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """elastic_keeps_survivors: the scale-in was done 13 s after its decision, the scale-out at once. Each simulated
    one takes its own recorded time (their median, 6.5 s, closed the scale-in early and left the scale-out's peers a
    step past its plan)."""
    result = whatif(GOLDEN / "elastic_keeps_survivors.jsonl", [], keep_logs=tmp_path, tail_s=60)
    assert result["reproduction"]["reproduced"]
    assert result["inputs"]["executors"] == []
    assert result["inputs"]["timed_as_recorded"] == {
        "commands": 2, "by_kind": {"scale_job": 2},
        "answers": ["scale_job #1 done after 13 s", "scale_job #2 done after 0 s"]}
    records = [r for r in iter_file(tmp_path / "recorded-policies.jsonl")]
    sent = {c["id"]: r["ts"] for r in records if r["envelope"]["type"] == "decision"
            for c in r["envelope"]["data"].get("commands") or [] if c.get("kind") == "scale_job"}
    done = {r["envelope"]["data"]["command_id"]: r["ts"] for r in records if r["envelope"]["type"] == "command.ack"
            and r["envelope"]["data"]["status"] == "done" and r["envelope"]["data"]["command_id"] in sent}
    assert sorted((done[c] - sent[c]) / NS for c in sent) == [0.0, 13.0]
    assert main(["whatif", str(GOLDEN / "elastic_keeps_survivors.jsonl"), "--tail-s", "60"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 commands timed as recorded" in out and "scale_job #1 done after 13 s" in out

"""The simulated executors as a recorded night has them answer: the restart of an attempt a newer one superseded,
carried out as a real executor does."""

from __future__ import annotations

from events.commands import RestartRanks
from events.values import ResumePlan
from recovery.sim import Costs, SimConfig, Simulator
from recovery.sim.config import Cluster

SMALL = Cluster(gpus=16, gpus_per_node=4, tp=1, pp=1, spare_nodes=1)
RELIABLE = Costs(fail_probability=0.0, timeout_probability=0.0)
FROM_STORAGE = ResumePlan(checkpoint_step=None, next_step=0)


def _restart(id_: str, attempt: int, ranks: list[int]) -> RestartRanks:
    return RestartRanks(id=id_, job="llm", attempt=attempt, deadline_s=120, ranks=ranks, plan=FROM_STORAGE)


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

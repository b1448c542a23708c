"""Hardware health counts wherever it is reported: on idle spares, and on devices of a job's node that the job does
not use."""

from __future__ import annotations

from recovery.testing.scenario import Scenario


def job_on_half_of_each_node() -> Scenario:
    """4 ranks per 8-GPU node: devices 4-7 of n0 and n1 run nothing of the job."""
    s = Scenario()
    s.spare("s0")
    s.submit("j", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("j", 5)
    s.checkpoint("j", 5, "storage", "storage")
    return s


def test_a_node_level_fault_on_a_device_the_job_does_not_use_moves_the_jobs_ranks_off_the_node() -> None:
    """XID 79 needs the whole node power-cycled: the job's ranks on it must leave although their GPUs are fine."""
    s = job_on_half_of_each_node()
    s.node_event("n1", "device.fault", device=6, vendor="nvidia", code="79")
    [fault] = s.find("fault.confirmed", "j")
    assert fault.detail["fault"]["ranks"] == [4, 5, 6, 7] and fault.detail["fault"]["class"] == "node"
    s.ack_all()
    [move] = s.commands_of("migrate_ranks")
    assert (move.from_node, move.to_node) == ("n1", "s0")


def test_a_device_fault_no_rank_uses_marks_the_device_and_leaves_the_job_alone() -> None:
    s = job_on_half_of_each_node()
    s.node_event("n0", "device.fault", device=5, vendor="nvidia", code="48")  # double-bit ECC: reset the GPU
    [marked] = s.find("hardware.marked", "j")
    assert marked.detail["device"] == 5 and marked.incident is None
    assert not s.find("fault.confirmed", "j") and s.state("j") == "running"
    assert s.engine.cluster.nodes["n0"].bad_devices == {5}
    # The job stays on n0 through a later, unrelated recovery: the bad device is not one it uses.
    s.job_event("j", "process.exited", rank=1, exit_code=1)
    s.ack_all()
    assert s.commands_of("restart_ranks") and not s.commands_of("migrate_ranks")


def test_a_spare_whose_device_failed_is_no_spare_until_the_device_recovers() -> None:
    s = Scenario()
    s.spare("s0")
    s.node_event("s0", "device.fault", device=2, vendor="nvidia", code="48")
    assert s.engine.cluster.free_spares() == []
    s.node_event("s0", "device.recovered", device=2)
    assert s.engine.cluster.free_spares() == ["s0"]


def test_an_informational_code_on_an_idle_spare_changes_nothing() -> None:
    s = Scenario()
    s.spare("s0")
    s.node_event("s0", "device.fault", device=2, vendor="nvidia", code="13")  # graphics engine exception: the app's
    assert s.engine.cluster.free_spares() == ["s0"]


def test_a_device_fault_on_a_paused_jobs_node_still_marks_the_hardware() -> None:
    s = job_on_half_of_each_node()
    s.job_event("j", "operator.pause", reason="maintenance")
    s.ack_all()
    assert s.state("j") == "paused"
    s.node_event("n1", "device.fault", device=1, vendor="nvidia", code="79")
    assert s.engine.cluster.nodes["n1"].bad_devices == {1}
    s.job_event("j", "operator.resume")
    s.ack_all()
    [move] = s.commands_of("migrate_ranks") or [None]
    restart = s.commands_of("restart_job")
    assert (move is not None and move.to_node == "s0") or (restart and "n1" not in restart[-1].nodes)

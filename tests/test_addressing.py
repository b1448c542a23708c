"""Every command reaches the agents of the nodes it concerns, on subjects that carry the node."""

from __future__ import annotations

import pytest

from events import subjects
from events.commands import FailJob, MigrateRanks, RestartJob, RestartRanks, SaveCheckpoint, StopRanks
from events.values import JobSpec, ResumePlan
from recovery.core.addressing import command_nodes

NODES = ["n0", "n1", "n2"]
PLAN = ResumePlan(checkpoint_step=None, next_step=0)
BASE = {"id": "j:7:0", "job": "j", "attempt": 1, "deadline_s": 60.0}


def node_of(rank: int) -> str:
    return NODES[rank // 2]


def test_rank_commands_reach_the_nodes_of_their_ranks_once_each() -> None:
    assert command_nodes(RestartRanks(**BASE, ranks=[3, 2, 0], plan=PLAN), node_of, NODES) == ["n1", "n0"]
    assert command_nodes(StopRanks(**BASE, ranks=[5]), node_of, NODES) == ["n2"]
    assert command_nodes(SaveCheckpoint(**BASE, ranks=[0, 4], step=3), node_of, NODES) == ["n0", "n2"]


def test_a_migration_reaches_the_node_left_and_the_node_joined() -> None:
    command = MigrateRanks(**BASE, ranks=[2, 3], from_node="n1", to_node="spare", plan=PLAN)
    assert command_nodes(command, node_of, NODES) == ["n1", "spare"]


def test_job_wide_commands_reach_every_node_of_the_job() -> None:
    assert command_nodes(FailJob(**BASE, reason="budget"), node_of, NODES) == NODES
    assert command_nodes(RestartJob(**BASE, nodes=["n0", "spare"], plan=PLAN), node_of, NODES) == [
        "n0", "spare", "n1", "n2"]


def test_command_subjects_start_with_the_node_and_copies_have_their_own_ids() -> None:
    assert subjects.command("n1", "j", "restart_ranks") == "recovery.cmd.n1.j.restart_ranks"
    assert subjects.node_commands("n1") == "recovery.cmd.n1.>"
    assert subjects.command_msg_id("j:7:0", "n1") != subjects.command_msg_id("j:7:0", "n2")


def test_a_command_subject_reads_back_as_its_node_job_and_kind() -> None:
    assert subjects.command_parts(subjects.command("n1", "job-7", "restart_ranks")) == ("n1", "job-7", "restart_ranks")
    for subject in ("recovery.dec.job-7", "recovery.cmd.n1.job-7", "recovery.cmd..j.k", "other.cmd.n1.j.k"):
        with pytest.raises(ValueError, match="not a command subject"):
            subjects.command_parts(subject)


def test_a_spec_without_an_entrypoint_is_written_as_before_the_field_existed() -> None:
    spec = JobSpec(nodes=["n0"], ranks_per_node=1, layout={"dp": 1})  # type: ignore[arg-type]
    assert "entrypoint" not in spec.model_dump(mode="json")
    launched = JobSpec.model_validate({**spec.model_dump(), "entrypoint": {"command": "python", "args": ["t.py"]}})
    assert launched.model_dump(mode="json")["entrypoint"] == {"command": "python", "args": ["t.py"], "cwd": None,
                                                              "env": {}}

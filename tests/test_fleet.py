"""`recovery-ctl nodes` and the `jobs` rows: every node the engine knows, its agent (heard when, in what state), its
job and ranks; a job placed on nodes no agent serves says so instead of showing `submitted 0/4` without a reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from events.codec import decode_envelope
from events.names import DecisionKind
from recovery.cli.ctl import build_parser, render
from recovery.cli.ctl_routes import merge, targets
from recovery.core.engine import Engine
from recovery.core.partition import Partition
from recovery.service.control import ControlService
from recovery.service.unserved import UnservedWatch
from recovery.testing.scenario import Scenario


class Answering:
    """The little of a daemon the control service reads for queries: its engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.publisher = None
        self.partition: Partition | None = None
        self.recent: Mapping[int, list[Any]] = {}

    async def status(self) -> dict[str, object]:
        return {}

    async def wait_applied(self, seq: int, timeout: float) -> bool:
        return True


def fleet() -> Scenario:
    s = Scenario()
    s.node_event("n0", "node.ready")
    s.node_event("n0", "node.heartbeat", interval_s=1.0)
    s.spare("s0")
    s.node_event("s0", "node.heartbeat", interval_s=1.0)
    s.submit("tiny", ["n0", "n1"], ranks_per_node=2, dp=4, start=False)  # n1: no agent ever ran there
    return s


async def test_nodes_lists_each_agent_its_job_and_ranks_and_jobs_names_the_nodes_without_one() -> None:
    s = fleet()
    service = ControlService(Answering(s.engine))  # type: ignore[arg-type]
    nodes = {row["node"]: row for row in (await service._handlers["nodes"]({}))["nodes"]}
    assert list(nodes) == ["n0", "n1", "s0"]
    assert (nodes["n0"]["agent"], nodes["n0"]["job"], nodes["n0"]["ranks"]) == ("ready", "tiny", [0, 1])
    assert nodes["n0"]["seen"] is not None and nodes["n0"]["job_state"] == "submitted"
    assert (nodes["n1"]["agent"], nodes["n1"]["seen"], nodes["n1"]["ranks"]) == ("none", None, [2, 3])
    assert (nodes["s0"]["agent"], nodes["s0"]["job"]) == ("spare", None)
    [job] = (await service._handlers["jobs"]({}))["jobs"]
    assert (job["state"], job["alive"], job["no_agent"]) == ("submitted", 0, ["n1"])


def test_nodes_render_and_a_job_without_agents_says_so(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert build_parser().parse_args(["nodes"]).verb == "nodes"
    render("nodes", {"nodes": [
        {"node": "n0", "agent": "ready", "seen": 1_700_000_000 * 10**9, "job": "tiny", "job_state": "submitted",
         "ranks": [0, 1]},
        {"node": "n1", "agent": "none", "seen": None, "job": "tiny", "job_state": "submitted", "ranks": [2, 3]}]})
    text = capsys.readouterr().out
    assert "tiny" in text and "(submitted)" in text and "0-1" in text and "none" in text
    render("jobs", {"jobs": [{"job": "tiny", "state": "submitted", "phase": None, "step": None, "alive": 0,
                              "world": 4, "incident": None, "attempt": None, "generation": 0, "restarts_used": 0,
                              "dp": 4, "nodes": 2, "incidents_closed": 0, "no_agent": ["n1"]}]})
    assert "no agent on n1" in capsys.readouterr().out


def test_a_partitioned_nodes_answer_is_one_row_per_node_with_the_job_its_partition_knows() -> None:
    assert targets("nodes", {}, 3) == [0, 1, 2]
    idle = {"node": "n0", "agent": "ready", "seen": 5, "job": None, "job_state": None, "ranks": []}
    busy = {**idle, "seen": 3, "job": "tiny", "job_state": "running", "ranks": [0, 1]}
    out = merge("nodes", 3, {0: {"nodes": [idle]}, 2: {"nodes": [busy]}}, {1: "no answer"})
    assert out["nodes"] == [{**busy, "seen": 5, "partition": 2}]
    assert out["missing"] == [{"partition": 1, "why": "no answer"}]


def test_a_job_waiting_on_nodes_without_an_agent_says_so_in_its_decision_once_the_daemon_saw_it_wait() -> None:
    s = fleet()
    now = [100.0]
    watch = UnservedWatch(lambda: s.engine, None, lambda ident: ident, after_s=60.0,  # type: ignore[arg-type]
                          clock=lambda: now[0])
    assert watch.due() == []
    now[0] += 30
    assert watch.due() == []
    now[0] += 30
    due = watch.due()
    assert due == [("tiny", ["n1"], 60.0)]
    assert watch.due() == []  # once per set of nodes
    [message] = watch.messages(due)
    assert message.subject == "recovery.ev.job.tiny.job.unserved"
    envelope = decode_envelope(message.data)
    assert not isinstance(envelope, Exception)
    s.send(message.subject, envelope)
    [decision] = s.find(DecisionKind.JOB_UNSERVED, "tiny")
    assert decision.state == "submitted" and decision.detail == {"nodes": ["n1"]}
    assert "no agent serves n1" in decision.reason


def test_job_unserved_names_only_the_jobs_own_unserved_nodes_and_only_before_it_started() -> None:
    s = fleet()
    s.job_event("tiny", "job.unserved", nodes=["n0"], waited_s=60.0)  # n0's agent is heard
    s.job_event("tiny", "job.unserved", nodes=["x9"], waited_s=60.0)  # not the job's
    assert [r.code for r in s.rejections] == ["invalid_state", "invalid_request"]
    assert s.find(DecisionKind.JOB_UNSERVED, "tiny") == []
    s.job_event("tiny", "job.started")
    s.job_event("tiny", "job.unserved", nodes=["n1"], waited_s=60.0)
    assert s.rejections[-1].code == "invalid_state"

"""An agent that died is the control plane's own fault: the agent that starts after it on the node says why it
stopped (`last_exit` of its `node.ready` or `node.joined`), and the postmortem names it as the root cause instead of
leaving `agent of n0 silent`."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import orjson
import pytest
from rich.console import Console

from recovery.agent.exits import ENDED_WITHOUT_A_WORD, EXIT_FILE, crash_reason, record_exit, take_last_exit
from recovery.cli import agent as agent_cli
from recovery.log import iter_file
from recovery.log.file import FileLog
from recovery.report import build_report
from recovery.report.source import iter_file as report_records
from recovery.report.terminal import render
from recovery.testing.scenario import Scenario


def test_a_crash_inside_the_agents_task_group_is_named_with_its_place() -> None:
    async def carry_out() -> None:
        raise RuntimeError("no such device\nnvidia-smi said nothing")

    async def agent() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(carry_out)

    with pytest.raises(BaseException) as caught:
        anyio.run(agent)
    reason = crash_reason(caught.value)
    assert reason.startswith("crashed: RuntimeError: no such device nvidia-smi said nothing (")
    assert "in carry_out)" in reason and "\n" not in reason


def test_the_next_agent_reads_why_the_last_stopped_and_a_silent_death_is_said_too(tmp_path: Path) -> None:
    assert take_last_exit(tmp_path) is None  # a first start
    assert take_last_exit(tmp_path) == ENDED_WITHOUT_A_WORD  # the first one died without writing anything
    record_exit(tmp_path, "stopped by SIGTERM")
    assert take_last_exit(tmp_path) == "stopped by SIGTERM"
    (tmp_path / EXIT_FILE).write_bytes(b'{"reas')  # cut short as it was written
    assert take_last_exit(tmp_path) == ENDED_WITHOUT_A_WORD


def test_recovery_agent_keeps_the_exception_it_died_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def crashing(agent: object) -> str:
        del agent
        raise KeyError("job-17")

    monkeypatch.setattr(agent_cli, "serve", crashing)
    with pytest.raises(KeyError):
        agent_cli.main(["--node", "n0", "--nats-url", "nats://127.0.0.1:1", "--runtime-dir", str(tmp_path)])
    kept = orjson.loads((tmp_path / EXIT_FILE).read_bytes())
    assert kept["reason"].startswith("crashed: KeyError: 'job-17' (") and "in crashing)" in kept["reason"]


def test_the_report_names_a_crashed_agent_as_the_root_cause(tmp_path: Path) -> None:
    log = FileLog(tmp_path / "run.jsonl")
    s = Scenario(log)
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.spare("s0")
    s.train("j", 5)
    for _ in range(4):  # both agents beat: the engine knows n0 has one
        s.advance(1)
        for node in ("n0", "n1"):
            s.node_event(node, "node.heartbeat", interval_s=1.0)
        s.steps("j", s.engine.jobs["j"].step + 1)
    for _ in range(30):  # n0's agent died; n1's goes on, and every rank still reports
        s.advance(1)
        s.node_event("n1", "node.heartbeat", interval_s=1.0)
        s.steps("j", s.engine.jobs["j"].step + 1)
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.reason.startswith("agent of n0 silent")
    s.ack_all()
    crash = "crashed: RuntimeError: no such device (agent.py:412 in _carry_out)"
    s.node_event("n0", "node.ready", last_exit=crash)  # the agent restarted, and says why it stopped
    assert not s.rejections, s.rejections
    log.close_sync()
    report = build_report(report_records(log.path))
    [incident] = report["jobs"][0]["incidents"]
    assert incident["root_faults"][0]["agent_exit"] == crash
    out = io.StringIO()
    render(report, Console(file=out, width=80), decisions=False)
    assert f"the agent of n0 {crash}" in " ".join(out.getvalue().split())
    assert sum(1 for _ in iter_file(log.path)) > 0


def test_a_first_start_is_written_as_before(tmp_path: Path) -> None:
    """Logs stay byte for byte: an agent with nothing to say writes the node.ready it always wrote."""
    from events.envelope import make_envelope

    assert make_envelope("node.ready", {}, id="a", node="n0").model_dump(mode="json")["data"] == {}
    joined = make_envelope("node.joined", {"spare": True, "devices": 8}, id="b", node="n0")
    assert joined.model_dump(mode="json")["data"] == {"spare": True, "devices": 8}

"""Every screen reads at 80 columns: `recovery-replay` (report, timeline, diff, whatif) piped with COLUMNS=80,
`recovery-ctl`'s tables, the demo's live view and `recovery-run`'s lines. No line is wider than 80, and every value
the screen shows on a wide terminal (a number, an id, a decision, a policy, an input's field) is whole on one line
of the narrow one: wrapped between values, never inside one."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from recovery.cli.ctl import render as render_ctl
from recovery.cli.follow import JobFollower
from recovery.cli.replay import timeline_rows
from recovery.log.file import FileLog
from recovery.service.demo_view import LiveView
from recovery.testing.scenario import Scenario
from tests.golden.scenarios import path

NARROW = 80
WIDE = 1000
BOX = "│┃║╭╮╰╯─━┏┓┗┛┡┩┣┫╇╋┳┻┠┨┯┷┼├┤┌┐└┘"
MOST = 60
"""longer values may fold: no column of 80 holds them"""


def values(screen: str) -> set[str]:
    """The values a screen shows: its words that hold a digit or are names (`attempt.started`, `ladder@8`,
    `timer_id=...`, `lem#1`), border characters and the ellipsis of a shortened text left out."""
    words = re.split(rf"[\s{BOX}…]+", screen)
    return {w for w in words if w and len(w) <= MOST and re.search(r"[0-9@#=._]", w)}


def assert_readable(narrow: str, wide: str, also: Iterable[str] = ()) -> None:
    lines = narrow.splitlines()
    assert lines, "nothing rendered"
    too_wide = [line for line in lines if len(line.rstrip()) > NARROW]
    assert not too_wide, f"{len(too_wide)} line(s) wider than {NARROW}: {too_wide[:3]}"
    broken = sorted(v for v in values(wide) | set(also) if not any(v in line for line in lines))
    assert not broken, f"values broken across lines at {NARROW} columns: {broken[:20]}\n{narrow}"


def cli(*args: str, columns: int) -> str:
    """`recovery-replay` as a person pipes it into `less`: no terminal, COLUMNS as given."""
    env = {**os.environ, "COLUMNS": str(columns)}
    done = subprocess.run([sys.executable, "-m", "recovery.cli.replay", *args], capture_output=True, text=True,
                          env=env, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


@pytest.mark.parametrize("golden", ["lemon_isolated_with_spare", "retry_fails_then_in_place",
                                    "stock_script_restarts_whole", "elastic_scale"])
def test_the_report_reads_at_80_columns_when_piped(golden: str) -> None:
    log = str(path(golden))
    narrow = cli("report", log, columns=NARROW)
    assert_readable(narrow, cli("report", log, columns=WIDE))
    assert "incidents of" in narrow


def test_a_piped_report_without_columns_takes_80_not_160(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "report", str(path("crash_loop"))],
                          capture_output=True, text=True, env=env, check=True, stdin=subprocess.DEVNULL)
    assert max(len(line.rstrip()) for line in done.stdout.splitlines()) <= NARROW


def test_the_timeline_reads_at_80_columns_when_piped() -> None:
    log = str(path("lemon_isolated_with_spare"))
    narrow = cli("timeline", log, "--job", "lem", columns=NARROW)
    assert_readable(narrow, cli("timeline", log, "--job", "lem", columns=WIDE))
    assert "device.fault@l1" in narrow  # a node's event names its node


def test_diff_and_whatif_read_at_80_columns(tmp_path: Path) -> None:
    log = str(path("pod_level_reschedule"))
    kept = tmp_path / "whatif"
    whatif = ("whatif", log, "--policy", "rescheduling=torchelastic-like-rescheduling", "--keep-logs")
    # each run its own directory: a second run into the same one differs in the simulator's ledger
    narrow = cli(*whatif, str(kept), columns=NARROW)
    assert_readable(narrow, cli(*whatif, str(tmp_path / "again"), columns=WIDE))
    diff = ("diff", str(kept / "recorded-policies.jsonl"), str(kept / "whatif.jsonl"))
    assert_readable(cli(*diff, columns=NARROW), cli(*diff, columns=WIDE),
                    also=["[torchelastic-like-rescheduling@1]"])


def test_the_timeline_leaves_signs_of_life_out_unless_asked_and_names_each_nodes(tmp_path: Path) -> None:
    """A real run's log is mostly heartbeats (386 of 450 lines of one): the timeline shows what happened, and with
    --all every heartbeat too, each naming the node it came from."""
    log = FileLog(tmp_path / "run.jsonl")
    s = Scenario(log)
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    for _ in range(20):
        s.advance(1)
        for node in ("n0", "n1"):
            s.node_event(node, "node.heartbeat", interval_s=1.0)
        s.steps("j", s.engine.jobs["j"].step + 1)
    s.node_event("n1", "device.fault", device=1, vendor="nvidia", code="79")
    log.close_sync()
    from recovery.log import iter_file

    quiet = timeline_rows(iter_file(log.path), "j")
    whats = {r["what"] for r in quiet}
    assert not whats & {"node.heartbeat", "process.heartbeat", "progress.step", "progress.report"}, whats
    assert "device.fault" in whats and "decision fault.confirmed" in whats
    everything = timeline_rows(iter_file(log.path), "j", include_progress=True)
    beats = [r for r in everything if r["what"] == "node.heartbeat"]
    assert len(beats) == 40 and {r["node"] for r in beats} == {"n0", "n1"}
    text = cli("timeline", str(log.path), "--job", "j", "--all", columns=NARROW)
    assert "node.heartbeat@n0" in text and "node.heartbeat@n1" in text
    assert "heartbeat" not in cli("timeline", str(log.path), "--job", "j", columns=NARROW)


# -- recovery-ctl ----------------------------------------------------------------------------------------------
JOB = {"job": "llama-405b-pretrain-0007", "state": "recovering", "phase": "rescheduling", "step": 123456,
       "generation": 12, "alive": 16383, "world": 16384, "dp": 128, "nodes": 2048, "incident": 7, "attempt": 2,
       "incidents_closed": 6, "restarts_used": 9}
CTL_REPLIES: dict[str, dict[str, object]] = {
    "jobs": {"jobs": [JOB, {**JOB, "job": "tiny", "no_agent": ["gpu-node-0017", "gpu-node-0018"]}]},
    "incidents": {"incidents": [{"job": "llama-405b-pretrain-0007", "incident": "llama-405b-pretrain-0007#7",
                                 "cause": "fault", "phase": "rescheduling", "outcome": None,
                                 "opened": 1_767_225_600 * 10**9, "fault_class": "device", "lost_steps": 412,
                                 "faults": 3, "attempts": ["in_place", "migrate", "restart_job"]}]},
    "nodes": {"nodes": [{"node": f"gpu-node-{i:04d}", "agent": "ready", "seen": 1_767_225_600 * 10**9,
                         "job": "llama-405b-pretrain-0007", "job_state": "recovering",
                         "ranks": [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]} for i in range(3)]},
    "status": {"status": {"ready": True, "last_seq": 123456789, "snapshot_seq": 123450000, "lag": 12,
                          "instance": "recovery-daemon-7f3a9c", "role": "active"}},
}


@pytest.mark.parametrize("verb", sorted(CTL_REPLIES))
def test_recovery_ctl_reads_at_80_columns(verb: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDE))
    render_ctl(verb, CTL_REPLIES[verb], wide=True)
    wide = capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", str(NARROW))
    render_ctl(verb, CTL_REPLIES[verb])
    narrow = capsys.readouterr().out
    lines = narrow.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= NARROW
    # the columns a narrow `jobs` or `incidents` leaves out it names (--wide): what it shows is whole
    for value in ("llama-405b-pretrain-0007", "recovering", "gpu-node-0017", "gpu-node-0001",
                  "llama-405b-pretrain-0007#7", "123456789", "recovery-daemon-7f3a9c", "rescheduling"):
        if value in wide:
            assert any(value in line for line in lines), (value, narrow)


# -- recovery-daemon --demo ------------------------------------------------------------------------------------
def _demo_view(decided: Callable[[Scenario], None]) -> tuple[LiveView, Scenario]:
    s = Scenario()
    s.submit("demo", ["n00000", "n00001", "n00002", "n00003"], ranks_per_node=2, dp=4, tp=2)
    s.spare("s00000")
    s.train("demo", 5)
    daemon = SimpleNamespace(engine=s.engine, snapshot_seq=0, listeners=[])
    view = LiveView(daemon, 60)  # type: ignore[arg-type]
    decided(s)
    for decision in s.decisions:
        view.on_record(None, [decision])  # type: ignore[arg-type]
    return view, s


def test_the_demo_screen_shows_the_newest_decisions_first_each_in_two_lines_and_whole_states() -> None:
    view, s = _demo_view(lambda s: s.node_event("n00001", "device.fault", device=1, vendor="nvidia", code="79"))
    console = Console(width=NARROW, height=30, record=True, file=io.StringIO())
    console.print(view)
    screen = console.export_text()
    lines = screen.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= NARROW
    for whole in ("recovering", "stopping", "migrate", "demo#1", "7/8", "n00001", "s00000" if False else "n00003"):
        assert any(whole in line for line in lines), (whole, screen)
    feed = lines[next(i for i, line in enumerate(lines) if line.startswith("decisions")) + 1:]
    kinds = [d.kind for d in s.decisions]
    shown = [k for line in feed for k in kinds if re.search(rf"\b{re.escape(k)} ->", line)]
    assert shown[0] == kinds[-1] and shown == sorted(shown, key=lambda k: -kinds.index(k)), (shown, screen)
    reasons = [line for line in feed if line.startswith(" " * 8) and line.strip()]
    assert len(reasons) == len(shown), "each decision's reason takes one line under it"
    assert any(line.rstrip().endswith("…") for line in reasons), "a long reason is shortened, not wrapped"


def test_the_demo_screen_keeps_the_newest_decisions_on_a_short_terminal() -> None:
    def many(s: Scenario) -> None:
        for step in range(6, 40):
            s.node_event("n00002", "network.link_down", link="ib0", switch="leaf0")
            s.node_event("n00002", "network.link_up", link="ib0")
            s.train("demo", 1)
            del step

    view, s = _demo_view(many)
    console = Console(width=NARROW, height=24, record=True, file=io.StringIO())
    console.print(view)
    lines = console.export_text().splitlines()
    assert len(lines) <= 24
    newest = s.decisions[-1]
    assert any(f"{newest.kind} ->" in line for line in lines[:16])


# -- recovery-run ----------------------------------------------------------------------------------------------
def test_recovery_runs_lines_wrap_at_words_to_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(NARROW))
    follower = JobFollower("llama-405b-pretrain-0007", out=io.StringIO())
    reason = ("XID 79 on gpu-node-0017 device 3: GPU has fallen off the bus; catalog WORKFLOW_XID_79 (drain the "
              "node and reset the GPU, then move the node's 8 ranks to spare gpu-node-0211), seq 123456789")
    follower.on_decision({"kind": "fault.confirmed", "reason": reason, "state": "recovering", "detail": {}})
    follower.say("postmortem: recovery-replay report /var/lib/recovery/runs/llama-405b-pretrain-0007/data")
    said = follower.out.getvalue()  # type: ignore[attr-defined]
    assert_readable(said, reason + " /var/lib/recovery/runs/llama-405b-pretrain-0007/data")

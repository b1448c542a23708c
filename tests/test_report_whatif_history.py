"""`recovery-replay whatif` and the cluster's history before the job: the node events the engine counted under
earlier jobs, which the simulated engine hears first."""

from __future__ import annotations

from pathlib import Path

from recovery.log import EPOCH, write_file
from recovery.report.recorded import history_of, read_recorded
from recovery.report.source import iter_file
from recovery.report.whatif import whatif
from recovery.sim.config import NS
from recovery.testing.scenario import Scenario

GOLDEN = Path(__file__).parent / "golden"
WINDOW_120_S = {"detection": {"name": "default", "params": {"frequency_window_s": 120.0}}}


def _history_before_the_job() -> Scenario:
    """XID 63 on f1 device 2 at 0 s and 50 s, before any job; job freq (window 120 s) submitted at 100 s; the same
    code at 130 s (two in the window: 50 s and 130 s) and at 135 s (three: a lemon, isolated onto the spare)."""
    s = Scenario()
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.advance(50)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.advance(50)
    s.spare("spare0")
    s.submit("freq", ["f0", "f1"], ranks_per_node=4, dp=8, policies=WINDOW_120_S)
    s.train("freq", 10)
    s.checkpoint("freq", 10, "storage", "storage")
    s.train("freq", 20)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.train("freq", 5)
    s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.ack_all()
    s.advance(20)
    s.train("freq", 2)
    return s


def test_the_history_is_heard_at_its_recorded_times_before_the_job(tmp_path: Path) -> None:
    """The history's offsets count: within a 120 s window the fault at 0 s has left it by 130 s, so the lemon is the
    one at 135 s (35 s into the job), not at 130 s, as it would be had the history been heard at the job's start."""
    log = tmp_path / "history.jsonl"
    write_file(log, list(_history_before_the_job().log.records()))
    cluster = read_recorded(iter_file(log))
    assert [(r.before_ns, r.node, r.kind) for r in history_of(cluster)] == [
        (100 * NS, "n00001", "device.fault"), (50 * NS, "n00001", "device.fault")]
    result = whatif(log, [], keep_logs=tmp_path / "whatif", tail_s=60)
    rep = result["reproduction"]
    assert rep["reproduced"], rep
    assert rep["recorded"][0] == {"decision": "attempt.started migrate", "at_s": 35.0}
    simulated = [r for r in iter_file(tmp_path / "whatif" / "recorded-policies.jsonl")]
    assert [r["ts"] - EPOCH for r in simulated[:2]] == [-100 * NS, -50 * NS]
    [submitted] = [r for r in simulated if r["envelope"]["type"] == "job.submitted"]
    assert submitted["ts"] == EPOCH


def test_a_fault_still_open_at_the_submission_is_said_not_replayed_as_one(tmp_path: Path) -> None:
    """An XID 48 on n1 device 1 before the job, never recovered: its event is history, and what it left (a device out
    of service) is named, since the simulated node joins healthy."""
    s = Scenario()
    s.node_event("n1", "device.fault", device=1, vendor="nvidia", code="48")
    s.advance(10)
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("j", 3)
    log = tmp_path / "open.jsonl"
    write_file(log, list(s.log.records()))
    cluster = read_recorded(iter_file(log))
    assert [past.kind for past in cluster.history] == ["device.fault"]
    assert cluster.history_left == {"n1": ["n1 device 1 broken (XID 48, device.fault (seq 1))"]}
    assert not cluster.drafts  # no fault of the job's

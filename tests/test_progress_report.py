"""Edge aggregation: a node agent's `progress.report` (its ranks' heartbeats and steps of one period, folded) is an
ordinary logged input that the engine applies as each rank's own events would be; per-rank events of older agents
are still accepted; a report that names a rank the job does not have changes nothing."""

from __future__ import annotations

import anyio

from events.envelope import make_envelope
from events.outputs import Rejection
from recovery.agent.progress import ProgressFold, SilenceWatch, wire_loss, wire_skip
from recovery.testing.scenario import Scenario
from tests.test_poison import engine_state


def per_rank_and_folded(fold: bool) -> Scenario:
    """A job trains 12 steps (rank 2 only heartbeating for the last 6), a crash restarts rank 1, and the job trains
    on: every rank's words per period either as its own events or as one report per node."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)

    def period(step: int, quiet: set[int], attempt: int) -> None:
        s.advance(1)
        words = [(r, None if r in quiet else step) for r in range(4)]
        if fold:
            for node in (0, 1):
                fold_ = ProgressFold()
                for rank, at in words[node * 2:node * 2 + 2]:
                    fold_.note("j", rank, at, attempt)
                report = fold_.take("j")
                assert report is not None
                s.job_event("j", "progress.report", **report)
        else:
            for rank, at in words:
                if at is None:
                    s.job_event("j", "process.heartbeat", rank=rank, attempt=attempt)
                else:
                    s.job_event("j", "progress.step", rank=rank, step=at, attempt=attempt)

    for step in range(1, 13):
        period(step, {2} if step > 6 else set(), 0)
    s.checkpoint("j", 12, "storage", "storage")
    s.job_event("j", "process.exited", rank=1, exit_code=1)
    s.ack_all()
    for step in range(13, 16):
        period(step, set(), 1)
    return s


def test_a_folded_report_is_applied_as_its_ranks_own_events() -> None:
    folded, each = per_rank_and_folded(True), per_rank_and_folded(False)
    assert [d.kind for d in folded.decisions] == [d.kind for d in each.decisions]
    assert folded.find("incident.closed", "j") and folded.state("j") == "running"
    for name in ("steps", "last_seen", "last_progress", "alive", "step", "sdk"):
        assert getattr(folded.engine.jobs["j"], name) == getattr(each.engine.jobs["j"], name), name


def test_a_report_naming_a_rank_the_job_lacks_changes_nothing() -> None:
    s = Scenario()
    s.submit("j", ["n0"], ranks_per_node=2, dp=2)
    s.job_event("j", "progress.report", ranks=[{"rank": 0, "step": 1}, {"rank": 1, "step": 1}])
    before = engine_state(s.engine)
    effects = s.job_event("j", "progress.report", ranks=[{"rank": 0, "step": 2}, {"rank": 5, "step": 2}])
    assert [e.code for e in effects if isinstance(e, Rejection)] == ["unknown_rank"]
    assert engine_state(s.engine) == before, "rank 0's step of the refused report stayed applied"


def test_a_report_with_a_step_backwards_or_a_rank_twice_is_refused_whole() -> None:
    """Refusals found before any entry is applied (the common report goes without a journal) and one that only the
    entries applied in order show (a rank named twice) both leave nothing of the report behind."""
    s = Scenario()
    s.submit("j", ["n0"], ranks_per_node=2, dp=2)
    s.job_event("j", "progress.report", ranks=[{"rank": 0, "step": 3}, {"rank": 1, "step": 3}])
    before = engine_state(s.engine)
    for ranks, code in (([{"rank": 0, "step": 4}, {"rank": 1, "step": 2}], "step_backwards"),
                        ([{"rank": 1, "step": 4}, {"rank": 0, "step": 5}, {"rank": 0, "step": 4}], "step_backwards"),
                        ([{"rank": 0, "step": 4}, {"rank": 1, "step": 4, "attempt": 3}], "unknown_attempt")):
        effects = s.job_event("j", "progress.report", ranks=ranks)
        assert [e.code for e in effects if isinstance(e, Rejection)] == [code]
        assert engine_state(s.engine) == before, ranks


def test_a_report_naming_its_node_is_the_agents_sign_of_life() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.job_event("j", "job.started")
    for node in ("n0", "n1"):
        s.node_event(node, "node.heartbeat", interval_s=1.0)
    s.advance(4)
    s.send("recovery.ev.job.j.progress.report", make_envelope(
        "progress.report", {"ranks": [{"rank": 0, "step": 1}, {"rank": 1, "step": 1}]}, id="r1", job="j", node="n0"))
    heard = {name: s.engine.cluster.nodes[name].heard for name in ("n0", "n1")}
    assert heard["n0"] == s.now and heard["n1"] is not None and heard["n1"] < heard["n0"]
    # n0's agent says nothing else but its reports: never silent; n1's says nothing at all: silent
    for _ in range(4):
        s.advance(1.5)
        s.send("recovery.ev.job.j.progress.report", make_envelope(
            "progress.report", {"ranks": [{"rank": 0}, {"rank": 1}]}, id=f"r{s.engine.last_seq}", job="j",
            node="n0"))
    [confirmed] = s.find("fault.confirmed", "j")
    assert "agent of n1 silent" in confirmed.reason and "n0" not in confirmed.reason


def test_the_fold_keeps_each_ranks_newest_word_and_says_what_is_news() -> None:
    fold = ProgressFold()
    assert fold.note("j", 3, 10, 0)  # the rank's first word: news
    assert fold.note("j", 1, None, 0)
    assert not fold.note("j", 3, None, 0)  # a bare heartbeat keeps the step said before it
    assert fold.note("j", 1, 11, 0)  # rank 1's first step in its generation: news
    assert not fold.note("j", 1, 12, 0)
    assert fold.note("j", 3, 4, 1)  # a newer generation's word replaces the older one's, and is news
    fold.note("j", 3, 9, 0)  # ... and a late word of the older generation does not come back
    fold.note("j", 1, 11, 0)
    assert fold.take("j") == {"ranks": [{"rank": 3, "step": 4, "attempt": 1}, {"rank": 1, "step": 11, "attempt": 0}]}
    assert fold.take("j") is None


def test_the_fold_carries_each_ranks_mean_compute_time_of_the_period_and_the_engine_tallies_it() -> None:
    fold = ProgressFold()
    fold.note("j", 0, 1, 0, compute_s=0.2)
    fold.note("j", 0, 2, 0, compute_s=0.4)
    fold.note("j", 0, None, 0)  # a heartbeat measures nothing
    fold.note("j", 1, 1, 0)  # a rank that measures nothing reports as before
    fold.note("j", 2, 5, 0, compute_s=9.0)
    fold.note("j", 2, 1, 1, compute_s=0.1)  # a new generation's process: the old one's times are not its own
    report = fold.take("j")
    assert report == {"ranks": [{"rank": 0, "step": 2, "attempt": 0, "compute_s": 0.3, "compute_steps": 2},
                                {"rank": 1, "step": 1, "attempt": 0},
                                {"rank": 2, "step": 1, "attempt": 1, "compute_s": 0.1, "compute_steps": 1}]}
    s = Scenario()
    s.submit("j", ["n0"], ranks_per_node=2, dp=2)
    s.advance(1)
    s.job_event("j", "progress.report", ranks=report["ranks"][:2])
    s.job_event("j", "progress.step", rank=1, step=2, compute_s=0.25)
    job = s.engine.jobs["j"]
    assert (job.compute_steps, job.compute_ns) == ([2, 1], [600_000_000, 250_000_000])
    assert not s.rejections


def test_a_step_is_said_once_though_every_heartbeat_carries_it() -> None:
    fold = ProgressFold()
    fold.note("j", 0, 5, 0, 0.2)  # the step
    fold.note("j", 0, 5, 0)  # a heartbeat in the same period carries it
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 5, "attempt": 0, "compute_s": 0.2, "compute_steps": 1}]}
    fold.note("j", 0, 5, 0)  # a period of heartbeats alone (a slow step): alive, and no step said again
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": None, "attempt": 0}]}
    fold.note("j", 0, 6, 0)  # the heartbeat thread read the new step before the step itself was sent
    fold.note("j", 0, 6, 0, 0.3)
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 6, "attempt": 0, "compute_s": 0.3, "compute_steps": 1}]}
    fold.note("j", 0, 6, 1)  # a new generation resumes at the step: said again, in it
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 6, "attempt": 1}]}
    fold.forget("j", 0)
    fold.note("j", 0, 6, 1)  # a replacement process's first word
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 6, "attempt": 1}]}


def test_the_silence_watch_reports_a_silent_rank_once_until_it_speaks() -> None:
    watch = SilenceWatch()
    watch.spoke("j", 0, 100.0)
    watch.spoke("j", 1, 100.0)
    watch.spoke("j", 1, 107.0)
    assert watch.silent(109.0, 8.0) == [("j", 0, 9.0)]
    assert watch.silent(120.0, 8.0) == [("j", 1, 13.0)]  # rank 0 was reported already
    watch.spoke("j", 0, 121.0)
    watch.forget("j", 1)
    assert watch.silent(130.0, 8.0) == [("j", 0, 9.0)]


def test_the_fold_keeps_each_ranks_worst_loss_and_sends_a_bad_one_at_once() -> None:
    fold = ProgressFold()
    fold.note("j", 0, 1, 0, loss=1.0)
    for step in range(2, 7):
        assert not fold.note("j", 0, step, 0, loss=1.0 + step / 100)  # ordinary losses wait for the period
    assert fold.note("j", 0, 7, 0, loss=2.5)  # above twice the rank's recent median: news
    assert not fold.note("j", 0, 8, 0, loss=1.0)
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 8, "attempt": 0, "loss": 2.5, "loss_step": 7}]}
    assert fold.note("j", 0, 9, 0, loss="nan", skip=["b8"])  # non-finite: news, and kept over a higher one
    fold.note("j", 0, 10, 0, loss="inf")
    fold.note("j", 0, 11, 0, loss=1e9)
    assert fold.take("j") == {"ranks": [{"rank": 0, "step": 11, "attempt": 0, "loss": "nan", "loss_step": 9,
                                         "skip": ["b8"]}]}
    assert (wire_loss(float("nan")), wire_loss(float("-inf")), wire_loss(3), wire_loss("x"), wire_loss(True)) == (
        "nan", "-inf", 3.0, None, None)
    assert wire_skip(["a", 7, "", "x" * 129, "b\n", None]) == ["a", "7"] and wire_skip("a") is None


def test_the_agent_says_an_ending_rank_lives_until_its_process_ends_within_a_bound() -> None:
    """A rank whose script said it is done, or whose interpreter is exiting, sends nothing more while its process
    ends (a final save, torch's teardown): its agent's report says it lives each period, for `ending_alive_s` at
    most, and says nothing of a rank that is not ending."""
    from types import SimpleNamespace
    from typing import Any

    from recovery.agent.relay import Relay

    class Agent(Relay):
        def __init__(self) -> None:
            ending = SimpleNamespace(alive=True, ending_since=100.0)
            training = SimpleNamespace(alive=True, ending_since=None)
            self.jobs = {"j": SimpleNamespace(processes={1: ending, 2: training}, nodes=["n0"])}  # type: ignore[dict-item]
            self.cfg = SimpleNamespace(ending_alive_s=30.0)  # type: ignore[assignment]
            self.progress = ProgressFold()
            self.sent: list[dict[str, Any]] = []

        def publish(self, job: str, type_: str, data: Any, event_id: str | None, heartbeat: bool) -> None:
            self.sent.append(data)

    agent = Agent()
    for rank in (1, 2):
        agent.progress.note("j", rank, 7, 3)
    agent.flush("j")
    agent._ending_alive(129.0)
    agent.flush("j")
    assert agent.sent[-1] == {"ranks": [{"rank": 1, "step": None, "attempt": 3}]}, agent.sent
    agent._ending_alive(130.0)  # a process that takes longer to end than the bound is silent again
    agent.flush("j")
    assert len(agent.sent) == 2, agent.sent
    agent.jobs["j"].processes[1].alive = False  # type: ignore[attr-defined]  # its process ended
    agent._ending_alive(101.0)
    agent.flush("j")
    assert len(agent.sent) == 2, "nothing said for a rank whose process ended"


async def test_a_rank_only_the_step_hook_speaks_for_is_relayed_its_counts_and_never_watched_for_silence() -> None:
    """The hook's client says hello, `counts`, heartbeats and counted steps: its agent relays the counts, drops the
    heartbeats (no rule reads them), and keeps no silence watch of it (a script that holds the interpreter in a
    native call for seconds is no hang); a rank whose SDK reports its own steps is watched as before."""
    from types import SimpleNamespace
    from typing import Any

    from recovery.agent.progress import SilenceWatch
    from recovery.agent.ranks import RankProcess
    from recovery.agent.relay import Relay

    class Agent(Relay):
        def __init__(self) -> None:
            procs = {rank: RankProcess("j", rank, 0, None, 100 + rank) for rank in (0, 1)}
            self.jobs = {"j": SimpleNamespace(processes=procs, nodes=["n0"], saves={},  # type: ignore[dict-item]
                                              stepped=anyio.Event())}
            self.cfg = SimpleNamespace(report_s=1.0)  # type: ignore[assignment]
            self.progress = ProgressFold()
            self.silence = SilenceWatch()
            self.sent: list[tuple[str, Any]] = []

        def publish(self, job: str, type_: str, data: Any, event_id: str | None, heartbeat: bool) -> None:
            self.sent.append((type_, data))

    agent = Agent()
    for rank, caps in ((0, ["counts"]), (1, ["steps"])):
        for message in ({"op": "hello", "pid": 100 + rank}, {"op": "caps", "caps": caps},
                        {"op": "heartbeat", "step": None}, {"op": "step", "step": 1}):
            await agent._report("j", {**message, "rank": rank, "attempt": 0})
    assert agent.jobs["j"].processes[0].counted_only and not agent.jobs["j"].processes[1].counted_only
    assert [rank for _, rank, _ in agent.silence.silent(1e12, 1.0)] == [1]
    agent.flush("j")
    said = [(r["rank"], r["step"]) for type_, data in agent.sent if type_ == "progress.report" for r in data["ranks"]]
    assert [step for rank, step in said if rank == 0] == [1], said  # its count, never its heartbeat
    assert [step for rank, step in said if rank == 1] == [None, 1], said

"""A healthy job's periodic reports off the log: the daemon's `progress.summary` (`recovery.service.summaries`), and
how the engine reads one (`recovery.core.progress`): each rank seen when the daemon heard it, and whatever is past
left out, never refused."""

from __future__ import annotations

import orjson

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from policies.base import NS
from recovery.service.summaries import ProgressSummaries
from recovery.testing.scenario import Scenario


def _summary(s: Scenario, job: str, ranks: list[dict[str, object]], period_s: float = 5.0) -> None:
    s.job_event(job, "progress.summary", ranks=ranks, period_s=period_s)


def _running(world_nodes: int = 2, **spec: object) -> Scenario:
    s = Scenario()
    s.submit("j", [f"n{i}" for i in range(world_nodes)], 2, dp=2 * world_nodes, **spec)
    s.train("j", 3)
    return s


def test_a_summarized_rank_is_seen_when_the_daemon_heard_it_not_at_the_record() -> None:
    s = _running()
    job = s.engine.jobs["j"]
    s.advance(4)
    _summary(s, "j", [{"rank": r, "step": 7, "attempt": 0, "heard_s": 1.5} for r in range(4)])
    assert job.last_seen == [s.now - int(1.5 * NS)] * 4
    assert job.last_progress == [s.now - int(1.5 * NS)] * 4
    assert job.steps == [7] * 4 and job.step == 7


def test_a_rank_missing_from_the_summaries_is_found_silent_within_its_bound() -> None:
    """Ranks 0-2 summarized every 4 s, rank 3 not after its last word: the watchdog finds rank 3 (and only it) silent
    within the 10 s bound plus a watchdog interval of when it was last heard; no healthy rank between summaries."""
    s = _running()
    heard_last, found = s.now, None
    for k in range(1, 17):
        s.advance(1)
        if k % 4 == 0:
            _summary(s, "j", [{"rank": r, "step": 3 + k, "attempt": 0, "heard_s": 0.5} for r in range(3)])
        if found is None and s.find("fault.confirmed", "j"):
            found = s.now
    [hang] = s.find("fault.confirmed", "j")
    assert hang.detail["fault"]["ranks"] == [3], hang.detail
    assert found is not None
    assert found - heard_last <= int((10 + s.engine.jobs["j"].spec.watchdog_interval_s) * NS)


def test_what_a_summary_says_that_is_past_is_left_out_and_nothing_is_refused() -> None:
    """Rank 0's agent logged step 9 after the daemon heard step 8: the summary's step 8 (heard before) changes nothing.
    A rank the job no longer has and a generation ahead of the job are left out, and the summary is not refused."""
    s = _running()
    job = s.engine.jobs["j"]
    s.advance(2)
    s.job_event("j", "progress.report", ranks=[{"rank": 0, "step": 9, "attempt": 0}])
    seen = job.last_seen[0]
    s.advance(1)
    _summary(s, "j", [{"rank": 0, "step": 8, "attempt": 0, "heard_s": 2.0},
                      {"rank": 1, "step": 8, "attempt": 0, "heard_s": 0.2},
                      {"rank": 2, "step": 2, "attempt": 0, "heard_s": 0.1},
                      {"rank": 9, "step": 8, "attempt": 0, "heard_s": 0.1},
                      {"rank": 3, "step": 8, "attempt": 5, "heard_s": 0.1}])
    assert not s.rejections, s.rejections
    assert job.steps[:4] == [9, 8, 3, 3]
    assert job.last_seen[0] == seen  # the older word left out
    assert job.last_seen[2] == s.now - int(0.1 * NS)  # heard, at a step it passed: seen, no step backwards


def test_a_summary_past_the_resume_point_closes_the_incident() -> None:
    s = _running()
    s.checkpoint("j", 2, "storage", "storage")
    s.job_event("j", "process.exited", rank=1, exit_code=1, attempt=0)
    s.ack_all()
    job = s.engine.jobs["j"]
    assert job.incident is not None and job.phase == "restoring", (job.state, job.phase)
    gen = job.generation
    s.advance(1)
    # the survivors hold step 3 in memory: the restart resumes after it, and step 4 is progress past it
    _summary(s, "j", [{"rank": r, "step": 4, "attempt": gen, "heard_s": 0.2} for r in range(4)])
    assert job.incident is None and s.state("j") == "running", s.kinds("j")[-5:]


# -- the daemon's side ---------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _report(node: str, job: str, ranks: list[dict[str, object]], envelope_node: str | None = None) -> tuple[str, bytes]:
    env = make_envelope("progress.report", {"ranks": ranks}, id=f"{node}-r", job=job,
                        node=envelope_node or node, source="agent")
    return subjects.reports(node), encode_envelope(env)


def _summaries(s: Scenario, clock: Clock, period_s: float = 4.0) -> ProgressSummaries:
    return ProgressSummaries(lambda: s.engine, period_s, clock=clock)


def _data(message: object) -> dict[str, object]:
    return orjson.loads(message.data)["data"]  # type: ignore[attr-defined]


def test_the_daemon_summarizes_each_rank_newest_step_mean_compute_and_worst_loss_with_when_heard() -> None:
    s, clock = _running(), Clock()
    agg = _summaries(s, clock)
    agg.hear(*_report("n0", "j", [{"rank": 0, "step": 5, "attempt": 0, "compute_s": 1.0, "compute_steps": 1,
                                   "loss": 2.0, "loss_step": 5}, {"rank": 1, "step": 5, "attempt": 0}]))
    clock.now += 1
    agg.hear(*_report("n0", "j", [{"rank": 0, "step": 7, "attempt": 0, "compute_s": 2.0, "compute_steps": 3,
                                   "loss": 1.0, "loss_step": 7}]))
    agg.hear(*_report("n1", "j", [{"rank": 2, "step": 6, "attempt": 0}]))
    clock.now += 1
    assert agg.messages() == []  # not due: a period from the first report
    clock.now += 2.5
    [message] = agg.messages()
    assert message.subject == subjects.job_event("j", "progress.summary")
    data = _data(message)
    assert data["period_s"] == 4.0
    by_rank = {e["rank"]: e for e in data["ranks"]}  # type: ignore[union-attr]
    assert sorted(by_rank) == [0, 1, 2]
    assert by_rank[0]["step"] == 7 and by_rank[0]["compute_steps"] == 4
    assert abs(by_rank[0]["compute_s"] - 1.75) < 1e-9  # (1 x 1.0 + 3 x 2.0) / 4
    assert by_rank[0]["loss"] == 2.0 and by_rank[0]["loss_step"] == 5
    assert by_rank[0]["heard_s"] == 3.5 and by_rank[1]["heard_s"] == 4.5
    clock.now += 5
    assert agg.messages() == []  # nothing heard since: no rank is said to live


def test_a_report_for_another_nodes_ranks_or_garbage_is_dropped_and_an_unknown_jobs_ignored() -> None:
    s, clock = _running(), Clock()
    agg = _summaries(s, clock)
    agg.hear(*_report("n0", "j", [{"rank": 2, "step": 9, "attempt": 0}]))  # rank 2 runs on n1
    agg.hear(*_report("n0", "j", [{"rank": 0, "step": 9, "attempt": 0}], envelope_node="n1"))
    agg.hear(*_report("n0", "nope", [{"rank": 0, "step": 9, "attempt": 0}]))
    agg.hear(subjects.reports("n0"), b"{not json")
    agg.hear(subjects.reports("n0"), orjson.dumps({"type": "progress.report", "job": "j", "node": "n0",
                                                   "data": {"ranks": [{"rank": -1}]}}))
    assert agg.dropped == 4 and agg.ignored == 1  # another partition's job is no error
    clock.now += 10
    assert agg.messages(force=True) == []


def test_a_job_with_a_short_silence_bound_is_summarized_within_half_of_it() -> None:
    s = Scenario()
    s.submit("j", ["n0"], 2, dp=2, policies={"detection": {"name": "default", "params": {"hang_min_silence_s": 3}}})
    agg = _summaries(s, Clock(), period_s=10.0)
    assert agg.period_of("j") == 1.5


def test_a_large_jobs_summary_is_cut_into_records_under_the_payload_limit() -> None:
    s = Scenario()
    nodes = [f"n{i}" for i in range(64)]
    s.submit("big", nodes, 8, dp=512)
    clock = Clock()
    agg = ProgressSummaries(lambda: s.engine, 4.0, clock=clock, max_payload=8192)
    for i, node in enumerate(nodes):
        agg.hear(*_report(node, "big", [{"rank": 8 * i + r, "step": 3, "attempt": 0} for r in range(8)]))
    messages = agg.messages(force=True)
    assert len(messages) > 1
    assert all(len(m.data) <= 8192 for m in messages)
    ranks = [e["rank"] for m in messages for e in _data(m)["ranks"]]  # type: ignore[union-attr]
    assert ranks == list(range(512))
    s.advance(1)
    for message in messages:  # each is a record the engine takes
        s.send(message.subject, message.data)
    assert not s.rejections and s.engine.jobs["big"].steps == [3] * 512


def test_an_entry_out_of_bounds_drops_its_report_whichever_way_it_is_checked() -> None:
    """Plain entries are checked by hand, the others by the model: either way a value out of its bounds (a float
    rank, a negative step, a compute time past 30 days, an unknown field) drops the whole report, and a good entry with
    a loss is taken."""
    s, clock = _running(), Clock()
    agg = _summaries(s, clock)
    for bad in ({"rank": 0.0, "step": 1}, {"rank": 0, "step": -1}, {"rank": 0, "compute_s": 1e12},
                {"rank": 0, "step": True}, {"rank": 0, "what": 1}, {"rank": 0, "loss": "nan", "loss_step": -2}):
        agg.hear(subjects.reports("n0"), orjson.dumps({"type": "progress.report", "job": "j", "node": "n0",
                                                       "data": {"ranks": [{"rank": 1, "step": 4}, bad]}}))
    assert agg.dropped == 6 and agg.heard == {}
    agg.hear(*_report("n0", "j", [{"rank": 1, "step": 4, "attempt": 0, "loss": "nan", "loss_step": 4}]))
    [message] = agg.messages(force=True)
    assert _data(message)["ranks"] == [{"rank": 1, "step": 4, "attempt": 0, "heard_s": 0.0, "loss": "nan",
                                        "loss_step": 4}]


def test_ranks_that_name_much_data_for_their_losses_still_fit_each_record_under_the_limit() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], 8, dp=16)
    agg = ProgressSummaries(lambda: s.engine, 4.0, clock=Clock(), max_payload=16384)
    names = [f"shard-{k:03d}/" + "x" * 110 for k in range(64)]  # MAX_SKIP names of 120 characters
    for i in range(2):
        agg.hear(*_report(f"n{i}", "j", [{"rank": 8 * i + r, "step": 3, "attempt": 0, "loss": 9.0, "loss_step": 3,
                                          "skip": names} for r in range(8)]))
    messages = agg.messages(force=True)
    assert all(len(m.data) <= 16384 for m in messages) and len(messages) > 2
    assert sorted(e["rank"] for m in messages for e in _data(m)["ranks"]) == list(range(16))  # type: ignore[union-attr]


def test_a_rank_whose_script_ended_is_not_silent_while_the_others_finish() -> None:
    """Rank 0 exited 0 (its script's end) while the others take longer to end (they are heard): its silence since is
    no hang, and the job completes without an incident."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], 2, dp=4, policies={"detection": {"name": "default", "params": {
        "hang_min_silence_s": 5}}})
    s.train("j", 3)
    s.job_event("j", "process.exited", rank=0, exit_code=0, attempt=0)
    s.idle("j", 12, ranks=[1, 2, 3])  # the others are heard, their scripts ending
    assert not s.find("fault.confirmed", "j"), s.kinds("j")
    for rank in (1, 2, 3):
        s.job_event("j", "process.exited", rank=rank, exit_code=0, attempt=0)
    s.job_event("j", "job.completed")
    assert s.state("j") == "completed" and not s.find("incident.opened", "j")


def test_a_summarized_step_heard_before_the_jobs_newest_gives_no_pace_from_time_running_backwards() -> None:
    """Rank 1's agent logged step 9 now; the summary says rank 2 reached step 10, heard 3 s ago: the job's step is 10,
    and its step time is not measured from a step heard before the one it follows."""
    s = _running()
    job = s.engine.jobs["j"]
    s.advance(5)
    s.job_event("j", "progress.report", ranks=[{"rank": 1, "step": 9, "attempt": 0}])
    pace = job.step_time
    s.advance(0.5)
    _summary(s, "j", [{"rank": 2, "step": 10, "attempt": 0, "heard_s": 3.0}])
    assert job.step == 10 and job.step_time == pace  # no pace measured from it

"""Capabilities, not guesses: the engine restarts a rank alone (its peers re-forming in their processes) only of a
job whose ranks said they can (`reform`), and asks a dying checkpoint only of one whose ranks said they can write
one (`save`). Step reports alone change how a fault is found and timed, never how much restarts; a log whose agents
relayed no capabilities (an older one) decides as it always did."""

from __future__ import annotations

from typing import Any

import pytest

from recovery.testing.scenario import Scenario


def killed(caps: list[str] | None, *, announces: bool = True, reports: bool = True) -> Scenario:
    """A job of 4 ranks on 2 nodes whose agents say (`announces`) that they relay what the SDK can do, each rank
    announcing `caps` (None: nothing announced), training 5 steps (`reports`: through the SDK), then rank 1 killed."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, spares=0)
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=announces)
        if caps is not None:
            s.job_event("j", "process.capabilities", rank=rank, attempt=0, caps=caps)
    if reports:
        s.train("j", 5)
    else:
        s.advance(5)
    s.job_event("j", "process.exited", rank=1, attempt=0, signal=9)
    s.advance(1)
    return s


def first_granularity(s: Scenario) -> Any:
    return s.find("attempt.started", "j")[0].detail["granularity"]


def dying_asked(s: Scenario) -> bool:
    return bool(s.commands_of("save_checkpoint") or s.find("checkpoint.awaiting", "j"))


def test_a_script_that_only_reports_steps_restarts_whole_as_a_stock_one_and_is_asked_no_dying_checkpoint() -> None:
    steps_only, stock = killed(["steps"]), killed(None, reports=False)
    assert first_granularity(steps_only) == first_granularity(stock) == "restart_job"
    assert not dying_asked(steps_only) and not dying_asked(stock)
    assert steps_only.engine.jobs["j"].snapshot()["capabilities"] == ["steps"]


def test_ranks_that_re_form_in_process_restart_alone_and_a_save_handler_is_asked_for_its_checkpoint() -> None:
    s = killed(["reform", "save", "steps"])
    assert first_granularity(s) == "in_place"
    [restart] = s.commands_of("restart_ranks")
    assert restart.ranks == [1]


@pytest.mark.parametrize("caps", [["reform"], ["reform", "steps"]])
def test_re_formation_without_a_save_handler_restarts_alone_without_asking_a_checkpoint(caps: list[str]) -> None:
    s = killed(caps)
    assert first_granularity(s) == "in_place"
    assert not s.commands_of("save_checkpoint")


def test_a_log_whose_agents_relay_no_capabilities_decides_as_before_they_existed() -> None:
    """Old logs replay byte for byte: an SDK job restarts a rank alone, as every SDK job did."""
    s = killed(None, announces=False)
    assert first_granularity(s) == "in_place"
    assert s.engine.jobs["j"].caps is None and "capabilities" not in s.engine.jobs["j"].snapshot()


def test_the_word_of_a_replaced_process_and_of_an_unknown_rank() -> None:
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4)
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=True)
    job = s.engine.jobs["j"]
    job.rank_gen[2] = 1  # rank 2's process was replaced by a restart of generation 1
    job.generation = 1
    s.job_event("j", "process.capabilities", rank=2, attempt=0, caps=["reform"])
    assert job.caps == frozenset()  # the old process is gone: what it could do says nothing of the new one
    s.job_event("j", "process.capabilities", rank=2, attempt=1, caps=["reform"])
    assert job.caps == frozenset({"reform"})
    effects = s.job_event("j", "process.capabilities", rank=9, attempt=0, caps=["save"])
    assert [getattr(e, "code", None) for e in effects] == ["unknown_rank"]
    assert job.caps == frozenset({"reform"})


def test_a_script_reporting_no_checkpoints_has_its_lost_steps_from_where_its_first_step_says_it_resumed() -> None:
    """Its restart resumed from its own snapshot, which the plan cannot name: the first step the restarted ranks
    report says where (step 4 reported: it resumed at 3), and the steps lost are counted from there, never from 0."""
    s = killed(["steps"])
    s.ack_all()
    job = s.engine.jobs["j"]
    assert job.phase == "restoring", s.kinds("j")
    s.steps("j", 4, attempt=job.generation)
    [closed] = s.find("incident.closed", "j")
    assert closed.detail["lost_steps"] == 2 and "resume point 3" in closed.reason, closed


def test_a_script_reporting_checkpoints_has_its_lost_steps_from_its_newest_complete_checkpoint() -> None:
    s = killed(["steps", "checkpoints"])
    s.checkpoint("j", 2, "storage", "storage")
    s.ack_all()
    job = s.engine.jobs["j"]
    s.steps("j", 4, attempt=job.generation)
    [closed] = s.find("incident.closed", "j")
    # the checkpoint of step 2 landed before the restart was sent, and its plan carried it: 5 - 2, whatever the
    # first step reported says (4, which would have said 3)
    assert closed.detail["lost_steps"] == 3 and "resume point 2" in closed.reason, closed


def test_counted_steps_time_a_stock_restart_to_its_first_optimizer_step_and_claim_no_resume_point() -> None:
    """The step hook's counts (`counts`, no `steps`): the job is a stock script in how it is found and restarted
    (whole, no dying checkpoint, no silence rule), yet its restart closes at the first step a restarted process
    counts, with the steps lost unknown, never counted from a resume point the script never named."""
    s = killed(["counts"])
    job = s.engine.jobs["j"]
    assert not job.sdk and job.counted
    assert first_granularity(s) == "restart_job" and not dying_asked(s)
    s.ack_all()
    assert job.phase == "restoring", s.kinds("j")
    s.steps("j", 1, attempt=job.generation)
    [closed] = s.find("incident.closed", "j")
    assert closed.detail["lost_steps"] is None and "1 optimizer step(s) counted" in closed.reason, closed
    s.advance(120)  # no word from the ranks for two minutes: a stock script's silence, never a hang
    assert not s.find("fault.confirmed", "j")[1:], s.kinds("j")


def test_counts_that_came_before_their_word_still_make_no_sdk_job() -> None:
    """The daemon may log a rank's first counted step before the word that says what it is (the summary path):
    once the word comes, the job is the stock script it is."""
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, spares=0)
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=True)
    s.train("j", 3)
    job = s.engine.jobs["j"]
    assert job.sdk
    s.job_event("j", "process.capabilities", rank=0, attempt=0, caps=["counts"])
    assert not job.sdk and job.counted
    s.job_event("j", "process.capabilities", rank=1, attempt=0, caps=["counts", "steps"])  # a real SDK rank
    assert not job.counted


def test_the_report_of_a_script_reporting_steps_but_no_checkpoints_names_its_own_snapshot(tmp_path: Any) -> None:
    """Its restart resumed from a snapshot the plan never named: the postmortem says the script's own, never the
    plan's "step 0"."""
    from recovery.log.file import FileLog
    from recovery.report import build_report, iter_file

    path = tmp_path / "log.jsonl"
    s = Scenario(log=FileLog(path))
    s.submit("j", ["n0", "n1"], ranks_per_node=2, dp=4, spares=0)
    for rank in range(4):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=True)
        s.job_event("j", "process.capabilities", rank=rank, attempt=0, caps=["steps"])
    s.train("j", 5)
    s.job_event("j", "process.exited", rank=1, attempt=0, signal=9)
    s.advance(1)
    s.ack_all()
    s.steps("j", 4, attempt=s.engine.jobs["j"].generation)
    [incident] = build_report(iter_file(path))["jobs"][0]["incidents"]
    assert incident["checkpoint"]["source"] == "the script's own", incident["checkpoint"]
    assert incident["lost_steps"] == 2  # from where its first step says it resumed

"""A batch's outputs stored permuted, as a connection that drops mid-publish leaves them: the daemon sends again the
messages written into the dead socket after the ones that were still buffered, so JetStream stores e.g. a
`checkpoint.plan` before the `fault.confirmed` it follows. Verify, the log checks and the report read decisions in
their `(cause_seq, index)` order, so such a log is neither a divergence nor a different postmortem."""

from __future__ import annotations

from pathlib import Path
from random import Random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recovery.cli.replay import main
from recovery.log import iter_file
from recovery.log.recorder import decision_order, replay
from recovery.report import build_report
from recovery.report import iter_file as report_records
from recovery.report.diff import diff_logs
from tests.daemon_support import check_log
from tests.golden.scenarios import SCENARIOS, path
from tests.property_plans import Plan, plans
from tests.test_properties import dumped, run_plan

RUN_NAMES = sorted(SCENARIOS)


def output_runs(lines: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of consecutive records on output subjects."""
    runs, start = [], None
    for i, line in enumerate([*lines, {"subject": ""}]):
        is_out = line["subject"].startswith(("recovery.dec.", "recovery.dlq."))
        if is_out and start is None:
            start = i
        elif not is_out and start is not None:
            runs.append((start, i))
            start = None
    return runs


def store_in_order(lines: list[dict[str, Any]], order: list[int]) -> list[dict[str, Any]]:
    """The records whose envelopes are `lines[order[k]]`, stored at position k: seq, time and subject position
    stay where the stream put them, the content moves."""
    out = []
    for slot, source in zip(lines, order, strict=True):
        moved = dict(lines[source])
        moved["seq"], moved["ts"] = slot["seq"], slot["ts"]
        out.append(moved)
    return out


def permuted(src: Path, dst: Path) -> int:
    """Write `src` with each run of outputs reversed (one cause's decisions, last first; the rejection of an input
    before or after them). Returns how many records moved."""
    lines = [orjson.loads(line) for line in src.read_bytes().splitlines()]
    order = list(range(len(lines)))
    for start, end in output_runs(lines):
        order[start:end] = reversed(order[start:end])
    dst.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in store_in_order(lines, order)))
    return sum(1 for i, j in enumerate(order) if i != j)


def without_seqs(value: Any) -> Any:
    """A report with the stored positions of its decisions left out (they are what the permutation changed)."""
    if isinstance(value, dict):
        return {k: without_seqs(v) for k, v in value.items() if k != "seq"}
    if isinstance(value, list):
        return [without_seqs(v) for v in value]
    return value


@pytest.mark.parametrize("name", RUN_NAMES)
def test_a_permuted_batch_verifies_and_checks(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moved = tmp_path / f"{name}.jsonl"
    if permuted(path(name), moved) == 0:
        pytest.fail(f"{name} has no two outputs to permute")
    recorded = replay(iter_file(path(name))).recorded_decisions
    assert replay(iter_file(moved)).recorded_decisions == recorded  # the true order, whatever the stored one
    check_log(list(iter_file(moved)))
    assert main(["verify", str(moved)]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", RUN_NAMES)
def test_a_permuted_batch_gives_the_same_report(name: str, tmp_path: Path) -> None:
    moved = tmp_path / f"{name}.jsonl"
    permuted(path(name), moved)
    original = build_report(report_records(path(name)))
    assert without_seqs(build_report(report_records(moved))) == without_seqs(original)


@pytest.mark.parametrize("name", RUN_NAMES)
def test_a_permuted_batch_is_no_difference(name: str, tmp_path: Path) -> None:
    moved = tmp_path / f"{name}.jsonl"
    permuted(path(name), moved)
    assert diff_logs(report_records(path(name)), report_records(moved))["same"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plans(), st.randoms(use_true_random=False))
def test_any_permutation_of_a_causes_outputs_replays_to_the_recorded_order(plan: Plan, rng: Random) -> None:
    """Several jobs' decisions from one input (a node's fault), each job's indexed on its own, shuffled as a
    reconnect may store them: the replay puts them back in the order the engine made them."""
    scenario = run_plan(plan).scenario
    records = list(scenario.log.records())
    runs, start = [], None
    for i, record in enumerate([*records, None]):
        out = record is not None and record.subject.startswith(("recovery.dec.", "recovery.dlq."))
        if out and start is None:
            start = i
        elif not out and start is not None:
            runs.append((start, i))
            start = None
    for a, b in runs:
        block = records[a:b]
        rng.shuffle(block)
        records[a:b] = block
    replayed = replay(records)
    assert dumped(replayed.recorded_decisions) == dumped(replayed.decisions) == dumped(scenario.decisions)
    assert dumped(replayed.recorded_rejections) == dumped(replayed.rejections)


def test_the_engines_order_across_jobs_is_kept_whatever_the_stored_one() -> None:
    """One cause, two jobs, each indexed on its own, made in the order b0, a0, b1 (not sorted by job): a stored
    permutation is put back in that order, and a log stored in order is left as it is."""
    [template, *_] = replay(iter_file(path("pod_level_reschedule"))).decisions
    b0, a0, b1 = (template.model_copy(update={"job": job, "cause_seq": 9, "index": index})
                  for job, index in (("b", 0), ("a", 0), ("b", 1)))
    made = [b0, a0, b1]
    assert decision_order([a0, b1, b0], made) == made
    assert decision_order([b1, b0], made) == [b0, b1]  # a0 not recorded: the others keep their order
    late = template.model_copy(update={"job": "c", "cause_seq": 9, "index": 0})  # the replay did not make it
    assert decision_order([late, *made], made) == [*made, late]

"""The names the engine writes are closed sets (events.names): every decision kind the golden logs hold is one, each
value names one member, and a member goes on the wire as exactly the bytes of its string."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import orjson
import pytest

from events.codec import decode_record_line, encode_envelope
from events.envelope import make_envelope
from events.names import (
    ATTEMPT_ENDED,
    AttemptOutcome,
    AttemptPurpose,
    DecisionKind,
    IncidentCause,
    IncidentOutcome,
    TimerPurpose,
)
from events.outputs import Decision
from events.subjects import DECISIONS
from policies import AttemptSummary, Granularity

GOLDEN = Path(__file__).parent / "golden"
NAMES: tuple[type[StrEnum], ...] = (DecisionKind, IncidentCause, IncidentOutcome, AttemptPurpose, AttemptOutcome,
                                    TimerPurpose)


def golden_decision_kinds() -> set[str]:
    """Every `kind` of a decision recorded in a golden log, as plain JSON, not through the models that check it."""
    kinds: set[str] = set()
    for log in sorted(GOLDEN.glob("*.jsonl")):
        for line in log.read_bytes().splitlines():
            record = orjson.loads(line)
            envelope = record.get("envelope") or {}
            if envelope.get("type") == "decision":
                kinds.add(envelope["data"]["kind"])
    return kinds


def test_every_decision_kind_in_the_golden_logs_is_a_member() -> None:
    kinds = golden_decision_kinds()
    assert len(kinds) > 20, "the golden logs hold most kinds of decision"
    assert kinds <= {kind.value for kind in DecisionKind}, sorted(kinds - set(DecisionKind))


@pytest.mark.parametrize("names", NAMES, ids=lambda names: names.__name__)
def test_each_value_names_one_member(names: type[StrEnum]) -> None:
    values = [member.value for member in names.__members__.values()]  # aliases included
    assert len(values) == len(set(values))


def test_a_decision_made_with_a_member_is_the_same_bytes_as_one_made_with_its_string() -> None:
    fields = {"job": "llm", "cause_seq": 7, "index": 0, "previous": "running", "state": "suspect"}
    by_member = Decision(kind=DecisionKind.FAULT_SUSPECTED, **fields)
    by_string = Decision(kind="fault.suspected", **fields)  # type: ignore[arg-type]
    assert by_member == by_string and type(by_string.kind) is DecisionKind
    encoded = encode_envelope(make_envelope("decision", by_member, id="dec:llm:7:0", job="llm"))
    assert encoded == encode_envelope(make_envelope("decision", by_string, id="dec:llm:7:0", job="llm"))
    assert b'"kind":"fault.suspected"' in encoded


def test_a_recorded_decision_reads_back_with_its_kind_a_member() -> None:
    line = next(line for line in (GOLDEN / "pod_level_reschedule.jsonl").read_bytes().splitlines()
                if b'"type":"decision"' in line)
    record = decode_record_line(line)
    assert record.subject.startswith(DECISIONS.rstrip(">"))
    assert type(record.envelope.data.kind) is DecisionKind  # type: ignore[union-attr]


def test_a_decision_of_a_kind_outside_the_set_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Decision(job="llm", cause_seq=7, index=0, kind="fault.suspect", previous="running",  # type: ignore[arg-type]
                 state="suspect")


def test_every_attempt_that_ends_without_recovering_has_its_decision() -> None:
    assert {outcome: kind.value for outcome, kind in ATTEMPT_ENDED.items()} == {
        outcome: f"attempt.{outcome.value}" for outcome in ATTEMPT_ENDED}
    assert set(ATTEMPT_ENDED) == set(AttemptOutcome) - {AttemptOutcome.RECOVERED, AttemptOutcome.PAUSED}


def test_a_policy_sees_an_attempts_outcome_as_a_member_whichever_way_it_was_given() -> None:
    summary = AttemptSummary(Granularity.MIGRATE, "superseded", 1)  # type: ignore[arg-type]
    assert summary.outcome is AttemptOutcome.SUPERSEDED and summary.outcome == "superseded"

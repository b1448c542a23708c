"""Bad input at the edge: every class gets a rejection with its code and a readable reason, a dead-letter
record in the log, no change to the engine's state (so none to another job), and the next valid event is
applied as if nothing had happened.

Decode-level cases go in as raw bytes through `Scenario.send`, exactly as a daemon would receive them.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from events import subjects
from events.codec import encode_envelope
from events.envelope import MAX_PAYLOAD_BYTES, Record, make_envelope
from events.outputs import Decision, Rejection
from recovery.core.engine import Effect
from recovery.testing.scenario import Scenario

JOB = "job-a"
OTHER = "job-b"


@pytest.fixture
def scenario() -> Iterator[Scenario]:
    """Two running jobs at step 3 on their own nodes: `job-a` takes the bad input, `job-b` must not notice."""
    s = Scenario()
    s.submit(JOB, ["a0", "a1"], ranks_per_node=2, dp=2, tp=2)
    s.submit(OTHER, ["b0"], ranks_per_node=2, dp=2)
    s.train(JOB, 3)
    s.train(OTHER, 3)
    assert not s.rejections
    yield s


def state(s: Scenario) -> tuple[dict[str, Any], bytes]:
    """The engine's state without `last_seq`, that is the read cursor, which every record advances, rejected
    or not (a restarted daemon must not read a rejected record again): its `snapshot()` view, and the whole
    of it as pickled for the daemon's snapshots (which also holds what the view leaves out)."""
    snapshot = s.engine.snapshot()
    del snapshot["last_seq"]
    cursor = s.engine.last_seq
    s.engine.last_seq = 0
    try:
        whole = pickle.dumps(s.engine, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        s.engine.last_seq = cursor
    return snapshot, whole


def raw(**envelope: Any) -> bytes:
    return orjson.dumps(envelope)


def step_event(job: str, rank: int, step: int, event_id: str) -> bytes:
    return raw(id=event_id, type="progress.step", job=job, source="test", data={"rank": rank, "step": step})


def expect_rejected(s: Scenario, subject: str, payload: bytes, code: str, *reason_parts: str) -> Rejection:
    """Send one bad input; check the rejection, its dead letter, and that nothing changed; then check that a
    valid event for each job right after it is applied."""
    before = state(s)
    other_before = s.engine.jobs[OTHER].snapshot()
    effects = s.send(subject, payload)
    assert len(effects) == 1 and isinstance(effects[0], Rejection), effects
    rejection = effects[0]
    assert rejection.code == code, rejection
    assert rejection.subject == subject
    for part in reason_parts:
        assert part in rejection.reason, f"{part!r} not in reason {rejection.reason!r}"
    after = state(s)
    assert after[0] == before[0], "a rejected input changed the engine's state"
    assert after[1] == before[1], "a rejected input changed the engine's state beyond its snapshot view"
    assert s.engine.jobs[OTHER].snapshot() == other_before
    dead = [r for r in s.log.records() if r.subject == subjects.dead_letter(code)]
    assert dead and isinstance(dead[-1], Record) and dead[-1].envelope.data == rejection, "no dead letter"
    assert_still_applies(s)
    return rejection


def assert_still_applies(s: Scenario) -> None:
    for job in (JOB, OTHER):
        state_ = s.engine.jobs[job]
        step = state_.step + 1
        effects: list[Effect] = []
        for rank in range(state_.world):
            effects += s.job_event(job, "progress.step", rank=rank, step=step)
        assert not [e for e in effects if isinstance(e, Rejection)], effects
        assert state_.steps == [step] * state_.world, f"{job} did not take the valid step after a bad input"


def test_malformed_json_is_rejected(scenario: Scenario) -> None:
    rejection = expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), b'{"id": "x", "type": ',
                                "malformed_json", "not JSON")
    assert rejection.event_id is None


def test_json_that_is_not_an_object_is_rejected_as_malformed(scenario: Scenario) -> None:
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), b'["progress.step", 1]',
                    "malformed_json", "JSON list, not an object")


def test_unknown_type_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="tp-1", type="process.teleported", job=JOB, data={"rank": 0})
    rejection = expect_rejected(scenario, subjects.job_event(JOB, "process.teleported"), payload,
                                "unknown_type", "'process.teleported'")
    assert (rejection.event_id, rejection.job) == ("tp-1", JOB)


def test_an_output_type_sent_as_input_is_rejected_as_unknown(scenario: Scenario) -> None:
    """A forged decision on an input subject is not an input event: the engine never takes it as one."""
    forged = Decision(job=JOB, cause_seq=1, index=0, kind="job.failed", previous="running", state="failed",
                      policy=None)
    envelope = make_envelope("decision", forged, id="forged-1", job=JOB)
    expect_rejected(scenario, subjects.job_event(JOB, "decision"), encode_envelope(envelope), "unknown_type",
                    "decision is not an input event")


@pytest.mark.parametrize(("data", "reason"), [
    ({"rank": 0, "step": -1}, "step: Input should be greater than or equal to 0"),
    ({"rank": 0}, "step: Field required"),
    ({"rank": 0, "step": 9, "lr": 0.1}, "lr: Extra inputs are not permitted"),
    ({"rank": 0, "step": 9, "loss": "NaN"}, "loss.float: Input should be a valid number"),  # the words: nan, inf
    ({"rank": 0, "step": 9, "loss": True}, "loss.float: Input should be a valid number"),
    ({"rank": "zero", "step": 9}, "rank: Input should be a valid integer"),
    ({"rank": True, "step": 9}, "data.rank: Input should be a valid integer, not a boolean"),
    ({"rank": 0, "step": False}, "data.step: Input should be a valid integer, not a boolean"),
    ({"rank": 0, "step": "9"}, "data.step: Input should be a valid integer"),
    ({"rank": 0, "step": 9.0}, "data.step: Input should be a valid integer"),
    ({"rank": 0, "step": 2**53}, "data.step: Input should be less than or equal to 9007199254740991"),
    ({"rank": 1 << 20, "step": 9}, "data.rank: Input should be less than or equal to 1048575"),
    ({"rank": 0, "step": 9, "attempt": True}, "data.attempt: Input should be a valid integer, not a boolean"),
])
def test_schema_violation_is_rejected(scenario: Scenario, data: dict[str, Any], reason: str) -> None:
    payload = raw(id="sv-1", type="progress.step", job=JOB, data=data)
    rejection = expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "schema_violation",
                                reason)
    assert (rejection.event_id, rejection.job) == ("sv-1", JOB)


def test_a_checkpoint_saved_in_the_peer_tier_is_a_schema_violation(scenario: Scenario) -> None:
    payload = raw(id="sv-peer", type="checkpoint.saved", job=JOB,
                  data={"step": 3, "tier": "peer", "shards": [0], "holder": "a0"})
    expect_rejected(scenario, subjects.job_event(JOB, "checkpoint.saved"), payload, "schema_violation",
                    "'peer' names live replicas in a resume plan, not a tier a checkpoint is saved in")


def test_unsupported_schema_version_is_a_schema_violation(scenario: Scenario) -> None:
    payload = raw(id="sv-2", type="progress.step", job=JOB, schema=7, data={"rank": 0, "step": 9})
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "schema_violation",
                    "schema 7 is not supported")


def test_a_job_event_without_a_job_is_a_schema_violation(scenario: Scenario) -> None:
    payload = raw(id="sv-3", type="progress.step", data={"rank": 0, "step": 9})
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "schema_violation",
                    "names no job")


@pytest.mark.parametrize("bad_id", ["job.a", "job*", "job>", "job a", "job\ta", "job\na", ""])
def test_job_id_that_breaks_a_subject_token_is_rejected(scenario: Scenario, bad_id: str) -> None:
    payload = step_event(bad_id, 0, 9, "tok-1")
    rejection = expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "bad_subject_token",
                                "job: id")
    assert "subject token" in rejection.reason


def test_node_id_that_breaks_a_subject_token_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="tok-2", type="node.not_ready", node="a0.*", data={"reason": "x"})
    expect_rejected(scenario, subjects.node_event("a0", "node.not_ready"), payload, "bad_subject_token",
                    "node: id", "'.'")


def test_token_in_a_command_target_is_checked_too(scenario: Scenario) -> None:
    """A checkpoint holder becomes a command target's subject token: it is validated like the ids."""
    payload = raw(id="tok-3", type="checkpoint.saved", job=JOB,
                  data={"step": 3, "tier": "memory", "shards": [0, 1], "holder": "a0 a1"})
    expect_rejected(scenario, subjects.job_event(JOB, "checkpoint.saved"), payload, "bad_subject_token",
                    "data.holder", "' '")


def test_event_for_an_unknown_job_is_rejected(scenario: Scenario) -> None:
    rejection = expect_rejected(scenario, subjects.job_event("job-z", "progress.step"),
                                step_event("job-z", 0, 9, "uj-1"), "unknown_job", "job-z", "never submitted")
    assert rejection.job == "job-z"
    assert "job-z" not in scenario.engine.jobs


def test_step_going_backwards_is_rejected(scenario: Scenario) -> None:
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), step_event(JOB, 1, 2, "sb-1"),
                    "step_backwards", "rank 1 reported step 2 after step 3")


def test_duplicate_event_id_is_rejected(scenario: Scenario) -> None:
    """The log drops a repeated Nats-Msg-Id; bytes that come without one (or after the log's window) are
    caught by the engine's own dedupe."""
    first = step_event(JOB, 0, 4, "dup-1")
    assert not [e for e in scenario.send(subjects.job_event(JOB, "progress.step"), first)
                if isinstance(e, Rejection)]
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), first, "duplicate", "'dup-1'",
                    "already applied")


def test_duplicate_node_event_id_is_rejected(scenario: Scenario) -> None:
    first = raw(id="dup-2", type="network.link_down", node="b0", data={"link": "mlx5_0"})
    assert not [e for e in scenario.send(subjects.node_event("b0", "network.link_down"), first)
                if isinstance(e, Rejection)]
    expect_rejected(scenario, subjects.node_event("b0", "network.link_down"), first, "duplicate", "'dup-2'")


def test_duplicate_submission_is_rejected(scenario: Scenario) -> None:
    spec = scenario.engine.jobs[JOB].spec.model_dump(mode="json")
    payload = raw(id="sub-2", type="job.submitted", job=JOB, data={"spec": spec})
    expect_rejected(scenario, subjects.job_event(JOB, "job.submitted"), payload, "duplicate",
                    "already submitted")


def test_job_event_on_another_jobs_subject_is_rejected(scenario: Scenario) -> None:
    rejection = expect_rejected(scenario, subjects.job_event(OTHER, "progress.step"), step_event(JOB, 0, 9, "sm-1"),
                                "subject_mismatch", f"expected {subjects.job_event(JOB, 'progress.step')!r}")
    assert rejection.job == JOB


def test_event_on_the_subject_of_another_type_is_rejected(scenario: Scenario) -> None:
    expect_rejected(scenario, subjects.job_event(JOB, "process.heartbeat"), step_event(JOB, 0, 9, "sm-2"),
                    "subject_mismatch", "arrived on")


def test_node_event_on_another_nodes_subject_is_rejected(scenario: Scenario) -> None:
    """An agent may publish only on its own node's subjects: a fault claimed for b0 that came on a0's subject
    is refused, so one node cannot report faults of another."""
    payload = raw(id="sm-3", type="device.fault", node="b0", data={"device": 0, "vendor": "nvidia", "code": "79"})
    rejection = expect_rejected(scenario, subjects.node_event("a0", "device.fault"), payload, "subject_mismatch",
                                "for node b0", "'recovery.ev.node.a0.device.fault'")
    assert rejection.node == "b0"


def test_oversized_payload_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="big-1", type="device.fault", node="a0",
                  data={"device": 0, "vendor": "nvidia", "code": "79", "message": "x" * MAX_PAYLOAD_BYTES})
    assert len(payload) > MAX_PAYLOAD_BYTES
    expect_rejected(scenario, subjects.node_event("a0", "device.fault"), payload, "oversized",
                    f"exceeds {MAX_PAYLOAD_BYTES}")


def test_unknown_rank_in_a_step_is_rejected(scenario: Scenario) -> None:
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), step_event(JOB, 4, 9, "ur-1"),
                    "unknown_rank", "rank 4 is not in job job-a (world 4)")


def test_unknown_rank_in_a_process_exit_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="ur-2", type="process.exited", job=JOB, data={"rank": 17, "exit_code": 1})
    expect_rejected(scenario, subjects.job_event(JOB, "process.exited"), payload, "unknown_rank", "rank 17")


def test_unknown_rank_in_a_collective_timeout_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="ur-3", type="network.collective_timeout", job=JOB,
                  data={"group": "dp0", "members": [0, 2, 9], "reporters": [0]})
    expect_rejected(scenario, subjects.job_event(JOB, "network.collective_timeout"), payload, "unknown_rank",
                    "ranks [9]")


def test_unknown_shard_in_a_checkpoint_is_rejected(scenario: Scenario) -> None:
    payload = raw(id="us-1", type="checkpoint.saved", job=JOB,
                  data={"step": 3, "tier": "storage", "shards": [0, 2], "holder": "storage"})
    expect_rejected(scenario, subjects.job_event(JOB, "checkpoint.saved"), payload, "schema_violation",
                    "shards [2] do not exist")


def test_scale_to_a_dp_that_does_not_fill_whole_nodes_is_rejected(scenario: Scenario) -> None:
    """The rejected dp used to stay behind as the job's target, and every later node.joined or node.ready then
    failed with this job's error (and its node changes were half applied)."""
    scenario.submit("job-e", ["e0"], ranks_per_node=2, dp=2, elastic={"min_dp": 1, "max_dp": 4})
    scenario.train("job-e", 2)
    payload = raw(id="sc-1", type="operator.scale", job="job-e", data={"dp": 3})
    expect_rejected(scenario, subjects.job_event("job-e", "operator.scale"), payload, "invalid_request",
                    "dp=3 needs 3 ranks, not a whole number of 2-rank nodes")
    effects = scenario.spare("s0")
    assert not [e for e in effects if isinstance(e, Rejection)], effects
    assert scenario.engine.cluster.free_spares() == ["s0"]
    assert scenario.state("job-e") == "running"


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\x9b"])
def test_a_control_character_in_the_event_id_is_a_schema_violation(scenario: Scenario, char: str) -> None:
    """An event id becomes a Nats-Msg-Id header and a line in every log: a NUL, an escape sequence or a C1 control
    has no place in it."""
    payload = step_event(JOB, 0, 9, f"ev{char}1")
    rejection = expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "schema_violation",
                                f"id: control character U+{ord(char):04X} at index 2 is not allowed")
    assert rejection.event_id == f"ev{char}1", "the rejection names the id it refused, as it came"


@pytest.mark.parametrize(("field", "value"), [("source", "agent\x00@a0"), ("time", "2026-01-01T00:00:00\x1b[2J")])
def test_a_control_character_in_the_envelope_is_a_schema_violation(scenario: Scenario, field: str,
                                                                   value: str) -> None:
    payload = raw(**{"id": "cc-1", "type": "progress.step", "job": JOB, "data": {"rank": 0, "step": 9}, field: value})
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "schema_violation",
                    f"{field}: control character U+")


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\x85"])
def test_a_control_character_in_a_job_or_node_id_is_refused(scenario: Scenario, char: str) -> None:
    """Job and node ids are subject tokens, so a control character in one is the token's error, as whitespace
    already was, and the reason names the field and the character."""
    payload = step_event(f"job{char}a", 0, 9, "cc-2")
    expect_rejected(scenario, subjects.job_event(JOB, "progress.step"), payload, "bad_subject_token",
                    "job: id", f"control character U+{ord(char):04X}")
    payload = raw(id="cc-3", type="node.not_ready", node=f"a0{char}", data={"reason": "x"})
    expect_rejected(scenario, subjects.node_event("a0", "node.not_ready"), payload, "bad_subject_token",
                    "node: id", f"control character U+{ord(char):04X}")


@pytest.mark.parametrize(("type_", "data", "reason"), [
    ("network.link_down", {"link": "mlx5\x000"}, "data.link: control character U+0000"),
    ("node.not_ready", {"reason": "gone\x1b]0;pwned\x07"}, "data.reason: control character U+001B"),
])
def test_a_control_character_in_a_node_event_is_a_schema_violation(scenario: Scenario, type_: str,
                                                                   data: dict[str, Any], reason: str) -> None:
    payload = raw(id="cc-4", type=type_, node="a0", data=data)
    expect_rejected(scenario, subjects.node_event("a0", type_), payload, "schema_violation", reason)


@pytest.mark.parametrize(("data", "reason"), [
    ({"rank": 0, "seconds_without_progress": "inf"}, "data.seconds_without_progress: Input should be a valid number"),
    ({"rank": 0, "seconds_without_progress": 1e300}, "data.seconds_without_progress: Input should be less than"),
    ({"rank": 0, "seconds_without_progress": True}, "not a boolean"),
])
def test_a_duration_that_is_not_a_finite_bounded_number_is_refused(scenario: Scenario, data: dict[str, Any],
                                                                   reason: str) -> None:
    payload = raw(id="du-1", type="process.hang", job=JOB, data=data)
    expect_rejected(scenario, subjects.job_event(JOB, "process.hang"), payload, "schema_violation", reason)


def submission(job: str, **spec: Any) -> bytes:
    base = {"nodes": ["c0"], "ranks_per_node": 2, "layout": {"dp": 2}}
    return raw(id=f"{job}-submitted", type="job.submitted", job=job, data={"spec": {**base, **spec}})


@pytest.mark.parametrize("interval", [1e-12, 0, 1e11, True, "2"])
def test_a_watchdog_interval_out_of_bounds_is_a_schema_violation(scenario: Scenario, interval: Any) -> None:
    """1e-12 s made a zero-period timer (ZeroDivisionError in the engine); 1e11 s a due time past 2^64 ns that no
    decision could carry."""
    expect_rejected(scenario, subjects.job_event("job-c", "job.submitted"),
                    submission("job-c", watchdog_interval_s=interval), "schema_violation",
                    "data.spec.watchdog_interval_s: ")
    assert "job-c" not in scenario.engine.jobs


@pytest.mark.parametrize(("policies", "field"), [
    ({"rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
        {"granularity": "in_place", "deadline_s": 1e11}]}}}}, "ladders.process.0.deadline_s"),
    ({"rescheduling": {"name": "ladder", "params": {"ladders": {"process": [
        {"granularity": "in_place", "deadline_s": 1e-12}]}}}}, "ladders.process.0.deadline_s"),
    ({"rescheduling": {"name": "ladder", "params": {"settle_s": 31 * 86400}}}, "settle_s"),
    ({"detection": {"name": "default", "params": {"link_debounce_s": 1e11}}}, "link_debounce_s"),
    ({"detection": {"name": "default", "params": {"hang_min_silence_s": 0}}}, "hang_min_silence_s"),
    ({"detection": {"name": "default", "params": {"frequency_threshold": True}}}, "frequency_threshold"),
    ({"checkpoint": {"name": "newest-complete", "params": {"peer": 1}}}, "peer"),
])
def test_policy_params_out_of_bounds_are_an_invalid_policy(scenario: Scenario, policies: dict[str, Any],
                                                           field: str) -> None:
    expect_rejected(scenario, subjects.job_event("job-c", "job.submitted"), submission("job-c", policies=policies),
                    "invalid_policy", "invalid parameters", field)
    assert "job-c" not in scenario.engine.jobs

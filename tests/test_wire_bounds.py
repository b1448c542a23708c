"""The wire is strict and bounded: no boolean where a number belongs, no NaN or infinity, no control character in an
id, every integer and duration within its documented bounds, and no schema-valid value the engine cannot carry
(a zero-period timer, a due time past 64 bits)."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from events import DecodeError, decode_envelope, decode_record_line, make_envelope
from events.codec import decode_envelope_checked
from events.commands import Command
from events.envelope import ALL_EVENTS, RECORD, Record
from events.kinds import JOB_EVENTS, NODE_EVENTS
from events.outputs import Decision, Rejection, TimerRequest
from events.schema import wire_schema
from events.subjects import MAX_TOKEN_LENGTH, job_event
from events.values import (
    MAX_DUE_NS,
    MAX_ID_LENGTH,
    MAX_LOG_TIME_NS,
    MAX_RANKS,
    MAX_SAFE_INT,
    MAX_SECONDS,
    MAX_WATCHDOG_S,
    MIN_INTERVAL_S,
    MIN_WATCHDOG_S,
    JobSpec,
    Layout,
)
from policies import registry
from policies.base import NS
from policies.detection import DefaultDetectionParams
from policies.rescheduling import LadderParams
from recovery.testing.scenario import Scenario

MAX_INT64 = 2**63 - 1
SPEC = {"nodes": ["n0", "n1"], "ranks_per_node": 2, "layout": {"dp": 4}}

SAMPLES: dict[str, dict[str, Any]] = {
    "device.fault": {"device": 1, "vendor": "nvidia", "code": "79", "ecc_sbe": 2, "ecc_dbe": 1},
    "device.recovered": {"device": 1},
    "process.started": {"rank": 3, "pid": 4242, "attempt": 1, "announces": True},
    "process.output": {"rank": 3, "attempt": 1},
    "process.capabilities": {"rank": 3, "attempt": 1, "caps": ["reform", "steps"]},
    "process.exited": {"rank": 3, "exit_code": 139, "signal": 11, "attempt": 1},
    "process.heartbeat": {"rank": 3, "step": 7, "attempt": 1},
    "process.hang": {"rank": 3, "seconds_without_progress": 42.5, "attempt": 1},
    "process.collective_failed": {"rank": 1, "step": 16, "attempt": 0, "operation": "allreduce", "timeout_s": 4.0,
                                  "error": "Timed out waiting 4000ms for recv operation to complete"},
    "progress.step": {"rank": 3, "step": 7, "attempt": 1},
    "process.stacks": {"ranks": [{"rank": 3, "pid": 4242, "stack": "Thread 1 (idle)\n    wait (x.py:3)"},
                                 {"rank": 2, "error": "py-spy: permission denied"}], "command_id": "j:7:1",
                       "tool": "py-spy"},
    "progress.report": {"ranks": [{"rank": 3, "step": 7, "attempt": 1}, {"rank": 2, "step": None, "attempt": 1}]},
    "progress.summary": {"ranks": [{"rank": 3, "step": 7, "attempt": 1, "heard_s": 0.5, "compute_s": 0.25,
                                    "compute_steps": 4}], "period_s": 10.0},
    "network.link_down": {"link": "mlx5_0", "switch": "leaf-3"},
    "network.link_up": {"link": "mlx5_0"},
    "network.nic_errors": {"link": "mlx5_0", "errors": 120},
    "network.collective_timeout": {"group": "dp0", "members": [0, 2], "reporters": [0], "timeout_s": 600.0,
                                   "attempt": 1},
    "node.not_ready": {"reason": "kubelet stopped posting status"},
    "node.ready": {},
    "node.drained": {"reason": "maintenance"},
    "node.joined": {"spare": True, "devices": 8},
    "node.heartbeat": {"interval_s": 1.0},
    "node.silent": {"silent_s": 3.2, "bound_s": 3.0},
    "node.heard": {"silent_s": 4.1},
    "node.unreachable": {"cause": "rank 2 of j (n1) lost a peer's connection", "confirm_s": 0.2},
    "node.checked": {"when": "start", "job": "j",
                     "results": [{"check": "disk:/ckpt", "ok": False, "saw": "0.2 GiB free", "took_s": 0.01}]},
    "job.submitted": {"spec": {**SPEC, "spares": 1, "max_restarts": 3, "watchdog_interval_s": 2.0,
                               "elastic": {"min_dp": 2, "max_dp": 4}}},
    "job.started": {},
    "job.completed": {},
    "job.cancelled": {"reason": "done"},
    "job.unserved": {"nodes": ["n1"], "waited_s": 30.0},
    "control.outage": {"away_s": 90.0, "bound_s": 300.0},
    "checkpoint.saved": {"step": 7, "tier": "memory", "shards": [0, 1], "holder": "n0"},
    "checkpoint.failed": {"step": 7, "tier": "storage", "reason": "EIO"},
    "command.ack": {"command_id": "j:12:0", "status": "done", "reason": ""},
    "timer.fired": {"timer_id": "j/watchdog/3", "due": 1_767_225_600 * NS},
    "policy.overran": {"seq": 42, "family": "rescheduling", "method": "decide", "call": 0, "policy": "my-plugin@1",
                       "budget_s": 2.0},
    "operator.scale": {"dp": 2},
    "operator.pause": {"reason": "investigating"},
    "operator.resume": {},
    "operator.cancel": {"reason": "budget"},
    "operator.force": {"granularity": "restart_job", "reason": "operator"},
    "operator.release": {"node": "n0", "device": 3, "reason": "replaced the GPU"},
}


def envelope(type_: str, data: dict[str, Any], **fields: Any) -> dict[str, Any]:
    scope = {"job": "j"} if type_ in JOB_EVENTS else {"node": "n0"}
    return {"id": "e-1", "type": type_, **scope, "source": "test", "data": data, **fields}


def decode(obj: dict[str, Any]) -> Any:
    return decode_envelope(orjson.dumps(obj))


def numeric_paths(schema: dict[str, Any], defs: dict[str, Any], data: Any, path: tuple[Any, ...] = ()
                  ) -> list[tuple[tuple[Any, ...], str]]:
    """Every number in `data` that the JSON Schema types as integer or number, with its path and type."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    found: list[tuple[tuple[Any, ...], str]] = []
    for option in schema.get("anyOf", []):
        if option.get("type") in ("integer", "number") and isinstance(data, int | float):
            return [(path, option["type"])]
        if option.get("type") != "null" and data is not None:
            found += numeric_paths(option, defs, data, path)
    if schema.get("type") in ("integer", "number") and isinstance(data, int | float) and not isinstance(data, bool):
        return [(path, schema["type"])]
    if schema.get("type") == "object" and isinstance(data, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in data:
                found += numeric_paths(sub, defs, data[key], (*path, key))
    if schema.get("type") == "array" and isinstance(data, list) and data:
        found += numeric_paths(schema["items"], defs, data[0], (*path, 0))
    return found


def replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = list(data) if isinstance(data, list) else dict(data)
    copy[path[0]] = replaced(data[path[0]], path[1:], value)
    return copy


def sample_numbers() -> list[tuple[str, tuple[Any, ...], str]]:
    out = []
    for type_, data in SAMPLES.items():
        model: type[BaseModel] = ALL_EVENTS[type_]
        schema = model.model_json_schema()
        out += [(type_, path, kind) for path, kind in numeric_paths(schema, schema.get("$defs", {}), data)]
    return out


NUMBERS = sample_numbers()


def test_every_input_type_has_a_valid_sample() -> None:
    assert set(SAMPLES) == set(JOB_EVENTS) | set(NODE_EVENTS)
    for type_, data in SAMPLES.items():
        decoded = decode(envelope(type_, data))
        assert not isinstance(decoded, DecodeError), (type_, decoded)
    # The samples reach the fields this test is about: ranks, steps, devices, attempts, degrees, durations.
    names = {path[-1] for _, path, _ in NUMBERS if isinstance(path[-1], str)}
    assert {"rank", "step", "device", "attempt", "pid", "dp", "devices", "due", "watchdog_interval_s",
            "timeout_s", "seconds_without_progress", "min_dp", "ranks_per_node"} <= names


@pytest.mark.parametrize(("type_", "path", "kind"), NUMBERS, ids=lambda v: ".".join(map(str, v)) if
                         isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("flag", [True, False])
def test_a_boolean_is_not_a_number(type_: str, path: tuple[Any, ...], kind: str, flag: bool) -> None:
    decoded = decode(envelope(type_, replaced(SAMPLES[type_], path, flag)))
    assert isinstance(decoded, DecodeError) and decoded.code == "schema_violation", decoded
    where = ".".join(map(str, ("data", *path)))
    assert f"{where}: Input should be a valid" in decoded.reason and "not a boolean" in decoded.reason, decoded


@pytest.mark.parametrize(("type_", "path", "kind"), NUMBERS, ids=lambda v: ".".join(map(str, v)) if
                         isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("text", ["1", "inf", "NaN", "-Infinity"])
def test_a_string_is_not_a_number(type_: str, path: tuple[Any, ...], kind: str, text: str) -> None:
    decoded = decode(envelope(type_, replaced(SAMPLES[type_], path, text)))
    assert isinstance(decoded, DecodeError) and decoded.code == "schema_violation", decoded


@pytest.mark.parametrize(("type_", "path", "kind"), [n for n in NUMBERS if n[2] == "integer"],
                         ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_an_integer_field_takes_no_float(type_: str, path: tuple[Any, ...], kind: str) -> None:
    decoded = decode(envelope(type_, replaced(SAMPLES[type_], path, 2.0)))
    assert isinstance(decoded, DecodeError) and decoded.code == "schema_violation", decoded


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("type_", "field"), [("process.hang", "seconds_without_progress"),
                                              ("network.collective_timeout", "timeout_s")])
def test_nan_and_infinity_are_refused(type_: str, field: str, value: float) -> None:
    """orjson never parses NaN, but a producer in Python can build one, and pydantic's own JSON parser (used for log
    lines) reads `NaN` and `Infinity`: the models refuse them either way."""
    with pytest.raises(ValidationError, match=r"finite number|less than or equal|greater than or equal"):
        make_envelope(type_, {**SAMPLES[type_], field: value}, id="e-1", job="j")
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = orjson.dumps(envelope(type_, {**SAMPLES[type_], field: 1.5})).decode().replace("1.5", literal)
        line = f'{{"seq":1,"ts":5,"subject":"{job_event("j", type_)}","headers":{{}},"envelope":{body}}}'
        with pytest.raises(ValidationError):
            RECORD.validate_json(line)
        with pytest.raises(ValueError, match="not a JSON log line"):
            decode_record_line(line.encode())  # the whole line is corrupt: not even a raw record


@pytest.mark.parametrize("value", [math.nan, math.inf, "inf", True, 0, 1e-12, MIN_WATCHDOG_S / 2,
                                   MAX_WATCHDOG_S * 1.01, 1e11])
def test_a_watchdog_interval_out_of_bounds_is_refused(value: Any) -> None:
    with pytest.raises(ValidationError, match="watchdog_interval_s"):
        JobSpec.model_validate({**SPEC, "watchdog_interval_s": value})


@pytest.mark.parametrize("value", [MIN_WATCHDOG_S, 2, 2.0, MAX_WATCHDOG_S])
def test_a_watchdog_interval_within_bounds_is_accepted(value: float) -> None:
    assert JobSpec.model_validate({**SPEC, "watchdog_interval_s": value}).watchdog_interval_s == value


@pytest.mark.parametrize(("params", "field"), [
    ({"ladders": {"process": [{"granularity": "in_place", "deadline_s": 0}]}}, "deadline_s"),
    ({"ladders": {"process": [{"granularity": "in_place", "deadline_s": 1e-12}]}}, "deadline_s"),
    ({"ladders": {"process": [{"granularity": "in_place", "deadline_s": MAX_SECONDS + 1}]}}, "deadline_s"),
    ({"ladders": {"process": [{"granularity": "in_place", "deadline_s": 1e11}]}}, "deadline_s"),
    ({"ladders": {"process": [{"granularity": "in_place", "budget": True}]}}, "budget"),
    ({"ladders": {"process": [{"granularity": "in_place", "tries": 1.0}]}}, "tries"),
    ({"settle_s": -1}, "settle_s"),
    ({"settle_s": 1e9}, "settle_s"),
    ({"elastic": 1}, "elastic"),
    ({"wait": "yes"}, "wait"),
])
def test_ladder_params_out_of_bounds_are_invalid(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        LadderParams.model_validate(params)
    with pytest.raises(registry.PolicyError, match=f"(?s)invalid parameters.*{field}"):
        registry.load(registry.PolicyRef(name="ladder", params=params), "rescheduling")


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_window_s", 0), ("frequency_window_s", MAX_SECONDS * 2), ("link_debounce_s", -0.5),
    ("link_debounce_s", 1e12), ("not_ready_grace_s", 1e300), ("hang_min_silence_s", 1e-9),
    ("hang_min_silence_s", math.inf), ("stall_min_s", math.nan), ("stall_factor", 0), ("stall_factor", 1e6),
    ("hang_silence_factor", math.inf), ("frequency_threshold", True), ("nic_error_threshold", 0),
])
def test_detection_params_out_of_bounds_are_invalid(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        DefaultDetectionParams.model_validate({field: value})


def test_policy_params_at_their_bounds_are_valid() -> None:
    LadderParams.model_validate({"settle_s": 0, "ladders": {"process": [
        {"granularity": "in_place", "deadline_s": MIN_INTERVAL_S},
        {"granularity": "migrate", "deadline_s": 30 * 86400}]}})
    DefaultDetectionParams.model_validate({"link_debounce_s": 0, "frequency_window_s": MAX_SECONDS,
                                           "hang_min_silence_s": MIN_INTERVAL_S, "stall_factor": 1000})


@pytest.mark.parametrize("layout", [{"dp": MAX_RANKS + 1}, {"dp": 1024, "tp": 1024, "pp": 2}])
def test_a_job_beyond_the_rank_bound_is_refused(layout: dict[str, int]) -> None:
    with pytest.raises(ValidationError, match=r"exceeds|less than or equal"):
        Layout.model_validate(layout)


def test_an_elastic_job_that_could_scale_beyond_the_rank_bound_is_refused() -> None:
    spec = {"nodes": ["n0"], "ranks_per_node": 8, "layout": {"dp": 1, "tp": 8},
            "elastic": {"min_dp": 1, "max_dp": MAX_RANKS}}
    with pytest.raises(ValidationError, match="max_dp"):
        JobSpec.model_validate(spec)


@pytest.mark.parametrize(("field", "value"), [("seq", 0), ("seq", MAX_SAFE_INT + 1), ("seq", True),
                                              ("ts", -1), ("ts", MAX_LOG_TIME_NS + 1), ("ts", 5.0), ("ts", True)])
def test_record_framing_is_bounded(field: str, value: Any) -> None:
    env = make_envelope("job.started", {}, id="e1", job="j")
    fields = {"seq": 1, "ts": 5, "subject": job_event("j", "job.started"), "envelope": env, field: value}
    with pytest.raises(ValidationError, match=field):
        Record.model_validate(fields)


def test_a_boolean_schema_version_is_not_upcast() -> None:
    """`true` is a Python int: it used to be read as version 1 and upcast."""
    decoded = decode({"id": "x", "type": "device.fault", "node": "n0", "schema": True,
                      "data": {"device": 0, "xid": 79}})
    assert isinstance(decoded, DecodeError) and decoded.code == "schema_violation", decoded
    assert "schema: Input should be a valid integer, not a boolean" in decoded.reason


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\x7f", "\x85", "\x9b"])
@pytest.mark.parametrize(("type_", "field"), [("network.link_down", "link"), ("network.link_down", "switch"),
                                              ("network.collective_timeout", "group"),
                                              ("command.ack", "command_id"), ("timer.fired", "timer_id"),
                                              ("device.fault", "code"), ("device.fault", "message"),
                                              ("node.not_ready", "reason")])
def test_a_control_character_in_a_payload_string_is_refused(type_: str, field: str, char: str) -> None:
    decoded = decode(envelope(type_, {**SAMPLES[type_], field: f"a{char}b"}))
    assert isinstance(decoded, DecodeError) and decoded.code == "schema_violation", decoded
    assert f"data.{field}: control character U+{ord(char):04X} at index 1 is not allowed" in decoded.reason


@pytest.mark.parametrize("text", ["line one\nline two", "tab\tseparated", "crlf\r\n", "ünïcode ✓"])
def test_free_text_keeps_tabs_and_line_breaks(text: str) -> None:
    decoded = decode(envelope("node.not_ready", {"reason": text}))
    assert not isinstance(decoded, DecodeError), decoded


def test_the_longest_ids_still_make_a_timer_fired_envelope() -> None:
    """The daemon's timer service names a firing `timer:<timer id>:<due>`: with a job, a node and a link of the
    longest allowed names the envelope id must still be valid, or the timer could never fire."""
    job, node = "j" * MAX_TOKEN_LENGTH, "n" * MAX_TOKEN_LENGTH
    s = Scenario(start_ns=MAX_LOG_TIME_NS - 3600 * NS)
    s.submit(job, [node], ranks_per_node=2, dp=2)
    s.job_event(job, "process.exited", rank=0, exit_code=1)
    s.node_event(node, "network.link_down", link="l" * 128)
    timers = [t for d in s.decisions for t in d.timers]
    assert {t.id.split("/")[1] for t in timers} >= {"watchdog", "confirm", "attempt", "ack"}
    for timer in timers:
        daemon_id = f"timer:{timer.id}:{timer.due}"  # as recovery.service.daemon's timer service names it
        assert len(daemon_id) <= MAX_ID_LENGTH
        make_envelope("timer.fired", {"timer_id": timer.id, "due": timer.due}, id=daemon_id, job=job)
    assert not s.rejections


COMMAND = {"kind": "stop_ranks", "id": "j:3:0", "job": "j", "attempt": 1, "deadline_s": 60, "ranks": [0, 1],
           "grace_s": 30}


@pytest.mark.parametrize(("field", "value"), [
    ("attempt", True), ("deadline_s", True), ("deadline_s", 0), ("deadline_s", 1e11), ("deadline_s", math.inf),
    ("grace_s", -1), ("grace_s", math.nan), ("ranks", [0, True]), ("ranks", [MAX_RANKS]), ("id", "j:3\x000"),
])
def test_commands_are_strict_and_bounded(field: str, value: Any) -> None:
    """Executors validate the commands they receive with the same models: what the engine sends is as strict."""
    adapter = TypeAdapter(Command)
    adapter.validate_python(COMMAND)
    with pytest.raises(ValidationError, match=field):
        adapter.validate_python({**COMMAND, field: value})


def test_outputs_refuse_booleans_but_keep_what_a_rejection_repeats() -> None:
    with pytest.raises(ValidationError, match="cause_seq"):
        Decision(job="j", cause_seq=True, index=0, kind="k", previous="a", state="b")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="due"):
        TimerRequest(id="t", due=True)  # type: ignore[arg-type]
    # A rejection names the id it refused as it came, control characters and all: it must always be writable.
    rejection = Rejection(seq=1, subject="s", code="schema_violation", reason="r", event_id="a\x00b", job="j\x1b")
    written = make_envelope("rejection", rejection, id="rej:1", source="recovery-engine")
    assert written.data == rejection


def test_the_exported_schema_states_the_bounds() -> None:
    schema = wire_schema()
    defs = schema["envelope"]["$defs"]
    watchdog = defs["JobSpec"]["properties"]["watchdog_interval_s"]
    assert (watchdog["minimum"], watchdog["maximum"]) == (MIN_WATCHDOG_S, MAX_WATCHDOG_S)
    assert defs["Heartbeat"]["properties"]["rank"]["maximum"] == MAX_RANKS - 1
    assert defs["TimerFired"]["properties"]["due"]["maximum"] == MAX_DUE_NS
    assert schema["record"]["properties"]["ts"]["maximum"] == MAX_LOG_TIME_NS
    assert "\\x00-\\x1f\\x7f-\\x9f" in defs["LinkDown"]["properties"]["link"]["pattern"]
    command = TypeAdapter(Command).json_schema()
    assert command["$defs"]["StopRanks"]["properties"]["grace_s"]["maximum"] == MAX_SECONDS


# --- property: nothing derived from a valid spec and a valid log time overflows 63 bits ---------------------------
EXTREME_WATCHDOG = st.sampled_from([MIN_WATCHDOG_S, MAX_WATCHDOG_S, math.nextafter(MAX_WATCHDOG_S, 0)])
EXTREME_INTERVAL = st.sampled_from([MIN_INTERVAL_S, MAX_SECONDS, math.nextafter(MAX_SECONDS, 0)])
EXTREME_SECONDS = st.sampled_from([0.0, 5e-324, MIN_INTERVAL_S, MAX_SECONDS])


def durations(low: float, high: float, extremes: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    return extremes | st.floats(low, high, allow_nan=False, allow_infinity=False)


@st.composite
def job_specs(draw: st.DrawFn) -> dict[str, Any]:
    """A schema-valid job spec with every duration (its own and its policies') drawn from the bounds."""
    rpn = draw(st.sampled_from([1, 2, 8, 1024]))
    nodes = draw(st.integers(1, 4))
    interval = st.one_of(durations(MIN_INTERVAL_S, MAX_SECONDS, EXTREME_INTERVAL), st.integers(1, 2_592_000))
    seconds = durations(0.0, MAX_SECONDS, EXTREME_SECONDS)
    rung = st.fixed_dictionaries({"granularity": st.sampled_from(["in_place", "migrate", "restart_job"]),
                                  "deadline_s": interval})
    return {
        "nodes": [f"n{i}" for i in range(nodes)], "ranks_per_node": rpn, "layout": {"dp": nodes * rpn},
        "watchdog_interval_s": draw(durations(MIN_WATCHDOG_S, MAX_WATCHDOG_S, EXTREME_WATCHDOG)),
        "policies": {
            "detection": {"name": "default", "params": {
                "frequency_window_s": draw(interval), "link_debounce_s": draw(seconds),
                "not_ready_grace_s": draw(seconds), "hang_min_silence_s": draw(interval),
                "stall_min_s": draw(interval)}},
            "rescheduling": {"name": "ladder", "params": {
                "settle_s": draw(seconds),
                "ladders": {"process": draw(st.lists(rung, min_size=1, max_size=3))}}},
        },
    }


def spec_durations(spec: JobSpec) -> list[float]:
    """Every duration of a job: its watchdog interval and its policies' parameters, as the policies read them."""
    detection = DefaultDetectionParams.model_validate(spec.policies.detection.params)
    ladder = LadderParams.model_validate(spec.policies.rescheduling.params)
    return [spec.watchdog_interval_s, detection.frequency_window_s, detection.link_debounce_s,
            detection.not_ready_grace_s, detection.hang_min_silence_s, detection.stall_min_s, ladder.settle_s,
            *(rung.deadline_s for rungs in ladder.ladders.values() for rung in rungs)]


LOG_TIMES = st.sampled_from([0, 1_767_225_600 * NS, MAX_LOG_TIME_NS]) | st.integers(0, MAX_LOG_TIME_NS)


@settings(max_examples=300, deadline=None)
@given(raw=job_specs(), ts=LOG_TIMES)
def test_no_duration_of_a_valid_spec_overflows_a_valid_log_time(raw: dict[str, Any], ts: int) -> None:
    spec = JobSpec.model_validate(raw)
    registry.load_set(spec.policies)  # the policies accept their parameters: the submission would be accepted
    for seconds in spec_durations(spec):
        after = int(seconds * NS)
        assert after >= 0
        assert ts + after <= MAX_INT64
        assert ts + after <= MAX_DUE_NS  # and the timer.fired event that comes back is valid
    assert int(spec.watchdog_interval_s * NS) > 0, "a periodic timer with a zero period"


@settings(max_examples=25, deadline=None)
@given(raw=job_specs(), ts=st.sampled_from([MAX_LOG_TIME_NS - 10 * NS, MAX_LOG_TIME_NS - 3600 * NS]))
def test_the_engine_derives_only_encodable_due_times_at_the_end_of_log_time(raw: dict[str, Any], ts: int) -> None:
    """End to end at the last valid log times: a job with extreme durations is accepted and started, loses a rank,
    and every timer it asks for is due within 63 bits and comes back as a valid timer.fired event."""
    raw = {**raw, "nodes": raw["nodes"][:1], "ranks_per_node": 2, "layout": {"dp": 2}}
    s = Scenario(start_ns=ts)
    s.submit("j", raw["nodes"], ranks_per_node=2, dp=2, watchdog_interval_s=raw["watchdog_interval_s"],
             policies=raw["policies"])
    s.job_event("j", "process.exited", rank=1, exit_code=1)
    assert not s.rejections, s.rejections
    timers = [t for d in s.decisions for t in d.timers]
    assert timers
    for timer in timers:
        assert 0 <= timer.due <= MAX_INT64
        assert timer.every is None or 0 < timer.every <= MAX_INT64
        make_envelope("timer.fired", {"timer_id": timer.id, "due": timer.due}, id=f"timer:{timer.id}:{timer.due}",
                      job="j")


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
    st.sampled_from(["NaN", "Infinity", "1e999", "\x00", "j/k", "a.b", "", "*", ">"]),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3), st.just({"x": 1}),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A valid sample of some input type, then perhaps one field of its data, or of the envelope, replaced by an
    odd value, its schema version dropped or made old, an unknown key added, or a raw NaN spliced in."""
    type_ = draw(st.sampled_from(sorted(SAMPLES)))
    data = dict(SAMPLES[type_])
    obj = envelope(type_, data, schema=draw(st.sampled_from([None, 0, 1, 2, 3])))
    if obj["schema"] is None:
        del obj["schema"]
    where = draw(st.sampled_from(["none", "data", "envelope", "extra"]))
    if where == "data" and data:
        data[draw(st.sampled_from(sorted(data)))] = draw(ODD_VALUES)
    elif where == "envelope":
        obj[draw(st.sampled_from(["id", "type", "job", "node", "source", "time", "schema"]))] = draw(ODD_VALUES)
    elif where == "extra":
        obj["extra" if draw(st.booleans()) else "data"] = {**data, "unexpected": 1}
    raw = json.dumps(obj, separators=(",", ":")).encode()  # the standard library writes integers of any size
    if draw(st.booleans()) and data:
        key = json.dumps(sorted(data)[0]).encode() + b":"
        raw = raw.replace(key, key + b'NaN,"_":', 1)
    return raw


@settings(max_examples=400, deadline=None)
@given(payloads())
def test_the_one_pass_decoding_agrees_with_the_checked_path_on_any_payload(payload: bytes) -> None:
    """`decode_envelope` validates a current envelope straight from its JSON; whatever it accepts or refuses must
    be exactly what parsing, upcasting and validating separately decides, or a daemon and a replay could differ."""
    assert decode_envelope(payload) == decode_envelope_checked(payload)

"""The vocabulary: envelopes, the codec, upcasting, subjects."""

from __future__ import annotations

import orjson
import pytest
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from events import DecodeError, decode_envelope, decode_record_line, encode_envelope, encode_record, make_envelope
from events.envelope import Record
from events.kinds import DeviceFault, Heartbeat
from events.subjects import Token, check_token, job_event, node_event


def test_envelope_round_trips_through_the_codec() -> None:
    env = make_envelope("process.heartbeat", {"rank": 3, "step": 7}, id="e1", job="j1", source="agent@n1")
    back = decode_envelope(encode_envelope(env))
    assert not isinstance(back, DecodeError)
    assert back == env
    assert isinstance(back.data, Heartbeat)


def test_discriminated_union_picks_the_payload_model_from_type() -> None:
    env = decode_envelope(orjson.dumps({"id": "x", "type": "device.fault", "node": "n1", "schema": 2,
                                        "data": {"device": 0, "vendor": "ascend", "code": "0x80E01801"}}))
    assert isinstance(env, DeviceFault.__class__) or isinstance(env.data, DeviceFault)  # type: ignore[union-attr]


def test_device_fault_v1_is_upcast_to_v2() -> None:
    old = {"id": "x", "type": "device.fault", "node": "n1", "schema": 1, "data": {"device": 3, "xid": 79}}
    env = decode_envelope(orjson.dumps(old))
    assert not isinstance(env, DecodeError)
    assert env.schema_ == 2
    assert env.data == DeviceFault(device=3, vendor="nvidia", code="79")


def test_unsupported_future_schema_is_rejected_clearly() -> None:
    env = decode_envelope(orjson.dumps({"id": "x", "type": "node.ready", "node": "n1", "schema": 9, "data": {}}))
    assert isinstance(env, DecodeError) and env.code == "schema_violation" and "schema 9" in env.reason


@pytest.mark.parametrize("bad", ["a.b", "a*", "a>", "a b", "a\tb", ""])
def test_ids_that_break_subject_tokens_are_rejected(bad: str) -> None:
    env = decode_envelope(orjson.dumps({"id": "x", "type": "job.started", "job": bad, "data": {}}))
    assert isinstance(env, DecodeError) and env.code == "bad_subject_token"


def test_log_line_round_trip_and_undecodable_payload_survives_as_raw() -> None:
    env = make_envelope("job.started", {}, id="e1", job="j1")
    record = Record(seq=1, ts=5, subject=job_event("j1", "job.started"), headers={"Nats-Msg-Id": "e1"}, envelope=env)
    assert decode_record_line(encode_record(record)) == record
    raw = decode_record_line(b'{"seq":2,"ts":6,"subject":"recovery.ev.job.j1.job.started","headers":{},"raw":"{oops"}')
    assert raw.seq == 2 and getattr(raw, "data", None) == b"{oops"


def test_subjects_put_the_id_in_one_token() -> None:
    assert job_event("j1", "process.exited") == "recovery.ev.job.j1.process.exited"
    assert node_event("n7", "device.fault") == "recovery.ev.node.n7.device.fault"


def test_the_token_pattern_and_check_token_agree_on_every_character() -> None:
    """pydantic-core checks the pattern (Rust regex), `check_token` explains a failure (Python re): a character one
    refuses and the other accepts would get no readable reason, or slip through. Whitespace ends at U+3000."""
    adapter = TypeAdapter(Token)
    for code in [*range(0x3001), 0xFEFF, 0x10FFFF]:
        value = f"a{chr(code)}b"
        try:
            check_token(value)
            python_ok = True
        except PydanticCustomError:
            python_ok = False
        try:
            adapter.validate_python(value)
            rust_ok = True
        except ValidationError:
            rust_ok = False
        assert python_ok == rust_ok, f"U+{code:04X}: check_token {python_ok}, pattern {rust_ok}"
        if code < 0x20 or 0x7F <= code <= 0x9F:
            assert not rust_ok, f"control character U+{code:04X} accepted in a token"


@pytest.mark.parametrize("bad", ["a\x00", "\x1b[2J", "a\x7f", "a\x9b"])
def test_control_characters_in_ids_are_rejected_as_tokens(bad: str) -> None:
    env = decode_envelope(orjson.dumps({"id": "x", "type": "job.started", "job": bad, "data": {}}))
    assert isinstance(env, DecodeError) and env.code == "bad_subject_token" and "control character U+" in env.reason

"""The vocabulary: envelopes, the codec, upcasting, subjects."""

from __future__ import annotations

import orjson
import pytest

from events import DecodeError, decode_envelope, decode_record_line, encode_envelope, encode_record, make_envelope
from events.envelope import Record
from events.kinds import DeviceFault, Heartbeat
from events.subjects import job_event, node_event


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

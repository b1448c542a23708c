"""The orjson codec: envelopes and log records to bytes and back, with upcasting of old schema versions.

Decoding never raises on bad input: it returns a `DecodeError` with a reason code and a readable reason,
which the engine turns into a rejection and the daemon into a dead-letter record.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from events.envelope import (
    ALL_EVENTS,
    ENVELOPE,
    MAX_PAYLOAD_BYTES,
    RECORD,
    SCHEMA_VERSIONS,
    EnvelopeBase,
    RawRecord,
    Record,
)
from events.subjects import CONTROL_CHARS, TOKEN_PATTERN, check_token
from events.values import NO_CONTROL_PATTERN, TEXT_CONTROL_CHARS, TEXT_PATTERN

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def _device_fault_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    # v1 was NVIDIA-only: {"device", "xid"}; v2 names the vendor and keeps the code as a string so
    # that Ascend's hexadecimal fault codes fit the same field.
    out = {k: v for k, v in data.items() if k != "xid"}
    out["vendor"] = "nvidia"
    out["code"] = str(data.get("xid", ""))
    return out


def _job_submitted_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    # v1 accepted `spec.spares` and never read it; v2 reads it as the job's quota of the shared spare pool. A v1 log
    # must replay as it ran, with no quota: the field goes (v2's default, null, is "as many as are free").
    spec = data.get("spec")
    if not isinstance(spec, dict):
        return data
    return {**data, "spec": {k: v for k, v in spec.items() if k != "spares"}}


UPCASTERS: dict[tuple[str, int], Upcaster] = {("device.fault", 1): _device_fault_v1_to_v2,
                                              ("job.submitted", 1): _job_submitted_v1_to_v2}
"""(type, from_version) -> function turning that version's `data` into the next version's."""


@dataclass(frozen=True, slots=True)
class DecodeError:
    code: str
    reason: str
    event_id: str | None = None
    job: str | None = None
    node: str | None = None


def dumps(model: BaseModel) -> bytes:
    return orjson.dumps(model.model_dump(mode="json", by_alias=True, exclude_defaults=False))


def encode_envelope(envelope: EnvelopeBase) -> bytes:
    return orjson.dumps(envelope.model_dump(mode="json", by_alias=True))


def encode_record(record: Record | RawRecord) -> bytes:
    """One JSONL line (without newline) in the export format: seq, ts, subject, headers, envelope."""
    head = {"seq": record.seq, "ts": record.ts, "subject": record.subject, "headers": record.headers}
    if isinstance(record, Record):
        head["envelope"] = record.envelope.model_dump(mode="json", by_alias=True)
    else:
        # Undecodable input is kept as received, so a replay rejects it exactly as the daemon did:
        # as text when it is UTF-8, else in base64 (JSON cannot carry arbitrary bytes).
        try:
            head["raw"] = record.data.decode("utf-8")
        except UnicodeDecodeError:
            head["raw_b64"] = base64.b64encode(record.data).decode("ascii")
    return orjson.dumps(head)


def decode_record_line(line: bytes) -> Record | RawRecord:
    """Parse an export line. A line whose envelope is invalid comes back as a RawRecord for the engine
    to reject; a line whose framing (seq, ts, subject) is broken raises ValueError: the file is corrupt."""
    try:
        record = RECORD.validate_json(line)
        if record.envelope.schema_ == SCHEMA_VERSIONS[record.envelope.type]:
            return record
    except ValidationError:
        pass
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not a JSON log line: {exc}") from exc
    if not isinstance(obj, dict) or not {"seq", "ts", "subject"} <= obj.keys():
        raise ValueError("log line lacks seq, ts or subject")
    if "raw" in obj:
        payload = str(obj["raw"]).encode("utf-8")
    elif "raw_b64" in obj:
        try:
            payload = base64.b64decode(str(obj["raw_b64"]), validate=True)
        except ValueError as exc:
            raise ValueError(f"raw_b64 is not base64: {exc}") from exc
    else:
        payload = orjson.dumps(obj.get("envelope"))
    return RawRecord(seq=obj["seq"], ts=obj["ts"], subject=obj["subject"],
                     headers=obj.get("headers") or {}, data=payload)


def upcast(obj: dict[str, Any]) -> dict[str, Any]:
    """Bring an envelope dict up to the current schema version of its type."""
    type_ = obj.get("type")
    version = obj.get("schema")
    # A JSON `true` is a Python int: it must reach validation (and be refused there), not be upcast as version 1.
    if not isinstance(type_, str) or type(version) is not int or type_ not in SCHEMA_VERSIONS:
        return obj  # no version given means the current one; a bad one is left for validation to report
    current = SCHEMA_VERSIONS[type_]
    if version >= current:
        return obj
    data = obj.get("data")
    if not isinstance(data, dict):
        return obj
    while version < current:
        step = UPCASTERS.get((type_, version))
        if step is None:
            break  # validation will report the version mismatch
        data = step(data)
        version += 1
    return {**obj, "data": data, "schema": version}


def decode_envelope(payload: bytes) -> EnvelopeBase | DecodeError:
    if len(payload) > MAX_PAYLOAD_BYTES:
        return DecodeError("oversized", f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    # The common case in one pass: a current-version envelope validated straight from its JSON, as a replay reads
    # a log line. Anything else (an old version to upcast, no version, invalid input) takes the path below, which
    # alone decides what is refused and says why; so does JSON that only pydantic's parser accepts (NaN, Infinity).
    if b"NaN" not in payload and b"Infinity" not in payload:
        try:
            envelope: EnvelopeBase = ENVELOPE.validate_json(payload)
        except ValidationError:
            pass
        else:
            if envelope.schema_ == SCHEMA_VERSIONS[envelope.type]:
                return envelope
    return decode_envelope_checked(payload)


def decode_envelope_checked(payload: bytes) -> EnvelopeBase | DecodeError:
    """`decode_envelope` without its one-pass shortcut: parse, upcast, validate, and say what is wrong."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        return DecodeError("oversized", f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        return DecodeError("malformed_json", f"payload is not JSON: {exc}")
    if not isinstance(obj, dict):
        return DecodeError("malformed_json", f"payload is a JSON {type(obj).__name__}, not an object")
    return validate_envelope(upcast(obj))


def validate_envelope(obj: dict[str, Any]) -> EnvelopeBase | DecodeError:
    ident = obj.get("id") if isinstance(obj.get("id"), str) else None
    job = obj.get("job") if isinstance(obj.get("job"), str) else None
    node = obj.get("node") if isinstance(obj.get("node"), str) else None
    type_ = obj.get("type")
    if not isinstance(type_, str) or type_ not in ALL_EVENTS:
        return DecodeError("unknown_type", f"unknown event type {type_!r}", ident, job, node)
    if "schema" not in obj:
        obj = {**obj, "schema": SCHEMA_VERSIONS[type_]}  # an unversioned producer speaks the current one
    try:
        envelope: EnvelopeBase = ENVELOPE.validate_python(obj)
    except ValidationError as exc:
        return _explain(exc, ident, job, node)
    if envelope.schema_ != SCHEMA_VERSIONS[type_]:
        return DecodeError("schema_violation",
                           f"{type_} schema {envelope.schema_} is not supported (current is "
                           f"{SCHEMA_VERSIONS[type_]})", ident, job, node)
    return envelope


def _token_error(err: Any) -> str | None:
    """The `subject_token` message for an id that failed the Token pattern, else None."""
    if err["type"] != "string_pattern_mismatch" or err.get("ctx", {}).get("pattern") != TOKEN_PATTERN:
        return None
    try:
        check_token(err["input"])
    except PydanticCustomError as exc:
        return exc.message()
    return None


_FORBIDDEN = {
    NO_CONTROL_PATTERN: re.compile(f"[{CONTROL_CHARS}]"),
    TEXT_PATTERN: re.compile(f"[{TEXT_CONTROL_CHARS}]"),
}
"""the character class each string pattern of events.values refuses, to say which character broke it"""


def _message(err: Any) -> str:
    """pydantic's message, said plainly where it would not be: which control character an id held (rather than
    the pattern it failed), and that a boolean is not a number. Only ever runs on input already refused."""
    if err["type"] == "string_pattern_mismatch":
        forbidden = _FORBIDDEN.get(err.get("ctx", {}).get("pattern"))
        bad = forbidden.search(err["input"]) if forbidden is not None and isinstance(err["input"], str) else None
        if bad is not None:
            return f"control character U+{ord(bad.group()):04X} at index {bad.start()} is not allowed"
    if err["type"] in ("int_type", "float_type") and isinstance(err["input"], bool):
        return f"{err['msg']}, not a boolean"
    return str(err["msg"])


def _explain(exc: ValidationError, ident: str | None, job: str | None, node: str | None) -> DecodeError:
    errors = exc.errors(include_url=False)
    for err in errors:
        message = _token_error(err)
        if message is not None:
            where = ".".join(str(p) for p in err["loc"][1:])
            return DecodeError("bad_subject_token", f"{where}: {message}", ident, job, node)
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err["loc"][1:]) or "envelope"
        parts.append(f"{where}: {_message(err)}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return DecodeError("schema_violation", "; ".join(parts) + more, ident, job, node)

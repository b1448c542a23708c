"""The envelope (CloudEvents-like) and the log record that carries it.

The envelope is a pydantic discriminated union on `type`: one generated model per event type, so the
wire format has `type` beside `id`, `job`/`node` and `data`, and validation picks the payload model
from it in one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, create_model

from events.kinds import JOB_EVENTS, NODE_EVENTS
from events.outputs import Decision, Rejection
from events.subjects import Token
from events.values import MAX_ID_LENGTH, Frozen, Id, Label, LogTime, PositiveCount, Seq

SCHEMA_VERSIONS: dict[str, int] = {type_: 1 for type_ in (*JOB_EVENTS, *NODE_EVENTS)}
SCHEMA_VERSIONS["device.fault"] = 2  # v1 carried only an NVIDIA `xid`: see events.codec.UPCASTERS
SCHEMA_VERSIONS["job.submitted"] = 2  # v1's spec.spares was never read: v2 makes it a quota (null: no limit)
SCHEMA_VERSIONS["decision"] = 1
SCHEMA_VERSIONS["rejection"] = 1

OUTPUT_EVENTS: dict[str, type[Frozen]] = {"decision": Decision, "rejection": Rejection}
ALL_EVENTS: dict[str, type[Frozen]] = {**JOB_EVENTS, **NODE_EVENTS, **OUTPUT_EVENTS}
MAX_PAYLOAD_BYTES = 256 * 1024


class EnvelopeBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Id = Field(description=f"dedupe key, also sent as Nats-Msg-Id: 1..{MAX_ID_LENGTH} characters, no "
                               "control character")
    type: str
    job: Token | None = None
    node: Token | None = None
    source: Label = Field("", description="who published it: agent@node, probe, operator")
    time: Label | None = Field(None, description="the source's clock: information only, never logical time")
    schema_: PositiveCount = Field(1, alias="schema")
    data: Any


def _envelope_model(type_: str, payload: type[Frozen]) -> type[EnvelopeBase]:
    name = "".join(part.title() for part in type_.replace("_", ".").split(".")) + "Envelope"
    model: type[EnvelopeBase] = create_model(
        name,
        __base__=EnvelopeBase,
        type=(Literal[type_], ...),  # type: ignore[arg-type]  # a Literal built from a runtime value
        data=(payload, ...),
    )
    return model


ENVELOPES: dict[str, type[EnvelopeBase]] = {t: _envelope_model(t, m) for t, m in ALL_EVENTS.items()}
if TYPE_CHECKING:
    AnyEnvelope = EnvelopeBase  # what every member of the union is, for the type checker
else:
    AnyEnvelope = Annotated[Union[tuple(ENVELOPES.values())], Field(discriminator="type")]  # noqa: UP007


class Record(BaseModel):
    """One entry of the log: its sequence (the order), log timestamp (logical time), subject and envelope."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: Seq
    ts: LogTime = Field(description="log time in nanoseconds since the epoch (the JetStream timestamp), at most "
                                    "2^62 so that log time plus any duration fits 63 bits")
    subject: str
    headers: dict[str, str] = Field(default_factory=dict)
    envelope: AnyEnvelope


_RECORD_FIELDS = frozenset(Record.model_fields)
_new_record = Record.__new__
_set = object.__setattr__


def stored_record(seq: int, ts: int, subject: str, headers: dict[str, str], envelope: EnvelopeBase) -> Record:
    """A Record of parts already checked (an envelope just validated, framing read from the log), built without
    validating them again: what `Record.model_construct` makes, without its generic path, which a daemon would
    pay on every event it reads."""
    record = _new_record(Record)
    _set(record, "__dict__", {"seq": seq, "ts": ts, "subject": subject, "headers": headers, "envelope": envelope})
    _set(record, "__pydantic_fields_set__", set(_RECORD_FIELDS))
    _set(record, "__pydantic_extra__", None)
    _set(record, "__pydantic_private__", None)
    return record


class RawRecord(BaseModel):
    """A log entry whose envelope has not been decoded, or could not be: bytes exactly as received."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: Seq
    ts: LogTime
    subject: str
    headers: dict[str, str] = Field(default_factory=dict)
    data: bytes


RECORD = TypeAdapter(Record)
ENVELOPE = TypeAdapter(AnyEnvelope)


def make_envelope(
    type_: str,
    data: Frozen | dict[str, Any],
    *,
    id: str,
    job: str | None = None,
    node: str | None = None,
    source: str = "",
    time: str | None = None,
) -> EnvelopeBase:
    """Build a validated envelope of the current schema version (what producers should call)."""
    if type_ not in ENVELOPES:
        raise ValueError(f"unknown event type {type_!r}")
    payload = data.model_dump() if isinstance(data, BaseModel) else data
    return ENVELOPES[type_].model_validate(
        {"id": id, "type": type_, "job": job, "node": node, "source": source, "time": time,
         "schema": SCHEMA_VERSIONS[type_], "data": payload}
    )

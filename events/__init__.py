"""The vocabulary of `recovery`: events, commands, the envelope, the codec and subject naming.

No I/O and no logic beyond validation: everything else depends on this package, and it on nothing else.
"""

from events import kinds
from events.codec import (
    DecodeError,
    decode_envelope,
    decode_record_line,
    encode_envelope,
    encode_record,
    upcast,
)
from events.commands import (
    Command,
    FailJob,
    IsolateDevice,
    IsolateNode,
    MigrateRanks,
    RestartJob,
    RestartRanks,
    RetryStep,
    SaveCheckpoint,
    ScaleJob,
    StopRanks,
)
from events.envelope import (
    ALL_EVENTS,
    ENVELOPES,
    SCHEMA_VERSIONS,
    AnyEnvelope,
    EnvelopeBase,
    RawRecord,
    Record,
    make_envelope,
)
from events.outputs import Decision, Rejection, TimerRequest
from events.values import (
    STORAGE_HOLDER,
    TIER_COST,
    Elastic,
    FaultClass,
    Granularity,
    JobSpec,
    Layout,
    PolicyRef,
    PolicySelection,
    RankSource,
    ResumePlan,
    ShardSource,
    Tier,
)

__all__ = [
    "ALL_EVENTS", "ENVELOPES", "SCHEMA_VERSIONS", "STORAGE_HOLDER", "TIER_COST", "AnyEnvelope", "Command",
    "Decision", "DecodeError", "Elastic", "EnvelopeBase", "FailJob", "FaultClass", "Granularity",
    "IsolateDevice", "IsolateNode", "JobSpec", "Layout", "MigrateRanks", "PolicyRef", "PolicySelection",
    "RankSource", "RawRecord", "Record", "Rejection", "RestartJob", "RestartRanks", "ResumePlan",
    "RetryStep", "SaveCheckpoint", "ScaleJob", "ShardSource", "StopRanks", "Tier", "TimerRequest", "decode_envelope",
    "decode_record_line", "encode_envelope", "encode_record", "kinds", "make_envelope", "upcast",
]

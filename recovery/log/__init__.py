"""Event logs: the one door between the engine's world and storage.

- `base`: the contract (`EventLog`, `SyncLog`, `Appended`, `MSG_ID`) and what every log shares;
- `memory` (`MemoryLog`, `CountingLog`) and `file` (`FileLog`, the JSONL format's readers and writer);
- `jetstream`: the JetStream log, with its publisher helpers and the one list of transient NATS errors, and `pull`:
  the one JetStream pull reader, of the log, the daemon's input and its scans (both import nats-py: import them
  from there);
- `export`: per-job export headers and filters;
- `recorder`: the daemon's loop on a synchronous log (`Recorder`) and `replay`; `verify`: the first decision a
  replay derives differently from the log's, and why;
- `snapshot`: the engine's state as bytes, for the daemon's snapshot bucket;
- `nats_server`: a local `nats-server -js` process (the daemon's embedded server and the test fixture are two kinds).
"""

from recovery.log.base import EPOCH, MSG_ID, Appended, Clock, EventLog, SyncLog, to_record
from recovery.log.export import (
    EXPORT_FORMAT,
    ExportHeader,
    export_filter,
    export_log,
    record_jobs,
    record_matches,
    rejection_jobs,
    replay_matches,
    subject_job,
)
from recovery.log.file import MAX_SEQ, FileLog, iter_file, iter_numbered, read_header, write_file
from recovery.log.memory import CountingLog, MemoryLog
from recovery.log.recorder import Recorder, Replay, replay

__all__ = [
    "EPOCH", "EXPORT_FORMAT", "MAX_SEQ", "MSG_ID", "Appended", "Clock", "CountingLog", "EventLog", "ExportHeader",
    "FileLog", "MemoryLog", "Recorder", "Replay", "SyncLog", "export_filter", "export_log", "iter_file",
    "iter_numbered", "read_header", "record_jobs", "record_matches", "rejection_jobs", "replay", "replay_matches",
    "subject_job", "to_record", "write_file",
]

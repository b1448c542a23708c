"""The daemon's streams: the log (inputs, decisions, dead letters) and the command stream, created or brought to
the configuration at start."""

from __future__ import annotations

from dataclasses import replace

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, SubjectTransform

from events import subjects
from recovery.log.jetstream import ensure_stream, stream_config
from recovery.service.config import DaemonConfig
from recovery.service.snapshots import Retry


def log_config(cfg: DaemonConfig) -> StreamConfig:
    """The log; with several partitions, it stores each job event in its partition's subject space (JetStream's
    `partition()` transform) and holds the partitions' fence subjects."""
    config = stream_config(cfg.stream, None, cfg.duplicate_window_s, cfg.replicas)
    if cfg.partitions > 1:
        src, dest = subjects.partition_transform(cfg.partitions)
        config.subject_transform = SubjectTransform(src=src, dest=dest)
        config.subjects = [*(config.subjects or []), f"{subjects.FENCES}.log.>"]
    return config


def command_config(cfg: DaemonConfig) -> StreamConfig:
    fences = [f"{subjects.FENCES}.cmd.>"] if cfg.partitions > 1 else []
    return StreamConfig(
        name=cfg.command_stream, subjects=[subjects.COMMANDS, *fences], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_age=cfg.command_max_age_s, duplicate_window=cfg.duplicate_window_s,
        num_replicas=cfg.replicas, discard=DiscardPolicy.OLD,
    )


_ENSURED: set[tuple[str, str, int, int]] = set()
"""the logs this process has made sure of, with their streams (`ensure_streams(once=True)`): by the log's creation
time, so that another server's log of the same name (a test's, a rebuilt deployment's) is checked again"""


SEALED_FROM = "recovery_sealed_from"
"""the log stream's metadata key: the first sequence from which every record only the daemon may write must carry the
deployment's seal (`recovery.core.firings`). A new log's is 1; a log that held records before daemons recorded it
(written by an older version) gets the sequence after its last, so that what it held replays as it was decided."""


async def sealed_from(js: JetStreamContext, cfg: DaemonConfig) -> int:
    """The log's `SEALED_FROM`, recorded now if the log has none (its stream's metadata, kept by every update)."""
    info = await js.stream_info(cfg.stream)
    metadata = dict(info.config.metadata or {})
    if SEALED_FROM not in metadata:
        metadata[SEALED_FROM] = str(info.state.last_seq + 1)
        info = await js.update_stream(replace(info.config, metadata=metadata))
        metadata = dict(info.config.metadata or {})
    return int(metadata[SEALED_FROM])


async def ensure_streams(js: JetStreamContext, cfg: DaemonConfig, retry: Retry, *, once: bool = False) -> int:
    """Create both streams, or bring them to `cfg`, retrying through an outage. A log that already holds
    messages under another partitioning is refused: its jobs' state lives in partitions that would move.

    `once`: the log's partitioning is checked, and the rest not again if this process made sure of the same log
    already. A partition taken over is a takeover's wait, and each creation request is answered by the cluster's
    meta leader, busiest then; the first partition this process served made sure of the same configuration.
    Returns the log's `SEALED_FROM`."""
    created = await retry(lambda: check_partitioning(js, cfg), "log stream")
    key = (str(created), cfg.command_stream, cfg.partitions, cfg.replicas)
    if not (once and created is not None and key in _ENSURED):
        await retry(lambda: ensure_stream(js, log_config(cfg)), "log stream")
        await retry(lambda: ensure_stream(js, command_config(cfg)), "command stream")
        if created is not None:
            _ENSURED.add(key)
    first: int = await retry(lambda: sealed_from(js, cfg), "log stream")
    return first


async def check_partitioning(js: JetStreamContext, cfg: DaemonConfig) -> object:
    """Refuse a log partitioned otherwise (ValueError); the log's creation time, None if there is no log yet."""
    try:
        info = await js.stream_info(cfg.stream)
    except nats.js.errors.NotFoundError:
        return None
    have = info.config.subject_transform
    want = log_config(cfg).subject_transform
    if (have.dest if have else None) != (want.dest if want else None) and info.state.messages:
        raise ValueError(f"partitions = {cfg.partitions}, but the stream {cfg.stream} already holds messages "
                         f"partitioned by {have.dest if have else 'nothing (one partition)'}: the number of "
                         f"partitions is fixed for the life of a log")
    return info.created or None

"""The daemon's streams: the log (inputs, decisions, dead letters) and the command stream, created or brought to
the configuration at start."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from events import subjects
from recovery.log.jetstream import ensure_stream, stream_config
from recovery.service.config import DaemonConfig
from recovery.service.snapshots import Retry


def log_config(cfg: DaemonConfig) -> StreamConfig:
    return stream_config(cfg.stream, None, cfg.duplicate_window_s, cfg.replicas)


def command_config(cfg: DaemonConfig) -> StreamConfig:
    return StreamConfig(
        name=cfg.command_stream, subjects=[subjects.COMMANDS], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_age=cfg.command_max_age_s, duplicate_window=cfg.duplicate_window_s,
        num_replicas=cfg.replicas, discard=DiscardPolicy.OLD,
    )


async def ensure_streams(js: JetStreamContext, cfg: DaemonConfig, retry: Retry) -> None:
    """Create both streams, or bring them to `cfg`, retrying through an outage."""
    await retry(lambda: ensure_stream(js, log_config(cfg)), "log stream")
    await retry(lambda: ensure_stream(js, command_config(cfg)), "command stream")

"""The daemon's configuration: defaults < TOML file < environment (`RECOVERY_<KEY>`) < command-line flags.

    recovery-daemon --config recovery.toml --http-port 9500
    RECOVERY_NATS_URL=nats://nats-0:4222 recovery-daemon

Every key is a top-level key of the TOML file, an environment variable `RECOVERY_<KEY>` (upper case) and a
flag `--<key-with-dashes>`. An unknown key or a bad value stops the daemon at start with an error that names
the key and where it came from.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from recovery import settings
from recovery.settings import ConfigError, FileSettings

__all__ = ["ENV_PREFIX", "ConfigError", "DaemonConfig", "add_arguments", "load"]

ENV_PREFIX = "RECOVERY_"


class DaemonConfig(FileSettings):
    """Every setting of `recovery-daemon`. Descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # -- NATS ------------------------------------------------------------------------------------------
    nats_url: str = Field("", description="NATS server URL(s), comma-separated, nats:// or tls:// (not a "
                                          "websocket); empty: start an embedded nats-server with JetStream in "
                                          "data_dir")
    data_dir: Path = Field(Path("recovery-data"), description="embedded nats-server store and the daemon's "
                                                               "local files (nats.url for recovery-ctl); one "
                                                               "daemon's alone (daemon.lock)")
    embedded_port: int = Field(4222, ge=0, le=65535, description="client port of the embedded nats-server "
                                                                  "(0: a free one, picked at the first start and "
                                                                  "kept in data_dir/nats.url for every later one)")
    replicas: int = Field(1, ge=1, le=5, description="replicas of the streams and the snapshot bucket")
    # -- streams ---------------------------------------------------------------------------------------
    stream: str = Field("RECOVERY", description="the audit log stream: inputs, decisions, dead letters")
    command_stream: str = Field("RECOVERY_CMD", description="the command stream over recovery.cmd.>")
    command_max_age_s: float = Field(86_400.0, gt=0, description="retention of the command stream")
    duplicate_window_s: float = Field(3_600.0, gt=0, description="JetStream duplicate window of both streams: "
                                                                  "longer than any daemon restart")
    # -- processing ------------------------------------------------------------------------------------
    consumer: str = Field("recovery-daemon", description="name of the input consumer (each one made is "
                                                             "`<consumer>[-<partition>]-<unique>`)")
    batch_size: int = Field(1000, ge=1, le=100_000, description="records pulled and applied per batch")
    backlog_reader_at: int = Field(1000, ge=1, description="with partitions > 1: a partition with this many inputs "
                                   "pending when its consumer opens (taken over, restarted) reads them through one "
                                   "consumer per filter merged by sequence, which JetStream serves far faster")
    ack_wait_s: float = Field(60.0, gt=0, description="redelivery delay of an unacknowledged input")
    snapshot_bucket: str = Field("RECOVERY_SNAPSHOTS", description="KV bucket of engine snapshots")
    partition: str = Field("default", description="snapshot and lease key: the partition of jobs this daemon owns "
                                                  "(with partitions > 1, the prefix of each partition's key)")
    partitions: int = Field(1, ge=1, le=1024, description="jobs spread over this many partitions, owned by the "
                                                          "daemons between them (fixed for the life of the log; "
                                                          "> 1 needs nats_url and a lease)")
    lease_bucket: str = Field("RECOVERY_LEASES", description="KV bucket of the partitions' leases")
    lease_ttl_s: float = Field(10.0, ge=0, description="a standby takes the partition over this long after the "
                                                       "active daemon stops renewing its lease (0: no lease; "
                                                       "then never run two daemons on one partition)")
    instance: str = Field("", description="this daemon's name in the lease (default: host name and data_dir); "
                                          "the same name takes its own lease back at once after a crash")
    snapshot_every_records: int = Field(50_000, ge=1, description="snapshot after this many input records (or "
                                                                     "a tenth of them and of snapshot_every_s)")
    snapshot_every_s: float = Field(60.0, gt=0, description="snapshot at least this often while records arrive")
    snapshot_chunk_bytes: int = Field(512 * 1024, ge=1024, le=8 * 1024 * 1024,
                                      description="snapshot value size per KV entry (below max_payload)")
    snapshot_fork: bool = Field(True, description="pickle snapshots in a forked child (copy-on-write) so that "
                                                  "deciding never waits for one; off: pickle in the event loop")
    policy_budget_s: float = Field(2.0, gt=0, le=600, description="how long one call of a third-party policy may "
                                   "take: past it the call is abandoned (its worker process killed), the built-in "
                                   "answers, and the log says so (policy.overran)")
    timers_enabled: bool = Field(True, description="fire the engine's timers as timer.fired events "
                                                   "(off: something else publishes them, as in replay tests)")
    unserved_after_s: float = Field(60.0, ge=0, le=86400, description="a job still waiting to start this long on "
                                    "nodes no agent serves (none heard from, or gone) gets a job.unserved event, "
                                    "which its decisions and recovery-ctl jobs show (0: never)")
    progress_summary_s: float = Field(10.0, gt=0, le=600, description="how often the daemon logs one "
                                      "progress.summary per job of what it heard of its ranks from agents that send "
                                      "their periodic reports over core NATS (`progress = \"summary\"`); keep it "
                                      "below the jobs' rank silence bounds less the agents' report_s")
    outage_bound_s: float = Field(300.0, ge=0, le=86400, description="an outage of the control plane (this "
                                  "daemon cut off from NATS) up to this long counts in no node's or rank's silence: "
                                  "the daemon logs it (control.outage) when it is back, before any timer that fell "
                                  "due meanwhile; a longer one's silence counts as any other (0: every outage's)")
    ctl_enabled: bool = Field(True, description="answer recovery-ctl requests on recovery.ctl.> (with "
                                                "partitions > 1: each active partition on recovery.ctl.p.<k>.>)")
    # -- service ---------------------------------------------------------------------------------------
    http_host: str = Field("127.0.0.1", description="address of /healthz, /readyz and /metrics")
    http_port: int = Field(9464, ge=-1, le=65535, description="port of /healthz, /readyz and /metrics "
                                                               "(0: any free port, -1: no HTTP server)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["json", "text"] = Field("json", description="structured JSON lines or plain text")
    log_file: Path | None = Field(None, description="write logs here instead of stderr")
    shutdown_timeout_s: float = Field(5.0, gt=0, description="SIGTERM/SIGINT: finish, snapshot and drain "
                                                             "within this")
    duration_s: float | None = Field(None, gt=0, description="stop by itself after this many seconds")
    # -- demo ------------------------------------------------------------------------------------------
    demo: bool = Field(False, description="run a simulated cluster against the daemon and show it live")
    demo_driver: str = Field("auto", description="'auto' or 'sim' (the simulator's demo cluster; with 'auto' the "
                                                 "built-in cluster if it cannot start), 'builtin', or "
                                                 "module:attribute of a driver factory")
    demo_seed: int = Field(1, description="seed of the demo cluster's faults")

    @field_validator("stream", "command_stream", "snapshot_bucket", "consumer", "lease_bucket")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value or any(c in value for c in " .*>\t\n/\\"):
            raise ValueError(f"{value!r} is not a valid JetStream name (no spaces, '.', '*', '>', slashes)")
        return value

    @field_validator("partition")
    @classmethod
    def _key(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError(f"{value!r} is not a valid key (letters, digits, '-', '_')")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> DaemonConfig:
        if self.partitions > 1 and (not self.nats_url or self.lease_ttl_s <= 0):
            raise ValueError(f"partitions = {self.partitions} needs a NATS server (nats_url) and a lease "
                             f"(lease_ttl_s > 0): the daemons share the partitions through their leases")
        if any(url.strip().lower().startswith(("ws://", "wss://")) for url in self.nats_url.split(",")):
            raise ValueError(f"nats_url {self.nats_url!r}: the daemon connects over nats:// or tls://, not a "
                             f"websocket (the servers' websocket port is for clients outside the cluster)")
        if self.stream == self.command_stream:
            raise ValueError("stream and command_stream must differ")
        if self.duplicate_window_s > self.command_max_age_s:
            raise ValueError(f"duplicate_window_s ({self.duplicate_window_s}) exceeds command_max_age_s "
                             f"({self.command_max_age_s}): JetStream requires the window within the max age")
        return self

    def partition_key(self, index: int | None) -> str:
        """The key of a partition's lease, snapshot, consumer and fence: `partition` alone with one partition (as
        always), `<partition>-<index>` with several."""
        return self.partition if index is None else f"{self.partition}-{index}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per key, `--config FILE`, and `--print-config`."""
    settings.add_arguments(parser, DaemonConfig)
    parser.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    parser.add_argument("--duration", dest="duration_s", default=None, metavar="SECONDS",
                        help="alias of --duration-s")


def load(args: argparse.Namespace | None = None, **overrides: Any) -> DaemonConfig:
    """The effective configuration; raises ConfigError naming the bad key and where its value came from."""
    return settings.load(DaemonConfig, args, **overrides)

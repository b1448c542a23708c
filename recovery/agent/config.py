"""The agent's configuration: defaults < TOML file < environment (`RECOVERY_AGENT_<KEY>`) < command-line flags.

    recovery-agent --node gpu-17 --nats-url nats://nats-0:4222
    RECOVERY_AGENT_NODE=gpu-17 recovery-agent --config /etc/recovery/agent.toml

An unknown key or a bad value stops the agent at start with an error that names the key and where it came from.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from events.subjects import check_token

ENV_PREFIX = "RECOVERY_AGENT_"
_TOML: ContextVar[Path | None] = ContextVar("recovery_agent_config_toml", default=None)


class ConfigError(Exception):
    """A configuration that cannot run: the message names the key, the value's origin and the problem."""


class AgentConfig(BaseSettings):
    """Every setting of `recovery-agent`. Descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    node: str = Field(description="this node's id, as job specs name it (one subject token)")
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated")
    stream: str = Field("RECOVERY", description="the audit log stream the agent publishes events to")
    command_stream: str = Field("RECOVERY_CMD", description="the stream of the commands addressed to this node")
    spare: bool = Field(False, description="join the shared spare pool instead of reporting ready")
    devices: int = Field(8, ge=1, le=1024, description="accelerators (rank slots) of this node")
    runtime_dir: Path = Field(Path("recovery-agent"), description="the SDK's sockets and the ranks' output")
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="how often the SDK in every rank sends a heartbeat")
    outbox_capacity: int = Field(100_000, ge=1, description="events kept while NATS is away; beyond, the oldest "
                                                             "are dropped and counted")
    store_host: str = Field("0.0.0.0", description="address a rendezvous store this agent hosts listens on")
    kill_grace_s: float = Field(5.0, ge=0, le=3600, description="how long a killed process may take to be reaped "
                                                                 "before a command fails")
    standby: bool = Field(False, description="keep a warm standby interpreter per job on this node (torch imported) "
                                             "that a restarted rank is handed to; a job's entrypoint environment "
                                             "RECOVERY_STANDBY=1 or 0 overrides this for the job")
    standby_preload: str = Field("torch,torch.distributed,torch._dynamo,recovery.client.torch:warm_up",
                                 description="modules a standby imports before it waits, comma-separated, and "
                                             "`module:function` warm-ups it calls (a job's RECOVERY_STANDBY_PRELOAD "
                                             "overrides this)")
    standby_delay_s: float = Field(5.0, ge=0, le=3600, description="how long after a job's start or a hand-over "
                                                                    "the next standby starts (its imports would "
                                                                    "compete for the CPU with the ranks')")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")

    @field_validator("node")
    @classmethod
    def _token(cls, value: str) -> str:
        try:
            return check_token(value)
        except ValueError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _TOML.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


FIELDS = AgentConfig.model_fields


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per key and `--config FILE`. Flags keep strings: pydantic parses them."""
    parser.add_argument("--config", metavar="FILE", default=os.environ.get(ENV_PREFIX + "CONFIG"),
                        help=f"TOML configuration file (also {ENV_PREFIX}CONFIG)")
    for name, info in FIELDS.items():
        if info.annotation is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=info.description)
        else:
            parser.add_argument(_flag(name), dest=name, default=None, metavar=name.upper(), help=info.description)


def load(args: argparse.Namespace | None = None, **overrides: Any) -> AgentConfig:
    """The effective configuration; raises ConfigError naming the bad key and where its value came from."""
    flags: dict[str, Any] = {}
    toml_path: Path | None = None
    if args is not None:
        toml_path = Path(args.config) if getattr(args, "config", None) else None
        flags = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    if toml_path is not None:
        if not toml_path.is_file():
            raise ConfigError(f"configuration file {toml_path} does not exist")
        try:
            with toml_path.open("rb") as fh:
                tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"configuration file {toml_path} is not valid TOML: {exc}") from exc
    token = _TOML.set(toml_path)
    try:
        return AgentConfig(**flags)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, flags, toml_path)) from None
    finally:
        _TOML.reset(token)


def _explain(exc: ValidationError, flags: dict[str, Any], toml_path: Path | None) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"]) or "(configuration)"
        if key in flags:
            origin = f"flag {_flag(key)}"
        elif key in FIELDS and (ENV_PREFIX + key.upper()) in os.environ:
            origin = f"environment variable {ENV_PREFIX}{key.upper()}"
        elif toml_path is not None:
            origin = f"{toml_path}"
        else:
            origin = "default"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r} (in {origin}); known keys: {', '.join(sorted(FIELDS))}")
        elif err["type"] == "missing":
            lines.append(f"{key}: required (set {_flag(key)}, {ENV_PREFIX}{key.upper()} or {key} in the file)")
        else:
            value = f" (got {err['input']!r})" if err["loc"] and not isinstance(err["input"], dict) else ""
            lines.append(f"{key}: {err['msg']}{value} (from {origin})")
    return "invalid configuration: " + "; ".join(lines)

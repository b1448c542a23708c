"""How the long-running processes (`recovery-daemon`, `recovery-agent`) are configured: defaults < TOML file <
environment (`<PREFIX><KEY>`) < command-line flags, with errors that name the key and where its value came from.

Every key is a top-level key of the TOML file, an environment variable `<PREFIX><KEY>` (upper case) and a flag
`--<key-with-dashes>`. A process's settings class subclasses `FileSettings` with its own `env_prefix`.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

_TOML: ContextVar[Path | None] = ContextVar("recovery_settings_toml", default=None)
"""the TOML file of the `load` in progress: pydantic-settings builds its sources inside the constructor"""

S = TypeVar("S", bound="FileSettings")


class ConfigError(Exception):
    """A configuration that cannot run: the message names the key, the value's origin and the problem."""


class FileSettings(BaseSettings):
    """Settings read from flags, the environment and a TOML file, in that order of precedence."""

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


def env_prefix(settings: type[FileSettings]) -> str:
    return str(settings.model_config.get("env_prefix", ""))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, settings: type[FileSettings]) -> None:
    """One flag per key and `--config FILE`. Flags keep strings: pydantic parses them."""
    prefix = env_prefix(settings)
    parser.add_argument("--config", metavar="FILE", default=os.environ.get(prefix + "CONFIG"),
                        help=f"TOML configuration file (also {prefix}CONFIG)")
    for name, info in settings.model_fields.items():
        if info.annotation is bool:
            parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=info.description)
        else:
            parser.add_argument(flag(name), dest=name, default=None, metavar=name.upper(), help=info.description)


def load(settings: type[S], args: argparse.Namespace | None = None, **overrides: Any) -> S:
    """The effective configuration; raises ConfigError naming the bad key and where its value came from."""
    fields = settings.model_fields
    flags: dict[str, Any] = {}
    toml_path: Path | None = None
    if args is not None:
        toml_path = Path(args.config) if getattr(args, "config", None) else None
        flags = {k: v for k, v in vars(args).items() if k in fields and v is not None}
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
        return settings(**flags)
    except ValidationError as exc:
        raise ConfigError(explain(settings, exc, flags, toml_path)) from None
    finally:
        _TOML.reset(token)


def explain(settings: type[FileSettings], exc: ValidationError, flags: dict[str, Any],
            toml_path: Path | None) -> str:
    """One line per problem: the key, what is wrong, and whether a flag, the environment, the file or the
    default gave the value."""
    fields = settings.model_fields
    prefix = env_prefix(settings)
    lines = []
    for err in exc.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"]) or "(configuration)"
        if key in flags:
            origin = f"flag {flag(key)}"
        elif key in fields and (prefix + key.upper()) in os.environ:
            origin = f"environment variable {prefix}{key.upper()}"
        elif toml_path is not None:
            origin = f"{toml_path}"
        else:
            origin = "default"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r} (in {origin}); known keys: {', '.join(sorted(fields))}")
        elif err["type"] == "missing":
            lines.append(f"{key}: required (set {flag(key)}, {prefix}{key.upper()} or {key} in the file)")
        else:
            value = f" (got {err['input']!r})" if err["loc"] and not isinstance(err["input"], dict) else ""
            lines.append(f"{key}: {err['msg']}{value} (from {origin})")
    return "invalid configuration: " + "; ".join(lines)

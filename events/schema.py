"""The JSON Schema of the wire format, exported to events/wire-schema.json and checked current in CI.

    python -m events.schema            rewrite events/wire-schema.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from pydantic import TypeAdapter

from events.commands import Command
from events.envelope import SCHEMA_VERSIONS, AnyEnvelope, Record

SCHEMA_PATH = Path(__file__).with_name("wire-schema.json")


def wire_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "recovery wire format",
        "description": "Envelopes (events, decisions, rejections), commands and JSONL log records.",
        "schema_versions": dict(sorted(SCHEMA_VERSIONS.items())),
        "envelope": TypeAdapter(AnyEnvelope).json_schema(by_alias=True),
        "command": TypeAdapter(Command).json_schema(by_alias=True),
        "record": Record.model_json_schema(by_alias=True),
    }


def render() -> bytes:
    return orjson.dumps(wire_schema(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_bytes(render())
    print(f"wrote {SCHEMA_PATH}")

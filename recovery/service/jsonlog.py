"""Structured logs: one JSON object per line (`ts`, `level`, `logger`, `msg` and the record's fields).

    logger.info("snapshot written", extra={"fields": {"seq": 1200, "bytes": 5120}})
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import orjson

PARTITION: ContextVar[str | None] = ContextVar("recovery_log_partition", default=None)
"""the partition whose daemon runs in this task and the tasks it starts (`recovery.service.ownership`): one process
serves several, and every line one of them logs names it"""


def _partition(fields: object) -> dict[str, Any]:
    part = PARTITION.get()
    return {"partition": part} if part is not None and not (isinstance(fields, dict) and "partition" in fields) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        out.update(_partition(fields))
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        fields = {**_partition(fields), **(fields if isinstance(fields, dict) else {})}
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


def setup(level: str = "INFO", fmt: str = "json", path: Path | None = None) -> None:
    handler: logging.Handler
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # nats-py logs every reconnect attempt at error level: the daemon reports outages itself.
    logging.getLogger("nats").setLevel(logging.DEBUG if level == "DEBUG" else logging.CRITICAL)
    logging.getLogger("transitions").setLevel(logging.WARNING)  # a line per state change of every job

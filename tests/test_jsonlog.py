"""The daemon's log lines: a partition's daemon (several in one process) names its partition in every line."""

from __future__ import annotations

import logging

import anyio
import orjson

from recovery.service import jsonlog


def test_each_partitions_task_names_its_partition_in_every_line_and_the_process_none() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)
            record.line = (jsonlog.JsonFormatter().format(record), jsonlog.TextFormatter().format(record))  # type: ignore[attr-defined]

    logger = logging.getLogger("recovery.test-jsonlog")
    logger.addHandler(handler := Keep())
    logger.setLevel(logging.INFO)

    async def partition(key: str) -> None:
        jsonlog.PARTITION.set(key)

        async def part() -> None:  # a task the partition's daemon starts: it inherits the name
            logger.info("consumer reset", extra={"fields": {"at": 7}})

        async with anyio.create_task_group() as parts:
            parts.start_soon(part)
        logger.info("named already", extra={"fields": {"partition": "default-9"}})

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(partition, "default-1")
            group.start_soon(partition, "default-2")
        logger.info("balance failed")

    try:
        anyio.run(main)
    finally:
        logger.removeHandler(handler)
    lines = [(orjson.loads(json), text) for json, text in (r.line for r in records)]  # type: ignore[attr-defined]
    resets = sorted(json["partition"] for json, _ in lines if json["msg"] == "consumer reset")
    assert resets == ["default-1", "default-2"]
    assert all(json["partition"] == "default-9" for json, _ in lines if json["msg"] == "named already")
    process = [(json, text) for json, text in lines if json["msg"] == "balance failed"]
    assert process and "partition" not in process[0][0] and "partition=" not in process[0][1]
    assert any(text.endswith("partition=default-1 at=7") for _, text in lines)

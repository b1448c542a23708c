"""The JSON Schema of a job spec (`events.values.JobSpec`), as `docs/job-spec.schema.json` holds it (a test keeps
that file current), for editors and for checking a spec before it is submitted.

    python -m recovery.cli.jobspec > docs/job-spec.schema.json
"""

from __future__ import annotations

import sys
from typing import Any

import orjson

from events.values import JobSpec


def job_spec_schema() -> dict[str, Any]:
    schema = JobSpec.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "recovery job spec",
            "description": "What `recovery-ctl submit` and `recovery-run --spec` take: docs/job-spec.md explains "
                           "every field.", **{k: v for k, v in schema.items() if k not in ("title", "description")}}


def render() -> bytes:
    return orjson.dumps(job_spec_schema(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


if __name__ == "__main__":
    sys.stdout.buffer.write(render())

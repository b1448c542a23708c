#!/usr/bin/env python
"""Write the generated tables of docs/reference.md from the code that defines them, so that they never go stale.

    python tools/config_reference.py            # rewrite docs/reference.md between its generated markers
    python tools/config_reference.py --check    # exit 1 if docs/reference.md is not what this would write

What is generated, each from its one definition:

- every key of `recovery-daemon` (`recovery.service.config.DaemonConfig`) and of `recovery-agent`
  (`recovery.agent.config.AgentConfig`): the key, its environment variable and flag, its default, its description
  (the same text as `--help`);
- every metric of the daemon's `/metrics` (`recovery.service.http.Metrics`);
- the exit statuses of `recovery-run` and `recovery-ctl` (their `EXIT_CODES` epilogs);
- the parameters of the built-in policies (their `Params` models), with their `name@version`.

Each block sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`; the text around them is written by
hand. `tests/test_docs.py` fails when a block differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
LONG_DEFAULT = 60  # characters: a longer default is named by where it is defined rather than printed


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _default(info: FieldInfo, owner: type) -> str:
    if info.is_required():
        return "required"
    value: Any = info.default
    if value is PydanticUndefined and info.default_factory is not None:
        value = info.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    if isinstance(value, tuple | list) and all(isinstance(v, Enum) for v in value):
        value = [v.value for v in value]
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = json.dumps(value, default=str) if not isinstance(value, int | float) else repr(value)
    if len(text) > LONG_DEFAULT:
        return f"see `{owner.__module__}`"
    return f"`{text}`"


def attribute_docs(model: type) -> dict[str, str]:
    """The string written under each field of `model` (its attribute docstring), by field name."""
    body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(model))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for field, after in zip(body.body, body.body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def what(model: type[BaseModel], name: str, info: FieldInfo, docs: dict[str, str]) -> str:
    parts = [text for text in (info.description, docs.get(name)) if text]
    return _cell("; ".join(parts))


def settings_table(model: type[BaseModel], prefix: str) -> str:
    rows = ["| key | environment, flag | default | what |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        where = f"`{prefix}{name.upper()}`, `--{name.replace('_', '-')}`"
        rows.append(f"| `{name}` | {where} | {_default(info, model)} | {_cell(info.description or '')} |")
    return "\n".join(rows)


def daemon_keys() -> str:
    from recovery.service.config import ENV_PREFIX, DaemonConfig

    return settings_table(DaemonConfig, ENV_PREFIX)


def agent_keys() -> str:
    from recovery.agent.config import ENV_PREFIX, AgentConfig

    return settings_table(AgentConfig, ENV_PREFIX)


def metrics() -> str:
    from recovery.service.http import Metrics

    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for collector in Metrics().registry._collector_to_names:  # every collector registered, in order
        for family in collector.describe():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = ", ".join(f"`{label}`" for label in getattr(collector, "_labelnames", ()))
            rows.append(f"| `{name}` | {family.type} | {labels} | {_cell(family.documentation)} |")
    return "\n".join(rows)


def exit_table(epilog: str) -> str:
    rows = ["| status | meaning |", "|---|---|"]
    for line in epilog.splitlines():
        match = re.match(r"^\s+(\d+)\s+(.*)$", line)
        if match:
            rows.append(f"| {match.group(1)} | {_cell(match.group(2))} |")
    return "\n".join(rows)


def run_exits() -> str:
    from recovery.cli.run import EXIT_CODES

    return exit_table(EXIT_CODES)


def ctl_exits() -> str:
    from recovery.cli.ctl import EXIT_CODES

    return exit_table(EXIT_CODES)


def policies() -> str:
    from policies.checkpoint import NewestCompleteCheckpoint
    from policies.detection import DefaultDetection
    from policies.rescheduling import LadderRescheduling

    blocks = []
    for family, policy in (("detection", DefaultDetection), ("rescheduling", LadderRescheduling),
                           ("checkpoint", NewestCompleteCheckpoint)):
        params: type[BaseModel] = policy.parameters
        rows = [f"**{family}: `{policy.name}@{policy.version}`** (`{policy.__module__}.{params.__name__}`)", "",
                "| parameter | default | what |", "|---|---|---|"]
        docs = attribute_docs(params)
        for name, info in params.model_fields.items():
            rows.append(f"| `{name}` | {_default(info, params)} | {what(params, name, info, docs)} |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)


BLOCKS: dict[str, Callable[[], str]] = {
    "daemon-keys": daemon_keys,
    "agent-keys": agent_keys,
    "metrics": metrics,
    "recovery-run-exits": run_exits,
    "recovery-ctl-exits": ctl_exits,
    "policy-parameters": policies,
}


def render(text: str) -> str:
    """`text` with every generated block written anew; a block named in BLOCKS but missing is an error."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated: {re.escape(name)} -->\n)(?:.*?\n)?(<!-- end: {re.escape(name)} -->)",
                             re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"docs/reference.md lacks the markers of the generated block {name!r}")
        body = make()
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)  # noqa: B023 - used at once
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is stale")
    args = parser.parse_args(argv)
    current = REFERENCE.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("docs/reference.md is stale: run `python tools/config_reference.py`", file=sys.stderr)
            return 1
        return 0
    if fresh != current:
        REFERENCE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

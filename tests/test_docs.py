"""The README's drawing and the exported wire schema are generated: keep them current."""

from __future__ import annotations

from pathlib import Path

from events.schema import SCHEMA_PATH, render
from recovery.core.machine import mermaid

ROOT = Path(__file__).resolve().parents[1]


def test_readme_draws_the_current_state_machines() -> None:
    readme = (ROOT / "README.md").read_text()
    for machine in ("job", "phase"):
        assert f"```mermaid\n{mermaid(machine)}\n```" in readme, f"the {machine} machine's drawing is stale"


def test_exported_wire_schema_is_current() -> None:
    assert SCHEMA_PATH.read_bytes() == render(), "run `python -m events.schema` and commit the result"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in readme


def test_exported_job_spec_schema_is_current() -> None:
    from recovery.cli.jobspec import render as render_job_spec

    path = ROOT / "docs" / "job-spec.schema.json"
    assert path.read_bytes() == render_job_spec(), "run `python -m recovery.cli.jobspec > docs/job-spec.schema.json`"


def test_the_example_job_spec_is_valid_with_its_policies_parameters() -> None:
    import orjson

    from events.values import JobSpec
    from policies.registry import load_set

    example = orjson.loads((ROOT / "docs" / "job.json").read_bytes())
    spec = JobSpec.model_validate(example["spec"])
    load_set(spec.policies)  # each policy's parameters, as the engine validates them when it accepts the job
    documented = (ROOT / "docs" / "job-spec.md").read_text()
    for field in JobSpec.model_fields:
        assert f"**`{field}`**" in documented, f"docs/job-spec.md does not explain {field}"


def tutorial_diff() -> list[str]:
    """`original.py` -> `with_sdk.py` of examples/ddp-tutorial, as a unified diff with one line of context."""
    import difflib

    folder = ROOT / "examples" / "ddp-tutorial"
    original = (folder / "original.py").read_text().splitlines()
    converted = (folder / "with_sdk.py").read_text().splitlines()
    return list(difflib.unified_diff(original, converted, "original.py", "with_sdk.py", n=1, lineterm=""))


def test_the_tutorial_script_converts_to_the_sdk_in_at_most_15_changed_lines() -> None:
    # added plus removed lines, blank ones not counted (a changed line counts twice: once removed, once added)
    changed = [line for line in tutorial_diff()[2:]
               if line[:1] in "+-" and not line.startswith("@@") and line[1:].strip()]
    assert 0 < len(changed) <= 15, "\n".join(changed)


def test_the_ml_engineer_guide_shows_the_real_conversion_diff() -> None:
    guide = (ROOT / "docs" / "ml-engineer.md").read_text()
    assert "```diff\n" + "\n".join(tutorial_diff()) + "\n```" in guide, "the guide's diff of with_sdk.py is stale"


def test_the_readme_links_the_ml_engineer_guide() -> None:
    assert "docs/ml-engineer.md" in (ROOT / "README.md").read_text()

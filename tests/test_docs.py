"""The docs say what is true: generated parts are current, every shell command in them is run (here, or by the test
named for it), every relative link and anchor resolves, and the README stays a first screen."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.schema import SCHEMA_PATH, render
from recovery.core.machine import mermaid

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200


def test_how_it_works_draws_the_current_state_machines() -> None:
    guide = (ROOT / "docs" / "how-it-works.md").read_text()
    for machine in ("job", "phase"):
        assert f"```mermaid\n{mermaid(machine)}\n```" in guide, f"the {machine} machine's drawing is stale"


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


# -- the front door -------------------------------------------------------------------------------------------
GUIDES = ("platform", "ml-engineer", "on-call", "policy-author", "reference", "job-spec", "recovery-run",
          "how-it-works")


def test_the_readme_is_a_first_screen_that_links_every_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is the first screen: move detail to docs/"
    for guide in GUIDES:
        assert f"](docs/{guide}.md" in readme, f"the README does not link docs/{guide}.md"
    assert "](docs/report.png)" in readme, "the README shows the picture of a recovery"


def test_the_readmes_first_command_installs_and_runs_the_demo() -> None:
    readme = (ROOT / "README.md").read_text()
    demo = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q -e . && "
            "recovery-daemon --demo --duration 60")
    assert shell_commands(readme)[0] == demo


def test_the_reference_tables_are_generated_from_the_code() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert tool.render(reference) == reference, "run `python tools/config_reference.py` and commit the result"


def test_the_sdk_reference_is_generated_from_the_code() -> None:
    spec = importlib.util.spec_from_file_location("sdk_reference", ROOT / "tools" / "sdk_reference.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.render() == (ROOT / "docs" / "sdk.md").read_text(), "run `python tools/sdk_reference.py` and commit"


# -- every command in the docs runs -------------------------------------------------------------------------
SHELL_FENCES = {"sh", "bash", "shell", "console", ""}


def shell_commands(text: str) -> list[str]:
    """The commands of the shell blocks of a markdown text, in order: continuation lines joined, comments dropped."""
    commands: list[str] = []
    fence: str | None = None
    pending = ""
    for raw in text.splitlines():
        if raw.startswith("```"):
            fence = raw[3:].strip() if fence is None else None
            continue
        if fence is None or fence not in SHELL_FENCES:
            continue
        line = (pending + " " + raw.strip()) if pending else raw.rstrip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


GOLDEN = "tests/golden/pod_level_reschedule.jsonl"
SIM = "python -m recovery.sim run --gpus 1024 --days 54"

# Run here, in document order, in a scratch directory that sees the repository's tests/, examples/ and docs/:
# the command and the exit status it must end with.
RUN_HERE: dict[str, int] = {
    f"recovery-replay timeline {GOLDEN} --job llm": 0,
    f"recovery-replay report {GOLDEN}": 0,
    f"recovery-replay report {GOLDEN} --json > report.json": 0,
    f"recovery-replay report {GOLDEN} --html report.html": 0,
    f"recovery-replay whatif {GOLDEN} --policy rescheduling=torchelastic-like-rescheduling --keep-logs whatif": 0,
    f"recovery-replay whatif {GOLDEN}": 0,
    "recovery-replay whatif tests/golden/stock_script_restarts_whole.jsonl --step-time-s 2": 0,
    "recovery-replay diff whatif/recorded-policies.jsonl whatif/whatif.jsonl": 1,
    f"recovery-replay run {GOLDEN}": 0,
    f"recovery-replay verify {GOLDEN}": 0,
    f"recovery-replay verify {GOLDEN} --job llm": 0,
    f"{SIM} --profile torchelastic-like --log run.jsonl": 0,
    "recovery-replay verify run.jsonl": 0,
    "recovery-replay timeline run.jsonl --job llm": 0,
    "recovery-daemon --print-config": 0,
    "python -m recovery.service.auth --nodes n0,n1,n2 --out auth.conf --urls urls.json --host nats.internal:4222": 0,
}

# Too slow for this file, or needing a cluster, root or a plugin installed: the test that runs each (or its
# equivalent on this host: a NATS server on a free port instead of nats-0, a test's own node names).
COVERED_ELSEWHERE: dict[str, str] = {
    "recovery-replay report recovery-run-data":
        "tests/test_replay_cli.py::test_every_command_reads_a_stopped_runs_data_directory_and_stops_the_server_it_started",
    "recovery-replay timeline recovery-run-data --job run-5f3a":
        "tests/test_replay_cli.py::test_every_command_reads_a_stopped_runs_data_directory_and_stops_the_server_it_started",
    "recovery-replay export recovery-run-data -o run.jsonl":
        "tests/test_replay_cli.py::test_every_command_reads_a_stopped_runs_data_directory_and_stops_the_server_it_started",
    "sbatch --nodes=2 --requeue --wrap 'recovery-run --nats-url nats://nats-0:4222 --rdzv-endpoint store-0:29400 "
    "--nproc-per-node 8 train.py'":
        "tests/test_slurm.py::test_recovery_run_in_sbatch_takes_the_allocation_and_a_lost_node_requeues_it",
    "recovery-run --nats-url nats://nats-0:4222 --rdzv-endpoint store-0:29400 --nproc-per-node 8 train.py "
    "--config llama.yaml":
        "tests/test_slurm.py::test_recovery_run_in_sbatch_takes_the_allocation_and_a_lost_node_requeues_it",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q -e . && recovery-daemon --demo --duration 60":
        "tests/test_daemon_process.py::test_demo_runs_a_cluster_live_and_stops_by_itself",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[test]' && ruff check . && "
    "python -m pytest": "tests/test_docs.py::test_readme_test_command_is_what_ci_runs",
    "recovery-run --standalone --nproc-per-node 4 examples/ddp-tutorial/with_sdk.py --epochs 6 --snapshot "
    "snapshot.pt --out final.pt":
        "tests/test_e2e_ddp_sdk.py::test_a_sigkilled_rank_alone_restarts_and_the_survivors_go_on_within_seconds",
    "recovery-run --standalone --nproc-per-node 4 train.py --epochs 10":
        "tests/test_e2e_stock.py::test_the_documented_standalone_run_of_the_stock_script_completes_with_no_incident_and_its_log_replays",
    "recovery-run --standalone --nproc-per-node 2 examples/ddp-tutorial/stock.py --epochs 6 --snapshot "
    "snapshot.pt --out final.pt":
        "tests/test_e2e_stock.py::test_the_documented_standalone_run_of_the_stock_script_completes_with_no_incident_and_its_log_replays",
    "recovery-run --standalone --nnodes 2 --nproc-per-node 2 --spares 1 --max-restarts 3 train.py":
        "tests/test_run_cli.py::test_torchruns_flags_under_both_spellings_make_the_job_spec",
    "recovery-run --nats-url nats://nats-0:4222 --nodes gpu-1,gpu-2 --nproc-per-node 8 --rdzv-endpoint "
    "store-0:29400 train.py":
        "tests/test_e2e_stock.py::test_a_sigkilled_rank_restarts_the_job_from_the_scripts_own_snapshot_and_ends_as_the_fault_free_run",
    "recovery-run --nats-url nats://nats-0:4222 --nodes gpu-1,gpu-2 --nproc-per-node 8 --rdzv-endpoint "
    "store-0:29400 --rdzv-id llama-7b train.py --config llama.yaml":
        "tests/test_run_cli.py::test_torchruns_flags_under_both_spellings_make_the_job_spec",
    "recovery-replay export --nats nats://localhost:4222 --job train-7 -o incident.jsonl":
        "tests/test_replay_live.py::test_a_job_export_of_the_live_log_verifies",
    "recovery-replay export --nats nats://localhost:4222 -o all.jsonl":
        "tests/test_replay_live.py::test_a_live_log_with_hostile_input_verifies",
    "recovery-replay report --nats nats://localhost:4222 --job llm --since 12h --until 2h --json > report.json":
        "tests/test_report.py::test_filters_by_job_and_time",
    "recovery-replay verify --nats nats://localhost:4222":
        "tests/test_replay_live.py::test_a_live_log_with_hostile_input_verifies",
    "recovery-daemon": "tests/test_daemon_process.py::test_embedded_nats_server_starts_and_stops_with_the_daemon",
    "recovery-daemon --nats-url nats://nats-0:4222,nats://nats-1:4222 --config /etc/recovery/daemon.toml":
        "tests/test_daemon.py::test_config_flags_win_over_environment_over_file",
    "curl -s localhost:9464/readyz; curl -s localhost:9464/metrics | grep recovery_":
        "tests/test_daemon.py::test_http_endpoints_and_metrics",
    "recovery-ctl jobs": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl nodes": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl incidents --all": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl submit docs/job.json": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl inject process.exited --job llama-7b --data '{\"rank\": 3, \"exit_code\": 139}'":
        "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl scale llama-7b 4": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl pause llama-7b": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl resume llama-7b": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl cancel llama-7b": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl cancel llama-7b --grace 30 --signal SIGINT": "tests/test_daemon.py::test_ctl_verbs_and_the_cli",
    "recovery-ctl release llama-7b gpu-2 --device 3 --reason \"HBM replaced\"":
        "tests/test_isolation.py::test_an_operator_releases_an_isolated_device_and_only_an_isolated_one",
    "recovery-ctl --timeout 5 status":
        "tests/test_tools_timeouts.py::test_ctl_with_nats_but_no_daemon_exits_with_its_own_code",
    "recovery-agent --node n0 --nats-url nats://nats-0:4222":
        "tests/test_agent_startup.py::test_an_agent_waits_for_nats_then_for_the_streams_then_reports_its_node",
    "recovery-agent --node n0 --links ib0,ib1 --kernel-log /dev/kmsg":
        "tests/test_agent_probes.py::test_a_veth_taken_down_in_the_agents_namespace_is_published_and_decided_on",
    "python tools/bench.py policies --seeds 3": "tests/test_bench_smoke.py::test_bench_quick_prints_json_metrics",
    "python tools/bench.py storm":
        "tests/test_storm.py::test_the_default_never_fails_and_leads_every_profile_through_short_storms",
    "pip install -e examples/policy-plugin": "tests/test_plugin.py::test_an_installed_plugin_policy_drives_a_job",
    f"{SIM} --policy rescheduling=example-in-place-first:deadline_s=90 --log plugin.jsonl":
        "tests/test_plugin.py::test_the_simulator_runs_an_installed_plugin_on_the_same_faults",
}


def documented_commands() -> Iterator[tuple[Path, str]]:
    for path in DOCS:
        for command in shell_commands(path.read_text()):
            yield path, command


def test_every_documented_command_is_run_here_or_by_a_named_test() -> None:
    unrun = [f"{path.relative_to(ROOT)}: {command}" for path, command in documented_commands()
             if command not in RUN_HERE and command not in COVERED_ELSEWHERE]
    assert not unrun, "commands in the docs that no test runs (add to RUN_HERE or COVERED_ELSEWHERE):\n" + \
        "\n".join(unrun)
    documented = {command for _, command in documented_commands()}
    stale = sorted((set(RUN_HERE) | set(COVERED_ELSEWHERE)) - documented)
    assert not stale, f"listed here but in no document: {stale}"


def test_the_tests_named_for_documented_commands_exist() -> None:
    for command, where in COVERED_ELSEWHERE.items():
        file, name = where.split("::")
        source = (ROOT / file).read_text()
        assert re.search(rf"^(async )?def {re.escape(name)}\(", source, re.MULTILINE), f"{where} ({command})"


@pytest.mark.parametrize("doc", [path for path in DOCS if any(c in RUN_HERE for c in shell_commands(path.read_text()))],
                         ids=lambda path: path.name)
def test_the_documented_commands_run(doc: Path, tmp_path: Path) -> None:
    for folder in ("tests", "examples", "docs"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "200"}
    for command in shell_commands(doc.read_text()):
        if command not in RUN_HERE:
            continue
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == RUN_HERE[command], f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


# -- every link resolves ------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor a heading gets when the markdown is rendered: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)  # links in code are not links
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_recovery_run_md_says_the_default_ladder_restarts_a_stock_script_whole_at_once() -> None:
    """What the default ladder does with a stock script's crash, as the golden log of one recorded it, is what
    docs/recovery-run.md says: straight to `restart_job`, no rank restarted alone first."""
    from recovery.report import build_report, iter_file

    report = build_report(iter_file(ROOT / "tests" / "golden" / "stock_script_restarts_whole.jsonl"))
    [incident] = report["jobs"][0]["incidents"]
    assert {a["granularity"] for a in incident["attempts"]} == {"restart_job"}
    assert all(a["policy"].startswith("ladder@") for a in incident["attempts"])
    doc = " ".join((ROOT / "docs" / "recovery-run.md").read_text().split())
    assert "goes straight to `restart_job`" in doc
    assert "first restarts the dead rank alone" not in doc


def test_ml_engineer_md_gives_the_timeout_the_tutorial_uses_and_the_default_the_sdk_has() -> None:
    import ast

    # read, not imported: the SDK's module imports torch
    tree = ast.parse((ROOT / "recovery" / "client" / "ddp.py").read_text())
    [function] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_process_group"]
    names = [a.arg for a in function.args.args]
    value = function.args.defaults[names.index("timeout_s") - (len(names) - len(function.args.defaults))]
    assert isinstance(value, ast.Constant)
    default = float(value.value)
    used = re.search(r"init_process_group\(timeout_s=(\d+)\)", (ROOT / "examples" / "ddp-tutorial" /
                                                                  "with_sdk.py").read_text())
    assert used is not None
    guide = " ".join((ROOT / "docs" / "ml-engineer.md").read_text().split())
    assert f"`timeout_s` (default {default:g}; the tutorial's {used.group(1)}:" in guide
    assert f"The tutorial takes {used.group(1)} s" in guide
    assert "`os._exit(0)` is not needed" in guide and "Iterating a loader yourself is allowed" in guide

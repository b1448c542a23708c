"""A policy shipped as its own distribution (examples/policy-plugin) is found through the `recovery.policies`
entry points once installed, and a job that selects it by name gets it: its decisions name it `name@version`.

The session fixture pip-installs the example (without dependencies or build isolation, so it works offline) into a
directory of its own, from a copy of its source. Each job runs in a fresh interpreter with that directory on its path,
which reads the distribution's entry points as a daemon started after an install into its environment would; the
environment the other tests share is left as it was (they may run meanwhile, beside this module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recovery.sim.__main__ import parse_policy

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "policy-plugin"


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.fixture(scope="session")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of an interpreter that has the plugin installed."""
    root = tmp_path_factory.mktemp("plugin")
    source = root / "source"  # a build writes beside the sources: a copy keeps the repository clean
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    result = _pip("install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(root / "site"),
                  str(source))
    if result.returncode != 0:
        pytest.fail(f"pip could not install {PLUGIN}:\n{result.stdout}\n{result.stderr}")
    assert (root / "site" / "recovery_example_plugin").is_dir()
    path = os.pathsep.join(p for p in (str(root / "site"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


SCRIPT = textwrap.dedent("""
    import json
    from policies import registry
    from recovery.testing import Scenario

    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8,
             policies={"rescheduling": {"name": "example-in-place-first", "params": {"deadline_s": 90}}})
    s.train("llm", 5)
    s.checkpoint("llm", 5, "storage", "storage")
    s.job_event("llm", "process.exited", rank=3, exit_code=139)
    s.ack_all()
    s.advance(1)
    s.train("llm", 2)
    print(json.dumps({
        "available": sorted(registry.available()),
        "labels": s.engine.jobs["llm"].policies.labels,
        "decisions": [[d.kind, d.policy, d.detail.get("granularity")] for d in s.decisions],
        "state": s.state("llm"),
    }))
""")


def test_an_installed_plugin_policy_drives_a_job(installed_plugin: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False,
                          env=installed_plugin)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "example-in-place-first" in out["available"]
    assert out["labels"]["rescheduling"] == "example-in-place-first@1"
    started = [d for d in out["decisions"] if d[0] == "attempt.started"]
    assert started == [["attempt.started", "example-in-place-first@1", "in_place"]]
    assert ["incident.closed", None, "in_place"] in out["decisions"]
    assert out["state"] == "running"


def test_the_plugins_own_tests_pass_the_policy_contract(installed_plugin: dict[str, str]) -> None:
    """What its README tells an author to run: the plugin's tests, which subclass recovery.testing's contract."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=PLUGIN,
                          capture_output=True, text=True, timeout=600, check=False, env=installed_plugin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TestInPlaceFirst" not in proc.stdout  # nothing failed, and no test was skipped
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


def test_the_plugin_is_a_separate_distribution() -> None:
    pyproject = (PLUGIN / "pyproject.toml").read_text()
    assert 'name = "recovery-example-plugin"' in pyproject
    assert '[project.entry-points."recovery.policies"]' in pyproject
    assert 'example-in-place-first = "recovery_example_plugin:InPlaceFirst"' in pyproject


def test_the_simulator_runs_an_installed_plugin_on_the_same_faults(installed_plugin: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """A policy author compares a plugin with the built-ins from the command line, without reading the simulator."""
    log = tmp_path / "run.jsonl"
    run = [sys.executable, "-m", "recovery.sim", "run", "--gpus", "1024", "--days", "7", "--seed", "1", "--json"]
    proc = subprocess.run([*run, "--policy", "rescheduling=example-in-place-first:deadline_s=90", "--log", str(log)],
                          capture_output=True, text=True, timeout=300, check=False, env=installed_plugin)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["profile"] == "default+rescheduling=example-in-place-first"
    chosen = [json.loads(line)["envelope"]["data"]["policy"] for line in log.read_text().splitlines()
              if '"kind":"attempt.started"' in line]
    assert chosen and set(chosen) <= {"example-in-place-first@1", None}
    bad = subprocess.run([*run, "--policy", "rescheduling=example-in-place-first:deadline=1"], capture_output=True,
                         text=True, timeout=120, check=False, env=installed_plugin)
    assert bad.returncode == 2 and "example-in-place-first" in bad.stderr and "deadline" in bad.stderr


def test_policy_overrides_are_parsed_as_json_values_or_strings() -> None:
    family, ref = parse_policy('checkpoint=newest-complete:dying_wait_s=10,tiers=["storage","dying"],peer=false')
    assert family == "checkpoint" and ref.name == "newest-complete"
    assert ref.params == {"dying_wait_s": 10, "tiers": ["storage", "dying"], "peer": False}
    assert parse_policy("detection=my-probe:mode=strict")[1].params == {"mode": "strict"}
    with pytest.raises(ValueError, match="FAMILY=NAME"):
        parse_policy("scheduling=ladder")

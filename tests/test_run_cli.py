"""`recovery-run`'s command line: torchrun's flags under both spellings, and the job spec they make."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from events.values import JobSpec
from recovery.cli.run import EXIT_USAGE, UsageError, build_parser, build_spec, main, nodes_count


def spec_of(argv: list[str], nodes: list[str], store: tuple[str, int] = ("store-0", 29400),
            rendezvous: str = "external") -> dict[str, object]:
    spec = build_spec(build_parser().parse_args(argv), nodes, store, rendezvous)
    JobSpec.model_validate(spec)  # what the daemon will accept
    return spec


def test_torchruns_flags_under_both_spellings_make_the_job_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for argv in (["--nproc-per-node", "4", "--max-restarts", "3", "train.py", "--lr", "0.1"],
                 ["--nproc_per_node", "4", "--max_restarts", "3", "train.py", "--lr", "0.1"]):
        spec = spec_of(argv, ["a", "b"])
        assert spec["nodes"] == ["a", "b"] and spec["ranks_per_node"] == 4 and spec["layout"] == {"dp": 8}
        assert spec["max_restarts"] == 3
        entrypoint = spec["entrypoint"]
        assert isinstance(entrypoint, dict)
        assert entrypoint["command"] == sys.executable and entrypoint["args"] == ["train.py", "--lr", "0.1"]
        assert entrypoint["env"] == {"MASTER_ADDR": "store-0", "MASTER_PORT": "29400", "OMP_NUM_THREADS": "1"}
        assert entrypoint["rendezvous"] == "external" and entrypoint["cwd"]


def test_a_module_a_program_and_the_spec_file_the_flags_complete(tmp_path: Path) -> None:
    assert spec_of(["-m", "pkg.train", "--x"], ["a"])["entrypoint"]["args"] == ["-m", "pkg.train", "--x"]  # type: ignore[index]
    program = spec_of(["--no-python", "./run.sh", "1"], ["a"])["entrypoint"]
    assert program["command"] == "./run.sh" and program["args"] == ["1"]  # type: ignore[index]
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"job": "ignored", "layout": {"dp": 1, "tp": 2},
                                "policies": {"detection": {"name": "default", "params": {"hang_min_silence_s": 60}}},
                                "entrypoint": {"command": "x", "env": {"NCCL_DEBUG": "INFO"}}}))
    spec = spec_of(["--spec", str(base), "--nproc-per-node", "2", "--env", "A=1", "train.py"], ["a", "b"])
    assert spec["layout"] == {"dp": 2, "tp": 2}
    assert spec["policies"] == {"detection": {"name": "default", "params": {"hang_min_silence_s": 60}}}
    env = spec["entrypoint"]["env"]  # type: ignore[index]
    assert env["NCCL_DEBUG"] == "INFO" and env["A"] == "1" and env["MASTER_PORT"] == "29400"
    assert "job" not in spec and "max_restarts" not in spec


def test_what_recovery_run_cannot_do_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="elastic"):
        nodes_count(build_parser().parse_args(["--nnodes", "1:4", "train.py"]))
    assert nodes_count(build_parser().parse_args(["--nnodes", "2:2", "train.py"])) == 2
    assert main(["train.py"]) == EXIT_USAGE
    assert "--standalone, or --nats-url" in capsys.readouterr().err
    assert main(["--nats-url", "nats://127.0.0.1:1", "train.py"]) == EXIT_USAGE
    assert "--nodes" in capsys.readouterr().err
    assert main(["--nats-url", "nats://127.0.0.1:1", "--nodes", "a", "--nnodes", "2", "train.py"]) == EXIT_USAGE
    assert main(["--standalone", "--rdzv-id", "a.b", "train.py"]) == EXIT_USAGE
    assert "--rdzv-id" in capsys.readouterr().err


def test_a_script_that_is_not_there_or_a_bad_flag_exits_2_at_once_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    missing = str(tmp_path / "trian.py")
    assert main(["--standalone", "--data-dir", str(data), missing]) == EXIT_USAGE
    assert f"{missing}: no such script" in capsys.readouterr().err
    assert not data.exists(), "no stack was started for it"
    script = tmp_path / "train.py"
    script.write_text("")
    for argv, said in ((["--nproc-per-node", "two"], "--nproc-per-node"), (["--env", "NOVALUE"], "--env"),
                       (["--spares", "-1"], "--spares"), (["--max-restarts", "-2"], "--max-restarts"),
                       (["--spec", str(tmp_path / "nospec.json")], "nospec.json"),
                       (["--no-python"], "no such program")):
        assert main(["--standalone", "--data-dir", str(data), *argv, str(script)]) == EXIT_USAGE, argv
        assert said in capsys.readouterr().err, argv
        assert not data.exists(), argv
    assert main(["--nats-url", "nats://127.0.0.1:1", "--nodes", "a", missing]) == EXIT_USAGE
    assert "no such script" in capsys.readouterr().err

"""`recovery-run`'s command line: torchrun's flags under both spellings, and the job spec they make."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from events.values import JobSpec
from recovery.cli.follow import JobFollower
from recovery.cli.run import EXIT_NO_CONTROL_PLANE, EXIT_USAGE, UsageError, build_parser, build_spec, main, nodes_count

ROOT = Path(__file__).resolve().parents[1]


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


def test_shards_declare_the_distinct_state_of_a_sharded_job(tmp_path: Path) -> None:
    # FSDP on a 1-D mesh of 4 ranks: no replica; HSDP of 2 x 2: two replicas of two shards
    assert spec_of(["--nproc-per-node", "2", "--shards", "4", "train.py"], ["a", "b"])["layout"] == {"dp": 1, "tp": 4}
    assert spec_of(["--nproc-per-node", "2", "--shards", "2", "train.py"], ["a", "b"])["layout"] == {"dp": 2, "tp": 2}
    base = tmp_path / "pp.json"
    base.write_text(json.dumps({"layout": {"pp": 2}}))
    assert spec_of(["--spec", str(base), "--nproc-per-node", "4", "--shards", "4", "train.py"],
                   ["a"])["layout"] == {"dp": 1, "tp": 2, "pp": 2}
    with pytest.raises(UsageError, match="disagrees"):
        spec_of(["--spec", str(base), "--nproc-per-node", "4", "--shards", "3", "train.py"], ["a"])
    with pytest.raises(UsageError, match="not a multiple"):
        spec_of(["--nproc-per-node", "2", "--shards", "3", "train.py"], ["a", "b"])


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


def test_a_data_dir_that_cannot_be_made_exits_4_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be made under a file, whoever runs the test (root included)
    assert main(["--standalone", "--data-dir", str(blocker / "data"), str(script)]) == EXIT_NO_CONTROL_PLANE
    err = capsys.readouterr().err
    assert "--data-dir" in err and str(blocker / "data") in err
    assert "starting" not in err, "nothing was started for a directory that cannot hold it"


def test_the_ranks_environment_table_names_every_variable_the_agent_sets(tmp_path: Path) -> None:
    """docs/recovery-run.md's table of the ranks' environment holds every variable `ranks.environment` sets."""
    from events.values import Entrypoint, ResumePlan
    from recovery.agent.ranks import Placement, environment

    placement = Placement(rank=1, local_rank=1, world_size=2, local_world_size=2, group_rank=0, group_world_size=1)
    env = environment(Entrypoint(command="python"), placement, job="j", node="n0", attempt=1,
                      plan=ResumePlan(checkpoint_step=None, next_step=0), store_addr="h", store_port=1, torch_port=2,
                      socket=tmp_path / "s", heartbeat_s=1.0, memory_dir=tmp_path / "m", error_file=tmp_path / "e")
    table = (ROOT / "docs" / "recovery-run.md").read_text().split("## The ranks' environment")[1].split("\n## ")[0]
    documented = set(re.findall(r"`([A-Z][A-Z_]+)`", table))
    missing = sorted(set(env) - set(os.environ) - documented)
    assert not missing, f"set for every rank but not in docs/recovery-run.md: {missing}"
    assert "RECOVERY_STANDBY" in documented, "the standby choice a stock script needs (`all`) is said there"


def _decision(kind: str, reason: str = "", **detail: object) -> dict[str, object]:
    return {"kind": kind, "reason": reason, "state": "recovering", "detail": detail}


def test_recovery_run_prints_the_step_of_the_progress_reports_and_measures_a_stock_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("recovery.cli.follow.time.monotonic", lambda: clock[0])
    sdk = JobFollower("sdk", out=io.StringIO(), started=100.0)
    sdk.on_event({"type": "progress.report", "data": {"ranks": [{"rank": 0, "step": 1973, "attempt": 0},
                                                                {"rank": 1, "step": 1972, "attempt": 0}]}})
    clock[0] = 111.0
    sdk.tick()
    assert "step 1973" in sdk.out.getvalue()  # type: ignore[attr-defined]
    sdk.on_decision(_decision("checkpoint.dying_failed", "no ack for the dying checkpoint in time"))
    sdk.on_decision(_decision("incident.closed", "step 1974 past the resume point", mttr_ns=4_100_000_000,
                              lost_steps=0))
    said = sdk.out.getvalue()  # type: ignore[attr-defined]
    assert "checkpoint.dying_failed" in said  # an SDK rank could have saved one: its failure is news
    assert "recovered in 4.1s (to the first step past the resume point)" in said

    clock[0] = 100.0
    stock = JobFollower("stock", out=io.StringIO(), started=100.0)
    stock.on_decision(_decision("fault.confirmed", "rank 1: SIGKILL"))
    stock.on_decision(_decision("checkpoint.dying_failed", "no live rank of [0] on node0 could be asked to save"))
    stock.on_decision(_decision("checkpoint.plan", "no complete checkpoint: start from step 0", checkpoint_step=None,
                                next_step=0))
    stock.on_decision(_decision("ranks.rescheduling", "restart_job: 1 command(s)", generation=1))
    clock[0] = 106.5
    stock.on_event({"type": "process.output", "data": {"rank": 0, "attempt": 1}})
    clock[0] = 131.0
    stock.on_decision(_decision("incident.closed", "the 2 restarted process(es) ran 30 s without exiting",
                                mttr_ns=31_000_000_000))
    said = stock.out.getvalue()  # type: ignore[attr-defined]
    assert "dying" not in said, "no rank of a stock script could ever save one"
    assert "step 0" not in said and "the script's own snapshot" in said
    assert "running again 6.5s after the fault (to a restarted rank's first output" in said
    assert "recovered in" not in said and "incident closed: the 2 restarted process(es) ran 30 s" in said


def test_a_rank_restarted_alone_is_said_to_take_its_state_from_a_live_replica() -> None:
    """A job whose ranks re-form in process (`reform`: the DDP SDK, Lightning's and Accelerate's integrations, HSDP)
    restarts a rank alone, which takes its state from the survivors: no snapshot of the script's is read, whatever
    checkpoints it reports; a restart of the whole job still resumes from them."""
    run = JobFollower("hsdp", out=io.StringIO(), started=100.0)
    run.on_event({"type": "process.capabilities", "data": {"rank": 0, "attempt": 0, "caps": ["reform", "steps"]}})
    run.on_event({"type": "progress.report", "data": {"ranks": [{"rank": 0, "step": 23, "attempt": 0}]}})
    run.on_decision(_decision("fault.confirmed", "rank 1: SIGKILL"))
    run.on_decision(_decision("attempt.started", "process fault, rung 0: in_place", granularity="in_place"))
    run.on_decision(_decision("checkpoint.plan", "every shard has a live replica at step 23", checkpoint_step=23))
    run.on_decision(_decision("attempt.started", "process fault, rung 2: restart_job", granularity="restart_job"))
    run.on_decision(_decision("checkpoint.plan", "no complete checkpoint", checkpoint_step=None))
    said = run.out.getvalue()  # type: ignore[attr-defined]
    alone, whole = said.split("restart_job", 1)
    assert "take their state from a live replica; the others keep theirs" in alone and "snapshot" not in alone
    assert "live replica" not in whole and "the script's own snapshot" in whole, said


@pytest.mark.parametrize("grace_first", [False, True])
def test_recovery_run_times_a_counted_stock_restart_to_its_first_optimizer_step(
        monkeypatch: pytest.MonkeyPatch, grace_first: bool) -> None:
    """The step hook counts a stock script's optimizer steps: its restart is said once, at a restarted process's
    first counted step (the incident's close, or a step after the ladder's grace closed it), never at the first
    output, and with no resume point or steps lost the script never reported."""
    clock = [100.0]
    monkeypatch.setattr("recovery.cli.follow.time.monotonic", lambda: clock[0])
    run = JobFollower("hooked", out=io.StringIO(), started=100.0)
    run.on_event({"type": "process.capabilities", "data": {"rank": 0, "attempt": 0, "caps": ["counts"]}})
    run.on_event({"type": "progress.report", "data": {"ranks": [{"rank": 0, "step": 40, "attempt": 0}]}})
    run.on_decision(_decision("fault.confirmed", "rank 1: SIGKILL"))
    run.on_decision(_decision("checkpoint.plan", "no complete checkpoint: start from step 0", checkpoint_step=None))
    run.on_decision(_decision("ranks.rescheduling", "restart_job: 1 command(s)", generation=1))
    clock[0] = 102.0
    run.on_event({"type": "process.output", "data": {"rank": 0, "attempt": 1}})  # torch's import: no training yet
    if grace_first:
        clock[0] = 104.0
        run.on_decision(_decision("incident.closed", "the 2 restarted process(es) ran 2 s without exiting"))
    clock[0] = 107.5
    run.on_event({"type": "progress.report", "data": {"ranks": [{"rank": 1, "step": 1, "attempt": 1}]}})
    if not grace_first:
        run.on_decision(_decision("incident.closed", "progress: 1 optimizer step(s) counted in the restarted "
                                                     "processes", mttr_ns=7_400_000_000, lost_steps=None))
    said = run.out.getvalue()  # type: ignore[attr-defined]
    assert said.count("running again") == 1 and "running again 7.5s after the fault (to a restarted rank's first " \
                                                "optimizer step" in said, said
    assert "step 0" not in said and "the script's own snapshot" in said and "lost" not in said.replace(
        "the steps lost are the script's to say", ""), said
    assert run.recovered_s == [7.5]


def test_recovery_run_times_a_restart_from_when_the_fault_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang its agent saw 12 s after the rank stopped, and an agent silent past its 5 s bound: each restart is
    timed from when the fault began, not from its confirmation."""
    clock = [100.0]
    monkeypatch.setattr("recovery.cli.follow.time.monotonic", lambda: clock[0])
    run = JobFollower("hang", out=io.StringIO(), started=100.0)
    run.on_event({"type": "process.hang", "data": {"rank": 1, "attempt": 0, "seconds_without_progress": 12.0}})
    clock[0] = 101.0
    run.on_decision(_decision("fault.confirmed", "rank 1 hangs: stopped (state T: SIGSTOP) for 12 s",
                              fault={"class": "hang", "ranks": [1]}))
    run.on_decision(_decision("ranks.rescheduling", "restart_job: 1 command(s)", generation=1))
    clock[0] = 110.0
    run.on_event({"type": "process.output", "data": {"rank": 0, "attempt": 1}})
    assert "running again 22.0s after the fault" in run.out.getvalue()  # type: ignore[attr-defined]

    clock[0] = 200.0
    lost = JobFollower("lost", out=io.StringIO(), started=200.0)
    lost.on_decision(_decision("fault.confirmed", "agent of n1 silent for more than 5s: the host or its agent is gone",
                               fault={"class": "node", "ranks": [2, 3]}))
    lost.on_decision(_decision("ranks.rescheduling", "restart_job: 1 command(s)", generation=1))
    clock[0] = 209.0
    lost.on_event({"type": "process.output", "data": {"rank": 0, "attempt": 1}})
    assert "running again 14.0s after the fault" in lost.out.getvalue()  # type: ignore[attr-defined]

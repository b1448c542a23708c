"""`recovery-replay whatif` and `diff`: other policies over a golden log's faults, and two logs' decisions side by
side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recovery.cli.replay import main
from recovery.log import write_file
from recovery.report.diff import diff_logs
from recovery.report.source import iter_file
from recovery.report.whatif import whatif
from tests.golden.scenarios import _ttp

GOLDEN = Path(__file__).parent / "golden"


def test_whatif_under_torchelastic_restarts_the_whole_job_where_ours_moved_one_node(tmp_path: Path) -> None:
    """pod_level_reschedule: XID 79 on n2. Our ladder moves n2's ranks to the spare; torchelastic-like restarts every
    worker. Only the fault is kept from the log; the simulator answers every command of both runs."""
    result = whatif(GOLDEN / "pod_level_reschedule.jsonl", ["rescheduling=torchelastic-like-rescheduling"],
                    model_params=1e9, keep_logs=tmp_path)
    assert result["inputs"]["kept"] == {"device.fault": 1}
    assert result["inputs"]["resimulated"]["command.ack"] == 2  # the acks of the recorded stop and migration
    assert result["inputs"]["resimulated"]["progress.step"] > 100
    first = result["diff"]["first_decision_difference"]
    ours, theirs = first["recorded policies"], first["what-if"]
    assert ours["kind"] == theirs["kind"] == "attempt.started"
    assert ours["detail"]["granularity"] == "migrate" and ours["detail"]["vacate"] == ["n2"]  # recorded node names
    assert theirs["detail"]["granularity"] == "restart_job" and theirs["policy"].startswith("torchelastic-like")
    restarts = result["simulated"]["what-if"]["restarts"]
    assert set(restarts) == {"restart_job"} and set(result["simulated"]["recorded policies"]["restarts"]) == {"migrate"}
    # a job-level restart stops 8 ranks and recreates every pod (70 s) where the move recreated one (also 70 s in the
    # cost model) but stopped one rank: the whole job waits longer, so it loses more
    assert result["delta"]["lost_gpu_hours"] > 0 and result["delta"]["ettr"] < 0
    assert result["delta"]["mttr_p50_s"]["device"] > 0
    assert len(result["logs"]) == 2 and all(Path(p).exists() for p in result["logs"])


def test_whatif_cli_prints_kept_and_resimulated_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(GOLDEN / "recover_in_place_fallback.jsonl"), "--policy",
                 "rescheduling=torchelastic-like-rescheduling", "--model-params", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "kept from the log (1 faults): process.exited 1" in out
    assert "re-simulated" in out and "command.ack" in out
    assert "ETTR" in out and "lost GPU-hours" in out and "MTTR p50" in out


def test_whatif_of_a_policy_that_is_not_installed_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(GOLDEN / "pod_level_reschedule.jsonl"), "--policy", "rescheduling=no-such"]) == 2
    assert "no-such" in capsys.readouterr().err


def test_diff_finds_a_changed_policy_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same scenario twice, once with the checkpoint policy's `peer: false`: rank 2 is killed; the default takes
    the state from a live replica, the other has a replica save a dying checkpoint first."""
    a, b = tmp_path / "peer.jsonl", tmp_path / "no-peer.jsonl"
    write_file(a, list(_ttp("x", 2, peer=True).log.records()))
    write_file(b, list(_ttp("x", 2, peer=False).log.records()))
    diff = diff_logs(iter_file(a), iter_file(b))
    [changed] = diff["policies"]
    assert changed["family"] == "checkpoint" and changed["changed"] == ["params.peer"]
    assert changed["B"]["params"] == {"peer": False}
    first = diff["first_decision_difference"]
    assert first["A"]["kind"] == "checkpoint.plan" and first["A"]["detail"]["tiers"] == {"peer": 1}
    assert first["B"]["kind"] == "checkpoint.dying" and first["B"]["commands"] == ["save_checkpoint"]
    assert first["A"]["cause"] == first["B"]["cause"] and "process.exited" in first["A"]["cause"]
    assert diff["first_input_difference"] is not None  # after the decisions part, the cluster answered differently
    assert main(["diff", str(a), str(b), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["policies"][0]["changed"] == ["params.peer"]
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "checkpoint policy differs (params.peer)" in out and "checkpoint.dying" in out


def test_diff_of_a_log_with_itself_is_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    log = str(GOLDEN / "recover_in_place_fallback.jsonl")
    assert main(["diff", log, log]) == 0
    assert "same decisions" in capsys.readouterr().out


def test_whatif_takes_the_model_size_from_the_recorded_layout_not_a_405b_default() -> None:
    """pod_level_reschedule is an 8-GPU job at tp 2: a 10B-parameter model at most, whose state moves in seconds;
    a 405B default made its simulated MTTR 188.5 s where the log has 21 s."""
    result = whatif(GOLDEN / "pod_level_reschedule.jsonl", ["rescheduling=torchelastic-like-rescheduling"])
    assert result["cluster"]["model_params"] == pytest.approx(2 * 80e9 / 16)
    assert result["cluster"]["model_params_from"] == "layout"
    mttr = result["simulated"]["recorded policies"]["mttr_by_fault_class"]["device"]["p50_s"]
    assert mttr < 120
    given = whatif(GOLDEN / "pod_level_reschedule.jsonl", ["rescheduling=torchelastic-like-rescheduling"],
                   model_params=405e9)
    assert given["cluster"]["model_params_from"] == "--model-params"
    assert given["simulated"]["recorded policies"]["mttr_by_fault_class"]["device"]["p50_s"] > mttr


def test_whatif_of_a_partitioned_log_gives_the_job_only_its_partitions_spares() -> None:
    """move_skips_broken_spare: spares s0 (whose device fails) and s1. Under 4 partitions job llm is partition 0's and
    both spares other partitions' (s0: 2, s1: 1): the recorded engine could grant neither, so the simulated cluster
    has no spare, and s0's fault, which never reached the job, is not replayed on a node of the job."""
    log = GOLDEN / "move_skips_broken_spare.jsonl"
    whole = whatif(log, ["rescheduling=torchelastic-like-rescheduling"], tail_s=60)
    assert whole["cluster"]["spares"] == 2 and whole["cluster"]["partition"] is None
    assert whole["inputs"]["kept"] == {"device.fault": 2}
    split = whatif(log, ["rescheduling=torchelastic-like-rescheduling"], tail_s=60, partitions=4)
    assert split["cluster"]["spares"] == 0 and split["cluster"]["partition"] == {"index": 0, "count": 4}
    assert split["inputs"]["kept"] == {"device.fault": 1} and split["inputs"]["resimulated"]["device.fault"] == 1
    assert [f["from"] for f in split["inputs"]["fault_list"]] == ["device.fault XID 48 (seq 77)"]  # n1's, the job's
    two = whatif(log, ["rescheduling=torchelastic-like-rescheduling"], tail_s=60, partitions=2)
    assert two["cluster"]["spares"] == 1  # s0 is partition 0's of 2, as llm is; s1 is partition 1's

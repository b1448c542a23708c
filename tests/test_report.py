"""`recovery-replay report` on golden logs: every field checked against numbers worked out by hand from the log's
own timestamps (each golden's job starts at log time 1767225600 s; the arithmetic is in the comments)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from events import subjects
from events.envelope import make_envelope
from recovery.cli.replay import main
from recovery.log import iter_numbered
from recovery.log.jetstream import JetStreamLog
from recovery.report import REPORT_VERSION, build_report, iter_file
from recovery.report.html import render_html
from recovery.sim.config import Cluster, SimConfig
from recovery.sim.sim import simulate
from recovery.testing.nats import NatsServer

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"


def report_of(name: str, **filters: Any) -> dict[str, Any]:
    return build_report(iter_file(GOLDEN / f"{name}.jsonl"), **filters)


def only_incident(report: dict[str, Any]) -> dict[str, Any]:
    [job] = report["jobs"]
    [incident] = job["incidents"]
    return incident


def phase_seconds(incident: dict[str, Any]) -> list[tuple[str, float]]:
    return [(p["phase"], p["seconds"]) for p in incident["phases"]]


def test_migration_with_peer_plan_by_hand() -> None:
    """pod_level_reschedule: XID 79 on n2 device 1 (seq 134 at +15 s) is confirmed by the same record (seq 135,
    +15 s); its ranks move to spare0 with state from live replicas; the first step past 15 arrives at +36 s."""
    report = report_of("pod_level_reschedule")
    inc = only_incident(report)
    assert inc["fault_class"] == "node" and inc["cause"] == "fault"
    assert [f["code"] for f in inc["root_faults"]] == ["XID 79"]
    assert inc["root_faults"][0]["nodes"] == ["n2"] and inc["root_faults"][0]["device"] == 1
    assert inc["first_failing_rank"] == 5  # n2 holds ranks 4 and 5 (2 per node); device 1 is rank 5
    assert inc["first_signal_s"] == 15.0  # 1767225615 - 1767225600
    assert inc["detection_latency_s"] == 0.0  # confirmed at 1767225615 (seq 135) - signal 1767225615 (seq 134)
    assert inc["decision_latency_s"] == 0.0  # stop_ranks (seq 138) sent at 1767225615, the confirmation's time
    # planning, stopping and rescheduling all at 1767225615 (seqs 135-141); restoring 1767225615 (seq 143) until the
    # close at 1767225636 (seq 149): 36 - 15 = 21 s
    assert phase_seconds(inc) == [("detection", 0.0), ("planning", 0.0), ("stopping", 0.0), ("rescheduling", 0.0),
                                  ("restoring", 21.0)]
    assert inc["granularity"] == "migrate" and inc["escalations"] == []
    assert inc["attempts"][0]["vacate"] == ["n2"] and inc["attempts"][0]["policy"] == "ladder@8"
    assert inc["checkpoint"]["tiers"] == {"peer": 2} and inc["checkpoint"]["checkpoint_step"] == 15
    assert inc["checkpoint"]["next_step"] == 16 and inc["lost_steps"] == 0
    assert inc["ttr_s"] == 21.0 and inc["recovery_s"] == 21.0  # 1767225636 - 1767225615
    assert inc["lost_gpu_hours_by_phase"] == {"restoring": 0.047}  # 21 s x 8 GPUs / 3600 = 0.04667
    job = report["jobs"][0]
    assert job["gpus"] == 8 and job["wall_s"] == 37.0  # job.started 1767225600 to the last record 1767225637
    assert job["ettr"] == pytest.approx(1 - 21 / 37, abs=1e-6)  # 0.432432
    assert job["step_time_s"] == 1.0  # one step a second
    assert job["mttr_by_fault_class"]["node"]["p50_s"] == 21.0
    assert job["restarts_by_granularity"] == {"migrate": {"started": 1, "recovered": 1}}


def test_escalation_from_in_place_to_job_level_by_hand() -> None:
    """recover_in_place_fallback: rank 3 segfaults at +13 s at step 13; the in-place restart's command fails at once,
    the migration (sent at +13 s) misses its 300 s deadline at +313 s, the job-level restart stops the job by +314 s
    and the first step past the storage checkpoint of step 10 arrives at +345 s."""
    inc = only_incident(report_of("recover_in_place_fallback"))
    assert inc["fault_class"] == "process" and inc["first_failing_rank"] == 3
    assert inc["root_faults"][0]["nodes"] == ["n0"]  # ranks 0-3 run on n0
    assert [a["granularity"] for a in inc["attempts"]] == ["in_place", "migrate", "restart_job"]
    assert inc["escalations"] == [
        {"from": "in_place", "to": "migrate", "after": "failed",
         "reason": "restart_ranks failed: CUDA context creation failed"},
        {"from": "migrate", "to": "restart_job", "after": "timed_out",
         "reason": "attempt 2 (migrate) missed its deadline"}]
    # rescheduling from the migration's command (seq 129, 1767225613) to its deadline (seq 131, 1767225913): 300 s;
    # stopping from seq 134 (1767225913) to the stop's ack (seq 136, 1767225914): 1 s; restoring from seq 139
    # (1767225914) to the close (seq 141, 1767225945): 31 s
    assert phase_seconds(inc) == [("detection", 0.0), ("planning", 0.0), ("rescheduling", 0.0), ("planning", 0.0),
                                  ("stopping", 0.0), ("rescheduling", 300.0), ("planning", 0.0), ("stopping", 1.0),
                                  ("rescheduling", 0.0), ("restoring", 31.0)]
    assert inc["ttr_s"] == 332.0  # 1767225945 - 1767225613
    assert inc["checkpoint"]["tiers"] == {"storage": 1} and inc["checkpoint"]["checkpoint_step"] == 10
    assert inc["lost_steps"] == 3  # struck at step 13, resumed after step 10
    # by phase, x 8 GPUs / 3600: rescheduling 300 s -> 0.667, restoring 31 s -> 0.069, stopping 1 s -> 0.002,
    # recompute 3 lost steps x 1 s -> 0.007; in all (300 + 31 + 1 + 3) x 8 / 3600 = 0.744
    assert inc["lost_gpu_hours_by_phase"] == {"rescheduling": 0.667, "stopping": 0.002, "restoring": 0.069,
                                              "recompute": 0.007}
    report = report_of("recover_in_place_fallback")
    job = report["jobs"][0]
    assert job["lost_s"] == 335.0 and job["wall_s"] == 346.0  # started 1767225600, last record 1767225946
    assert job["ettr"] == pytest.approx(1 - 335 / 346, abs=1e-6)  # 0.031792
    assert report["summary"]["restarts_by_granularity"] == {
        "in_place": {"started": 1, "failed": 1}, "migrate": {"started": 1, "timed_out": 1},
        "restart_job": {"started": 1, "recovered": 1}}


def test_dying_checkpoint_from_a_replica_by_hand() -> None:
    """power_off_checkpoint: rank 2 is SIGKILLed at +17 s (step 17); replica 0 saves a dying checkpoint of step 17
    (seq 85-88, all at +17 s); rank 2 restarts in place and the job makes step 18 at +23 s."""
    report = report_of("power_off_checkpoint")
    inc = only_incident(report)
    assert inc["first_failing_rank"] == 2 and inc["root_faults"][0]["nodes"] == ["ttp-n2"]
    assert inc["dying_checkpoint"] == {"step": 17, "how": "saved by replicas", "outcome": "done"}
    assert inc["checkpoint"]["tiers"] == {"dying": 1} and inc["checkpoint"]["next_step"] == 18
    assert phase_seconds(inc) == [("detection", 0.0), ("planning", 0.0), ("saving", 0.0), ("rescheduling", 0.0),
                                  ("restoring", 6.0)]  # restoring: 1767225623 - 1767225617
    assert inc["lost_steps"] == 0 and inc["granularity"] == "in_place"
    assert inc["lost_gpu_hours_by_phase"] == {"restoring": 0.007}  # 6 s x 4 GPUs / 3600 = 0.00667
    assert report["jobs"][0]["ettr"] == pytest.approx(1 - 6 / 24, abs=1e-6)  # wall 1767225600..1767225624


def test_dying_checkpoint_awaited_from_sigterm_by_hand() -> None:
    """sigterm_storm: every rank is SIGTERMed at +12 s; their handlers' dying checkpoint of step 12 lands at +12.5 s;
    the whole job restarts from it and makes step 13 at +33.5 s."""
    inc = only_incident(report_of("sigterm_storm"))
    assert inc["fault_class"] == "preemption" and inc["first_failing_rank"] == 0
    assert inc["root_faults"][0]["rank_count"] == 8
    assert inc["dying_checkpoint"] == {"step": 12, "how": "written by exiting ranks", "outcome": "done"}
    # saving from checkpoint.awaiting (seq 110, 1767225612.0) to checkpoint.dying_done (seq 120, 1767225612.5);
    # restoring from seq 124 (1767225612.5) to the close (seq 126, 1767225633.5)
    assert phase_seconds(inc) == [("detection", 0.0), ("planning", 0.0), ("saving", 0.5), ("rescheduling", 0.0),
                                  ("restoring", 21.0)]
    assert inc["ttr_s"] == 21.5 and inc["lost_steps"] == 0 and inc["granularity"] == "restart_job"


def test_every_decision_says_why() -> None:
    inc = only_incident(report_of("recover_in_place_fallback"))
    by_seq = {d["seq"]: d for d in inc["decisions"]}
    started = by_seq[124]  # the ladder's second rung, chosen because the in-place restart's command failed
    assert started["policy"] == "ladder@8" and started["rule"] == "process fault, rung 1: migrate"
    assert started["inputs"]["cause"]["type"] == "command.ack"
    assert started["inputs"]["cause"]["data"]["reason"] == "CUDA context creation failed"
    assert started["inputs"]["detail"]["vacate"] == ["n0"]
    plan = by_seq[120]
    assert plan["policy"] == "newest-complete@6" and plan["inputs"]["detail"]["tiers"] == {"storage": 1}
    assert by_seq[131]["policy"] == "engine" and by_seq[131]["inputs"]["cause"]["type"] == "timer.fired"


def test_restart_loop_and_lemon_of_a_crashing_rank() -> None:
    """restart_budget: rank 1 on k0 exits at steps 7, 8 and 8: the third incident struck before the job got past the
    step of the second (a loop), and k0 is in three incidents."""
    report = report_of("restart_budget")
    [job] = report["jobs"]
    assert [i["step_at_fault"] for i in job["incidents"]] == [7, 8, 8]
    assert [i["restart_loop"] for i in job["incidents"]] == [False, False, True]
    assert [i["outcome"] for i in job["incidents"]] == ["recovered", "recovered", "failed"]
    assert job["restart_loops"] == 1 and job["state"] == "failed"
    [lemon] = report["lemons"]
    assert lemon["node"] == "k0" and lemon["incidents"] == 3
    assert [h["incident"] for h in lemon["history"]] == ["flaky#1", "flaky#2", "flaky#3"]


def test_filters_by_job_and_time() -> None:
    full = report_of("restart_budget")
    assert report_of("restart_budget", job="other")["summary"]["incidents"] == 0
    # until 1767225625 s keeps the first two incidents (struck at +7 s and +20 s), not the third (+33 s)
    cut = report_of("restart_budget", until=1767225625 * 10**9)
    assert cut["summary"]["incidents"] == 2 and full["summary"]["incidents"] == 3
    late = report_of("restart_budget", since=1767225630 * 10**9)
    assert late["summary"]["incidents"] == 1 and late["notes"]


def test_json_output_is_the_versioned_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(GOLDEN / "pod_level_reschedule.jsonl"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["report"] == REPORT_VERSION == 1
    assert set(out) == {"report", "filters", "records", "span", "summary", "jobs", "never_ran", "lemons",
                        "health_checks_failed", "notes"}
    assert out["jobs"][0]["incidents"][0]["id"] == "llm#1"


def test_terminal_output_names_incidents_and_causes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(GOLDEN / "recover_in_place_fallback.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "llm#1" in out and "escalated in_place -> migrate (failed)" in out
    assert "CUDA context creation failed" in out


def test_unreadable_log_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "broken.jsonl"
    log.write_text((GOLDEN / "restart_budget.jsonl").read_text()[:500])
    assert main(["report", str(log)]) == 2
    assert "broken.jsonl:" in capsys.readouterr().err


async def test_report_streams_the_live_jetstream_log(nats_server: NatsServer) -> None:
    """The same report from the live stream: a golden log published record by record (so its sequences are the
    stream's), then read by `report --nats` as it arrives from the pull reader."""
    log = await JetStreamLog.connect(nats_server.url)
    try:
        for record in iter_numbered(GOLDEN / "restart_budget.jsonl"):
            await log.append(record[1].subject, record[1].envelope)
    finally:
        await log.close()
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "recovery.cli.replay", "report", "--nats", nats_server.url, "--json"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    live = json.loads(done.stdout)
    from_file = report_of("restart_budget")
    assert live["records"] == from_file["records"]
    [job] = live["jobs"]
    assert [i["step_at_fault"] for i in job["incidents"]] == [7, 8, 8]
    assert [i["restart_loop"] for i in job["incidents"]] == [False, False, True]
    assert [lemon["node"] for lemon in live["lemons"]] == ["k0"]
    # the stream's own clock stamped the records: what holds is the order, and each phase's sign
    assert all(p["seconds"] >= 0 for i in job["incidents"] for p in i["phases"])


def test_malformed_and_undecodable_inputs_are_skipped_not_fatal(tmp_path: Path) -> None:
    lines = (GOLDEN / "pod_level_reschedule.jsonl").read_text().splitlines()
    bad_step = json.loads(lines[10])
    bad_step["envelope"]["data"]["step"] = "eleven"  # the engine dead-letters this; the report skips it
    raw = {"seq": bad_step["seq"], "ts": bad_step["ts"], "subject": bad_step["subject"], "headers": {},
           "raw": "{not json"}
    log = tmp_path / "hostile.jsonl"
    log.write_text("\n".join([*lines[:10], json.dumps(bad_step), json.dumps(raw), *lines[11:]]) + "\n")
    report = build_report(iter_file(log))
    assert report["summary"]["incidents"] == 1 and report["jobs"][0]["incidents"][0]["ttr_s"] == 21.0
    assert any("malformed" in note for note in report["notes"])


def test_silence_is_detected_from_when_the_rank_was_last_heard() -> None:
    """watchdog_heartbeat: rank 5 reports step 20 at +20 s and then nothing; the others heartbeat; the watchdog's
    tick at +32 s confirms the silence (more than 10 s): detection took 32 - 20 = 12 s."""
    inc = only_incident(report_of("watchdog_heartbeat"))
    assert inc["fault_class"] == "hang" and inc["first_failing_rank"] == 5
    assert inc["first_signal_s"] == 20.0 and inc["opened_s"] == 32.0
    assert inc["detection_latency_s"] == 12.0
    assert inc["phases"][0] == {"phase": "detection", "start_s": 20.0, "seconds": 12.0}
    assert inc["ttr_s"] == 23.0  # first step past 20 at 1767225643 - silent since 1767225620


def test_report_of_a_simulated_week_matches_the_simulator(tmp_path: Path) -> None:
    """A week of the Llama 3 mix on 1,024 GPUs (seed 1): a host that went away is confirmed by its suspicion's timer,
    not found by silence (the simulated ranks report only at faults), so its detection is the platform's 40 s, and
    each incident's time to recovery is what the simulator itself measured from the fault's first signal."""
    log = tmp_path / "week.jsonl"
    result = simulate(SimConfig(cluster=Cluster(gpus=1024), days=7, seed=1), log_path=log)
    report = build_report(iter_file(log))
    [job] = report["jobs"]
    incidents = job["incidents"]
    assert len(incidents) == len(result.faults) == 3
    assert all(i["outcome"] == "recovered" for i in incidents)
    assert all(0 <= i["detection_latency_s"] <= 60 for i in incidents)
    assert job["step_time_s"] == pytest.approx(6.0, abs=0.05)  # Training().step_time_s, with checkpoint stalls
    # the simulator counts from the fault, the report from its first signal: equal unless the platform noticed late
    for inc, fault in zip(incidents, result.faults, strict=True):
        assert fault.ttr_s is not None
        assert inc["ttr_s"] <= fault.ttr_s + 0.001
        assert fault.ttr_s - inc["ttr_s"] <= 40.001  # a host's not-ready grace period at most


def test_dead_letters_and_policy_errors_count_against_their_job_in_every_rendering(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rescheduling plugin that raises on every call, and inputs the engine refuses: the built-in answers for the
    plugin and the inputs are dead-lettered, and the report must say both of the job they belong to, where the
    incidents alone would show nothing wrong."""
    from recovery.log import write_file
    from recovery.report.html import render_html
    from recovery.testing.scenario import Scenario
    from tests.test_poison import Flaky

    scenario = Scenario()
    scenario.submit("bad", ["a0"], ranks_per_node=2, dp=2)
    scenario.submit("good", ["b0"], ranks_per_node=2, dp=2)
    scenario.train("bad", 3)

    class Raising(Flaky):
        def call(self, family: str, method: str, argument: Any) -> Any:
            if family == "rescheduling":
                raise RuntimeError("plugin bug")
            return getattr(getattr(self.inner, family), method)(argument)

    scenario.engine.jobs["bad"].policies = Raising(scenario.engine.jobs["bad"].policies, 0).policy_set()
    scenario.job_event("bad", "process.exited", rank=1, exit_code=1)
    for _ in range(3):
        scenario.job_event("bad", "process.exited", rank=7, exit_code=1)  # no such rank: dead-lettered
    log = tmp_path / "log.jsonl"
    write_file(log, scenario.log.records())
    report = build_report(iter_file(log))
    bad, good = (next(j for j in report["jobs"] if j["job"] == name) for name in ("bad", "good"))
    assert bad["dead_letters_by_code"] == {"unknown_rank": 3}
    assert bad["policy_failures"] == 1 and bad["policy_errors"] == 1
    assert "plugin bug" in bad["first_policy_failures"][0]["reason"]
    assert good["dead_letters"] == 0 and good["policy_failures"] == 0
    assert report["summary"]["policy_errors"] == 1 and report["summary"]["policy_failures"] == 1
    assert report["summary"]["dead_letters"] == 3
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "3 dead letter(s)" in out and "a policy failed 1 time(s)" in out and "plugin bug" in out
    html = render_html(report)
    assert "3 of this job's inputs were dead-lettered" in html
    assert "a policy failed 1 time(s); the built-in answered" in html and "plugin bug" in html


# -- what is measured, and what is not ----------------------------------------------------------------------------
NS = 1_000_000_000


def _input(seq: int, ts: int, job: str, type_: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"seq": seq, "ts": ts, "subject": f"recovery.ev.job.{job}.{type_}", "headers": {},
            "envelope": {"id": f"{type_}-{seq}", "type": type_, "job": job, "source": "test", "schema": 1,
                         "data": data}}


def test_a_stock_scripts_restart_is_measured_to_its_first_output_and_it_resumes_from_its_own_snapshot() -> None:
    """The golden stock script's log with what its agents report of the last restart's processes: their starts and
    the first output of one. Its time to recovery runs from the fault's signal to that output (not to the close
    the ladder's 30 s grace makes), the grace after it is not lost, and its checkpoint is the script's own (the
    engine's plan says "step 0", which the script never resumed from)."""
    records = list(iter_file(GOLDEN / "stock_script_restarts_whole.jsonl"))
    rescheduled = [r for r in records if r["subject"].startswith("recovery.dec.")
                   and r["envelope"]["data"]["kind"] == "ranks.rescheduling"][-1]
    generation = rescheduled["envelope"]["data"]["detail"]["generation"]
    at = rescheduled["ts"]
    added = [_input(10_000 + rank, at + (rank + 1) * NS // 10, "stock", "process.started",
                    {"rank": rank, "pid": 100 + rank, "attempt": generation}) for rank in range(4)]
    output_ts = at + 7 * NS  # the first line a restarted process printed, 7 s after the restart was commanded
    added.append(_input(10_010, output_ts, "stock", "process.output", {"rank": 0, "attempt": generation}))
    where = records.index(rescheduled) + 1
    report = build_report(records[:where] + added + records[where:])
    incident = only_incident(report)
    first_signal = 1767225600 * NS + int(incident["first_signal_s"] * NS)
    assert incident["ttr_s"] == round((output_ts - first_signal) / NS, 3)
    assert incident["ttr_basis"].startswith("first output of a restarted process") and not incident["ttr_lower_bound"]
    assert incident["ttr_s"] < incident["open_s"] - 20, "not the close after the grace"
    assert incident["checkpoint"]["source"] == "the script's own" and incident["lost_steps"] is None
    assert incident["dying_checkpoint"] is None
    lost_restoring = incident["lost_s_by_phase"].get("restoring", 0.0)
    restoring = sum(p["seconds"] for p in incident["phases"] if p["phase"] == "restoring")
    assert lost_restoring < restoring - 20, "the grace in which it trained again is not lost"
    [job] = report["jobs"]
    assert job["ettr_upper_bound"] and report["summary"]["ettr_upper_bound"] and not job["reports_steps"]
    # without its output, the processes' start: a lower bound, and said so
    bare = only_incident(build_report(records[:where] + added[:4] + records[where:]))
    assert bare["ttr_lower_bound"] and "lower bound" in bare["ttr_basis"]
    assert bare["ttr_s"] == round((added[3]["ts"] - first_signal) / NS, 3)


def test_a_counted_stock_restart_is_measured_to_its_first_optimizer_step() -> None:
    """The same log, the step hook on (its ranks said `counts`, their counted steps reported): the restart is
    measured to the first step a restarted process counted, after its first output; the job is still a script
    that reports neither its steps nor its checkpoints (its own snapshot, steps lost unknown)."""
    records = list(iter_file(GOLDEN / "stock_script_restarts_whole.jsonl"))
    started = next(r for r in records if r["subject"].startswith("recovery.dec.")
                   and r["envelope"]["data"]["kind"] == "job.started")
    rescheduled = [r for r in records if r["subject"].startswith("recovery.dec.")
                   and r["envelope"]["data"]["kind"] == "ranks.rescheduling"][-1]
    generation = rescheduled["envelope"]["data"]["detail"]["generation"]
    at = rescheduled["ts"]
    said = [_input(9_000 + rank, started["ts"] + NS, "stock", "process.capabilities",
                   {"rank": rank, "attempt": 0, "caps": ["counts"]}) for rank in range(4)]
    output_ts, step_ts = at + 3 * NS, at + 9 * NS
    added = [_input(10_010, output_ts, "stock", "process.output", {"rank": 0, "attempt": generation}),
             _input(10_011, step_ts, "stock", "progress.report",
                    {"ranks": [{"rank": 2, "step": 1, "attempt": generation}]})]
    where, first = records.index(rescheduled) + 1, records.index(started) + 1
    report = build_report(records[:first] + said + records[first:where] + added + records[where:])
    incident = only_incident(report)
    first_signal = 1767225600 * NS + int(incident["first_signal_s"] * NS)
    assert incident["ttr_basis"].startswith("first optimizer step of a restarted process"), incident["ttr_basis"]
    assert incident["ttr_s"] == round((step_ts - first_signal) / NS, 3)
    assert incident["checkpoint"]["source"] == "the script's own" and incident["lost_steps"] is None
    assert not report["jobs"][0]["reports_steps"]


def test_the_step_and_step_time_come_from_the_agents_progress_reports() -> None:
    """Agents fold their ranks' steps into one progress.report a period: what the engine (and so recovery-ctl jobs)
    reads the job's step from, and the report too."""
    start = 1767225600 * NS
    records = [_input(1, start, "sdk", "job.submitted",
                      {"spec": {"nodes": ["n0"], "ranks_per_node": 2, "layout": {"dp": 2}}}),
               {"seq": 2, "ts": start, "subject": "recovery.dec.sdk", "headers": {},
                "envelope": {"id": "d2", "type": "decision", "job": "sdk", "source": "engine", "schema": 1,
                             "data": {"job": "sdk", "cause_seq": 1, "index": 0, "kind": "job.started",
                                      "state": "running", "reason": "processes started"}}}]
    for period in range(1, 21):  # a step every half second, reported every second
        records.append(_input(2 + period, start + period * NS, "sdk", "progress.report",
                              {"ranks": [{"rank": r, "step": 2 * period, "attempt": 0} for r in (0, 1)]}))
    [job] = build_report(records)["jobs"]
    assert job["step"] == 40 and job["step_time_s"] == 0.5 and job["reports_steps"]


def test_jobs_that_never_ran_are_listed_apart_and_counted_in_no_figure(capsys: pytest.CaptureFixture[str]) -> None:
    records = list(iter_file(GOLDEN / "pod_level_reschedule.jsonl"))
    alone = build_report(records)
    last = records[-1]["ts"]
    refused = _input(90_001, last, "aaa-refused", "job.submitted",
                     {"spec": {"nodes": ["x0"], "ranks_per_node": 8, "layout": {"dp": 8}}})
    letter = {"seq": 90_002, "ts": last, "subject": "recovery.dlq.placement_conflict", "headers": {},
              "envelope": {"id": "r1", "type": "rejection", "source": "engine", "schema": 1,
                           "data": {"seq": 90_001, "subject": refused["subject"], "code": "placement_conflict",
                                    "reason": "node x0 already runs job llm"}}}
    waiting = _input(90_003, records[0]["ts"], "aab-unserved", "job.submitted",
                     {"spec": {"nodes": ["y0"], "ranks_per_node": 8, "layout": {"dp": 8}}})
    report = build_report([waiting, *records, refused, letter])
    assert [j["job"] for j in report["jobs"]] == [j["job"] for j in alone["jobs"]]
    for figure in ("jobs", "ettr", "wall_s", "lost_s", "incidents"):
        assert report["summary"][figure] == alone["summary"][figure], figure
    never = {j["job"]: j for j in report["never_ran"]}
    assert set(never) == {"aaa-refused", "aab-unserved"}
    assert "node x0 already runs job llm" in never["aaa-refused"]["reason"]
    assert never["aab-unserved"]["reason"] == "not started by the end of the log"
    from rich.console import Console

    from recovery.report.html import render_html
    from recovery.report.terminal import render

    render(report, Console(width=200, file=sys.stdout), decisions=False)
    out = capsys.readouterr().out
    assert "and 2 that never ran" in out and "jobs that never ran" in out and "job aaa-refused" not in out
    page = render_html(report)
    assert page.count('class="chart timeline"') == len(alone["jobs"])  # no empty chart for a job that never ran
    assert page.index("timeline-0") < page.index("Jobs that never ran") and "aaa-refused" in page


def test_a_hang_an_agent_saw_is_dated_from_when_the_rank_stopped_making_progress(tmp_path: Path) -> None:
    """A stock rank stopped (or still) for 12 s when its agent reports it hung: the postmortem's first signal is 12 s
    before the report, and the detection took those 12 s."""
    from recovery.log.file import FileLog
    from recovery.testing.scenario import Scenario

    path = tmp_path / "log.jsonl"
    s = Scenario(log=FileLog(path))
    s.submit("j", ["n0", "n1"], ranks_per_node=1, dp=2, spares=0)
    for rank in range(2):
        s.job_event("j", "process.started", rank=rank, pid=100 + rank, attempt=0, announces=True)
    s.advance(20)
    s.job_event("j", "process.hang", rank=1, attempt=0, seconds_without_progress=12.0)
    s.advance(5)
    incident = only_incident(build_report(iter_file(path)))
    assert incident["fault_class"] == "hang" and incident["first_failing_rank"] == 1
    assert incident["first_signal_s"] == incident["opened_s"] - 12 and incident["detection_latency_s"] == 12


def _checked(seq: int, node: str, when: str, *results: tuple[str, bool, str]) -> dict[str, Any]:
    envelope = make_envelope("node.checked", {"when": when, "results": [{"check": c, "ok": ok, "saw": saw}
                                                                       for c, ok, saw in results]},
                             id=f"{node}-checked-{seq}", node=node, source=f"agent@{node}")
    return {"seq": seq, "ts": (1767225600 + seq) * 10**9, "subject": subjects.node_event(node, "node.checked"),
            "headers": {}, "envelope": envelope.model_dump(mode="json", by_alias=True)}


def test_the_report_lists_every_node_that_failed_its_checks_an_idle_spares_too(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A spare that fails its checks while idle leaves the pool before any job's fault could name it: the report
    lists it with the checks that failed, what they saw and whether a later run passed."""
    records = [
        _checked(1, "spare0", "join", ("memory", True, "61 GiB free"), ("disk:/dev/shm", True, "1.2 GB/s")),
        _checked(2, "spare0", "join", ("memory", True, ""), ("disk:/dev/shm", False, "write 3 MB/s < 200 MB/s")),
        _checked(3, "spare0", "spare", ("gpu-state", False, "2 pending retired pages")),
        _checked(4, "n1", "start", ("collective", False, "all-reduce timed out")),
        _checked(5, "n1", "fault", ("collective", True, "")),
        _checked(6, "n2", "join", ("memory", True, "")),
    ]
    report = build_report(records)
    assert report["health_checks_failed"] == [
        {"node": "n1", "failed_runs": 1, "checks": ["collective"], "first_failed_ns": 1767225604 * 10**9,
         "last_failed_ns": 1767225604 * 10**9, "when": ["start"], "saw": "collective: all-reduce timed out",
         "passed_ns": 1767225605 * 10**9},
        {"node": "spare0", "failed_runs": 2, "checks": ["disk:/dev/shm", "gpu-state"],
         "first_failed_ns": 1767225602 * 10**9, "last_failed_ns": 1767225603 * 10**9, "when": ["join", "spare"],
         "saw": "gpu-state: 2 pending retired pages", "passed_ns": None},
    ]  # n2 passed every run: not listed
    log = tmp_path / "checks.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("nodes that failed their health checks"):]
    assert "spare0" in table and "n1" in table and "n2" not in table
    html = render_html(report)
    checks = html[html.index('id="checks"'):]
    assert "<td>spare0</td><td>2</td><td>disk:/dev/shm, gpu-state</td>" in checks and "<td>n2</td>" not in checks

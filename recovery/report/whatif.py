"""What other policies would have done with the faults of a recorded log.

A recorded log cannot simply be replayed under other policies: many of its inputs exist only because of the
recorded decisions (command acks, processes restarted and their progress, dying checkpoints, timers). So the
what-if keeps what the cluster did on its own (the job's shape and its policies from `job.submitted`, the nodes and
spares, and the faults: device faults, links going down and up, hosts going away, and the process exits and hangs
the recorded engine took as fault signals; and the cluster's history: what its nodes said before the job was
submitted, which the engine counted, such as an earlier job's device faults) and lets the simulator
(`recovery.sim`: its world's executors, training and checkpoints, and its cost model) play every answer of the
cluster. Of a log of several jobs it replays one: the one a postmortem is about unless told
(`recovery.report.job_choice`). It runs the simulator twice on these faults, under the recorded policies and under
the what-if's, so that the comparison is between two runs of the same model; the decisions that differ come from
`recovery.report.diff` over the two simulated logs. It says which inputs it kept and which it left for the
simulator to re-create.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from events.subjects import partition_of
from events.values import PolicyRef, PolicySelection
from policies.registry import load_set
from recovery.log import EPOCH, FileLog
from recovery.report.calibration import Calibration, calibrate
from recovery.report.diff import diff_logs
from recovery.report.fold import build_report
from recovery.report.job_choice import JobChoice, choose_job, exported_job
from recovery.report.recorded import RecordedCluster, RecoveryDecision, faults_of, history_of, read_recorded
from recovery.report.source import iter_file
from recovery.sim.__main__ import parse_policy
from recovery.sim.accounting import Result
from recovery.sim.answers import DONE, RecordedAnswer
from recovery.sim.config import DAY_S, NS, Agents, Cluster, Costs, Profile, SimConfig, Training
from recovery.sim.faults import Fault
from recovery.sim.sim import Simulator

WHATIF_VERSION = 2
TAIL_S = 3600.0
"""simulated time after the log's end (no new faults): recoveries under way then finish under either policy"""
TOLERANCE_S = 3.0
"""how far a simulated recovery decision, or a class's MTTR, may be from the recorded one and still reproduce it"""


DEVICE_MEMORY_BYTES = 80e9
"""one accelerator's memory (an H100's or an Ascend 910B's 64-80 GB, the larger)"""
TRAINING_BYTES_PER_PARAM = 16.0
"""what training holds per parameter: bf16 weights and gradients (4), fp32 master weights and Adam's m and v (12)"""


def layout_params(layout: dict[str, int]) -> float:
    """The model size a recorded job is taken to train when the log does not say: the largest one replica of its
    layout holds (tp x pp devices of `DEVICE_MEMORY_BYTES`, `TRAINING_BYTES_PER_PARAM` each), never more than the
    simulator's Llama 3 405B. The cost of moving state follows the job's own scale instead of a 405B model's: an
    8-GPU job at dp 4 x tp 2 is a 10B-parameter job, not one that reloads 5.7 TB."""
    replica = layout.get("tp", 1) * layout.get("pp", 1)
    return min(Training().params, replica * DEVICE_MEMORY_BYTES / TRAINING_BYTES_PER_PARAM)


def config_for(cluster: RecordedCluster, selection: PolicySelection, model_params: float | None = None,
               executor_failures: bool = False, tail_s: float = 0.0, step_time_s: float | None = None,
               node_not_ready_s: float | None = None) -> tuple[SimConfig, Calibration]:
    """The simulator's configuration for the recorded job: its shape, its measured pace, checkpoint cadence,
    executors' and restores' durations and detection delays (`recovery.report.calibration`), the cost model's
    defaults for everything the log does not say; executors that never fail unless asked, so that a difference
    comes from the policies rather than the executors' luck."""
    spec = cluster.spec
    layout = spec["layout"]
    gpus = len(cluster.nodes) * cluster.rpn
    if gpus != layout["dp"] * layout["tp"] * layout["pp"]:
        raise ValueError(f"job {cluster.job}: {gpus} ranks on its nodes is not dp x tp x pp of its layout {layout}")
    if layout.get("fsdp"):
        # the simulator's data-parallel replicas each hold the whole state: it would give this job replicas it lacks
        raise ValueError(f"job {cluster.job}: the simulator does not model an fsdp layout (every rank its own shard, "
                         f"resharded by a scale); no what-if of it")
    costs = Costs() if executor_failures else replace(Costs(), fail_probability=0.0, timeout_probability=0.0)
    calibration = calibrate(cluster, replace(Training(), params=model_params or layout_params(layout)), costs,
                            step_time_s, "--model-params" if model_params else "layout", node_not_ready_s)
    step_s = calibration.training.step_time_s
    storage = _every(cluster.storage_steps)
    memory = _every(cluster.memory_steps)
    training = replace(calibration.training, storage_every_s=storage * step_s if storage else None,
                       memory_every_steps=memory)
    config = SimConfig(cluster=Cluster(gpus=gpus, gpus_per_node=cluster.rpn, tp=layout["tp"], pp=layout["pp"],
                                       spare_nodes=len(cluster.spares)),
                       training=training, costs=calibration.costs, agents=calibration.agents,
                       profile=Profile("recorded", selection, memory_tier=memory is not None),
                       days=(max(cluster.end - cluster.start, NS) / NS + tail_s) / DAY_S, job=cluster.job,
                       **_watched(cluster), spare_pool=spec.get("spare_pool"),
                       elastic=None if not spec.get("elastic") else (int(spec["elastic"]["min_dp"]),
                                                                     int(spec["elastic"]["max_dp"])),
                       joining=tuple(f"n{len(cluster.nodes) + cluster.spares.index(d.node):05d}"
                                     for d in cluster.drafts if d.signal == "join" and d.node in cluster.spares),
                       answers=tuple(_sim_names(a, cluster) for a in cluster.night.answers),
                       history=history_of(cluster))
    return config, calibration


def _watched(cluster: RecordedCluster) -> dict[str, float]:
    """Where the recorded engine found a fault by a silence, the simulated job reports as the recorded one did (every
    live rank at the agents' measured period) and the engine watches it at the recorded watchdog interval: the
    silence is found on the same tick. Where it found a straggler, the ranks' compute times are reported before each
    tick of the recorded interval, where its straggler check reads them. Else the simulator's quiet default (no
    periodic reports, no watchdog)."""
    interval = cluster.spec.get("watchdog_interval_s")
    if not isinstance(interval, int | float):
        return {}
    watched: dict[str, float] = {}
    if cluster.night.silences:
        watched |= {"report_every_s": statistics.median(cluster.report_gaps_s) if cluster.report_gaps_s else 1.0,
                    "watchdog_interval_s": float(interval)}
    if any(d.signal == "straggler" for d in cluster.drafts):
        watched["watch_s"] = float(interval)
    return watched


def _sim_names(answer: RecordedAnswer, cluster: RecordedCluster) -> RecordedAnswer:
    """`answer` with the recorded nodes its result names (a failed reset's node) as the simulator's."""
    names = {name: f"n{i:05d}" for i, name in enumerate(cluster.nodes + cluster.spares)}
    return replace(answer, result=tuple((k, names.get(v, v) if isinstance(v, str) else v) for k, v in answer.result))


def _timed(answers: list[RecordedAnswer]) -> dict[str, Any]:
    """The commands the recorded executors carried out, whose simulated namesakes take as long: how many of each
    kind, and the first few (a night of thousands of commands lists no more)."""
    done = [a for a in answers if a.status == DONE]
    by_kind: dict[str, int] = {}
    for answer in done:
        by_kind[answer.kind] = by_kind.get(answer.kind, 0) + 1
    return {"commands": len(done), "by_kind": dict(sorted(by_kind.items())), "answers": [a.label for a in done[:200]]}


def _every(steps: list[int]) -> int | None:
    gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
    if gaps:
        return int(statistics.median(gaps))
    return steps[0] if steps and steps[0] > 0 else None


def selection_with(spec: dict[str, Any], overrides: Sequence[str]) -> PolicySelection:
    refs = {family: PolicyRef(**ref) for family, ref in (spec.get("policies") or {}).items()}
    base = PolicySelection(**refs)
    if not overrides:
        return base
    for text in overrides:
        family, ref = parse_policy(text)
        refs[family] = ref
    chosen = PolicySelection(**{**base.model_dump(), **{f: r.model_dump() for f, r in refs.items()}})
    load_set(chosen)  # a policy that is not installed, or a bad parameter: an error before anything runs
    return chosen


def _simulate(config: SimConfig, faults: list[Fault], path: Path) -> Result:
    # A fresh log: a FileLog appends to the file it finds (and dedupes against it), so a second what-if into the same
    # `--keep-logs` directory replayed nothing new and compared a run with itself.
    path.unlink(missing_ok=True)
    log = FileLog(path)
    try:
        return Simulator(config, log=log, faults=faults).run()
    finally:
        log.close_sync()


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _figures(result: Result) -> dict[str, Any]:
    mttr = result.mttr()
    return {"ettr": round(result.ettr, 6), "lost_gpu_hours": round(result.lost_gpu_hours, 3),
            "lost_gpu_hours_by_cause": {k: round(result.gpu_hours(v), 3) for k, v in result.lost_s.items() if v},
            "mttr_by_fault_class": {k: {"faults": int(v["faults"]), "recovered": int(v["recovered"]),
                                        "p50_s": _number(v["p50_s"]), "p95_s": _number(v["p95_s"])}
                                    for k, v in mttr.items()},
            "restarts": result.restarts, "policies": result.policies, "decisions": result.decisions}


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    classes = sorted(set(a["mttr_by_fault_class"]) | set(b["mttr_by_fault_class"]))

    def p50(side: dict[str, Any], cls: str) -> float | None:
        value = side["mttr_by_fault_class"].get(cls, {}).get("p50_s")
        return None if value is None else float(value)

    mttr = {}
    for cls in classes:
        x, y = p50(a, cls), p50(b, cls)
        mttr[cls] = None if x is None or y is None else round(y - x, 3)
    return {"ettr": round(b["ettr"] - a["ettr"], 6),
            "lost_gpu_hours": round(b["lost_gpu_hours"] - a["lost_gpu_hours"], 3), "mttr_p50_s": mttr}


def simulated_decisions(path: Path, job: str) -> list[RecoveryDecision]:
    """The recovery decisions of a simulated log (whose job starts at its first record), as `read_recorded` keeps
    the recorded ones."""
    return read_recorded(iter_file(path), job).night.decisions


def reproduction(cluster: RecordedCluster, simulated: list[RecoveryDecision], recorded_report: dict[str, Any],
                 simulated_report: dict[str, Any], tolerance_s: float, calibration: Calibration) -> dict[str, Any]:
    """Whether the run under the recorded policies repeats the recorded night: the same recovery decisions in the
    same order (each attempt with its granularity, how attempts ended, recoveries, the job's end), each within
    `tolerance_s` of its recorded time, and the same MTTR per fault class within `tolerance_s`. Decisions the
    simulated run takes after the log's end (recoveries under way finishing in the tail) are not the night's."""
    night = cluster.night
    span_s = (cluster.end - cluster.start) / NS
    recorded = night.decisions
    within = [d for d in simulated if d.at_s <= span_s + tolerance_s]
    first = None
    for i in range(max(len(recorded), len(within))):
        a = recorded[i] if i < len(recorded) else None
        b = within[i] if i < len(within) else None
        if a is None or b is None or a.label != b.label or abs(a.at_s - b.at_s) > tolerance_s:
            first = {"index": i, "recorded": None if a is None else {"decision": a.label, "at_s": a.at_s},
                     "simulated": None if b is None else {"decision": b.label, "at_s": b.at_s}}
            break
    mttr: dict[str, dict[str, Any]] = {}
    rec_mttr, sim_mttr = recorded_report["mttr_by_fault_class"], simulated_report["mttr_by_fault_class"]
    for cls in sorted(set(rec_mttr) | set(sim_mttr)):
        x, y = rec_mttr.get(cls, {}).get("p50_s"), sim_mttr.get(cls, {}).get("p50_s")
        mttr[cls] = {"recorded_p50_s": x, "simulated_p50_s": y,
                     "within_tolerance": x is not None and y is not None and abs(x - y) <= tolerance_s}
    not_recreated = ([f"a person or the scheduler decided: {w}" for w in night.operator]
                     + [f"a fault signal the what-if does not replay: {w}" for w in night.unmatched_signals]
                     + ([f"other jobs shared the cluster: {', '.join(sorted(cluster.other_jobs))}"]
                        if cluster.other_jobs else [])
                     + [f"out of service before the job, where the simulated node joins healthy: {left}"
                        for lefts in cluster.history_left.values() for left in lefts]
                     + ([f"the job reported no steps: the simulated one trains at an assumed "
                         f"{calibration.training.step_time_s} s a step (--step-time-s)"]
                        if calibration.figures["step_time_s"]["from"] != "measured" and cluster.ranks_reported
                        else [])
                     + ([f"the recorded job failed again before it got past the step of the fault before "
                         f"({recorded_report['restart_loops']} restart loop(s): a deterministic failure); the "
                         f"simulator's restarted processes train on"] if recorded_report.get("restart_loops") else []))
    same = first is None and all(m["within_tolerance"] or (m["recorded_p50_s"] is None and m["simulated_p50_s"]
                                                           is None) for m in mttr.values())
    return {"reproduced": same, "tolerance_s": tolerance_s, "first_difference": first,
            "recorded": [{"decision": d.label, "at_s": d.at_s} for d in recorded[:200]],
            "simulated": [{"decision": d.label, "at_s": d.at_s} for d in within[:200]],
            "mttr_by_fault_class": mttr, "not_recreated": not_recreated[:50]}


def _report_figures(report: dict[str, Any], wall_s: float | None = None) -> dict[str, Any]:
    """`report`'s figures; with `wall_s`, its ETTR over that wall time (a simulated log goes quiet while the job
    trains, so its last record is no end of the run: the recorded log's wall is the run's)."""
    s = report["summary"]
    ettr = s["ettr"] if wall_s is None or not wall_s else round(1 - float(s["lost_s"]) / wall_s, 6)
    return {"ettr": ettr, "lost_gpu_hours": s["lost_gpu_hours"],
            "mttr_by_fault_class": {k: {"incidents": v["incidents"], "p50_s": v["p50_s"], "p95_s": v["p95_s"]}
                                    for k, v in s["mttr_by_fault_class"].items()}}


def whatif(path: str | os.PathLike[str], overrides: Sequence[str], job: str | None = None,
           model_params: float | None = None, executor_failures: bool = False,
           keep_logs: str | os.PathLike[str] | None = None, tail_s: float = TAIL_S,
           partitions: int | None = None, step_time_s: float | None = None,
           tolerance_s: float = TOLERANCE_S, node_not_ready_s: float | None = None) -> dict[str, Any]:
    """The what-if of a recorded log (a JSONL export) under `overrides` (`FAMILY=NAME[:k=v,...]`; none: the
    recorded policies, which checks that the simulator reproduces the log). Both simulated runs last the log's span
    plus `tail_s`, so that a recovery under way when the log ends can finish. A log of `partitions` P > 1 gave the
    job only its partition's spares (`recovery.core.partition`): so does the what-if. `step_time_s` is the step
    time of a job that reported none; `node_not_ready_s` how long before its node.not_ready a host that went away
    died (default: just after its ranks' last report). `job`: the job to replay; None: the one a postmortem of the
    log is about (`recovery.report.job_choice`)."""
    agents = Agents() if node_not_ready_s is None else Agents(node_not_ready_s=node_not_ready_s)
    choice = choose_job(iter_file(path), job, exported_job(path))
    cluster = read_recorded(iter_file(path), choice.job, agents, death_given=node_not_ready_s is not None)
    partition = None
    if partitions is not None and partitions > 1:
        partition = partition_of(cluster.job, partitions)
        others = {node for node in cluster.spares if partition_of(node, partitions) != partition}
        cluster.spares = [node for node in cluster.spares if node not in others]
        cluster.history = [past for past in cluster.history if past.node not in others]
        for node in others:
            cluster.history_left.pop(node, None)
        # a fault on another partition's spare never reached this job: the simulated cluster has no such node
        for draft in [d for d in cluster.drafts if d.node in others]:
            cluster.drafts.remove(draft)
            kind = draft.source.split(" ", 1)[0]
            cluster.kept[kind] = cluster.kept.get(kind, 1) - 1
            if cluster.kept[kind] <= 0:
                del cluster.kept[kind]
            cluster.resimulated[kind] = cluster.resimulated.get(kind, 0) + 1
    base_selection = selection_with(cluster.spec, [])
    chosen = selection_with(cluster.spec, overrides)
    faults = faults_of(cluster, SimConfig().durations)
    base_config, calibration = config_for(cluster, base_selection, model_params, executor_failures, tail_s,
                                          step_time_s, node_not_ready_s)
    what_config = replace(base_config, profile=Profile("what-if", chosen, memory_tier=base_config.profile.memory_tier))
    recorded_report = build_report(iter_file(path), job=cluster.job)
    span_end = EPOCH + (cluster.end - cluster.start)
    with tempfile.TemporaryDirectory(prefix="recovery-whatif-") as tmp:
        where = Path(keep_logs) if keep_logs is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        base_log, what_log = where / "recorded-policies.jsonl", where / "whatif.jsonl"
        base = _figures(_simulate(base_config, faults, base_log))
        if chosen == base_selection:  # the what-if is the recorded policies: the same run, byte for byte
            shutil.copyfile(base_log, what_log)
            what = base
        else:
            what = _figures(_simulate(what_config, faults, what_log))
        diff = diff_logs(iter_file(base_log), iter_file(what_log), job=cluster.job,
                         labels=("recorded policies", "what-if"))
        base_report = build_report(iter_file(base_log), job=cluster.job)
        # over the recorded span only, as the log's own figures: the tail has no faults and would dilute them
        wall = recorded_report["summary"]["wall_s"]
        spans = {"recorded log": _report_figures(recorded_report),
                 "recorded policies": _report_figures(build_report(iter_file(base_log), job=cluster.job,
                                                                   until=span_end), wall),
                 "what-if": _report_figures(build_report(iter_file(what_log), job=cluster.job, until=span_end), wall)}
        replayed = reproduction(cluster, simulated_decisions(base_log, cluster.job), recorded_report["summary"],
                                base_report["summary"], tolerance_s, calibration)
    names = {f"n{i:05d}": n for i, n in enumerate(cluster.nodes + cluster.spares)}
    return _renamed({
        "whatif": WHATIF_VERSION, "log": str(path), "job": cluster.job,
        "job_choice": _choice(choice, cluster),
        "policies": {"recorded": base_selection.model_dump(), "what-if": chosen.model_dump()},
        "cluster": {"nodes": len(cluster.nodes), "spares": len(cluster.spares), "ranks_per_node": cluster.rpn,
                    "partition": None if partition is None else {"index": partition, "count": partitions},
                    "layout": cluster.spec["layout"], "step_time_s": round(base_config.training.step_time_s, 3),
                    "step_time_from": calibration.figures["step_time_s"]["from"],
                    "storage_every_s": base_config.training.storage_every_s,
                    "memory_every_steps": base_config.training.memory_every_steps,
                    "model_params": base_config.training.params,
                    "model_params_from": "--model-params" if model_params else "layout",
                    "days": round(base_config.days, 6),
                    "executor_failures": executor_failures, "tail_s": tail_s,
                    # set where the recorded engine found a silence: the job reports and is watched as recorded
                    "report_every_s": base_config.report_every_s,
                    "watchdog_interval_s": base_config.watchdog_interval_s},
        "calibration": calibration.figures,
        "assumed": calibration.assumed,
        "other_jobs": sorted(cluster.other_jobs),
        "inputs": {"faults": len(faults), "kept": dict(sorted(cluster.kept.items())),
                   "executors": [a.label for a in cluster.night.answers if a.status != DONE],
                   "timed_as_recorded": _timed(cluster.night.answers),
                   "resimulated": dict(sorted(cluster.resimulated.items())),
                   "history": _history(cluster),
                   "fault_list": [{"at_s": round(f.at_ns / NS, 3), "signal": f.signal, "from": f.component}
                                  for f in faults[:200]]},
        "reproduction": replayed,
        "figures": spans,
        "simulated": {"recorded policies": base, "what-if": what},
        "delta": _delta(base, what),
        "diff": diff,
        "logs": None if keep_logs is None else [str(base_log), str(what_log)],
    }, names)


def _choice(choice: JobChoice, cluster: RecordedCluster) -> dict[str, Any]:
    """Why the job was chosen, and the log's other jobs, which the what-if leaves out: each with its incidents, and
    whether it ran alongside the job (its records come after the job's submission) or only before it (what it left
    on the job's nodes is their history)."""
    return {"why": choice.why,
            "left_out": [{"job": other, "incidents": choice.incidents.get(other, 0),
                          "alongside": other in cluster.other_jobs} for other in choice.others]}


def _history(cluster: RecordedCluster) -> dict[str, Any]:
    """The node events before the job's submission that the simulated engine hears first, by kind."""
    by_kind: dict[str, int] = {}
    for past in cluster.history:
        by_kind[past.kind] = by_kind.get(past.kind, 0) + 1
    return {"events": len(cluster.history), "by_kind": dict(sorted(by_kind.items())),
            "left": [left for lefts in cluster.history_left.values() for left in lefts]}


_SIM_NODE = re.compile(r"\bn\d{5}\b")


def _renamed(obj: Any, names: dict[str, str]) -> Any:
    """The simulator's node names (n00000...) as the recorded log's (the same position in the job, or spare)."""
    if isinstance(obj, str):
        return _SIM_NODE.sub(lambda m: names.get(m.group(0), m.group(0)), obj)
    if isinstance(obj, list):
        return [_renamed(x, names) for x in obj]
    if isinstance(obj, dict):
        return {k: _renamed(v, names) for k, v in obj.items()}
    return obj

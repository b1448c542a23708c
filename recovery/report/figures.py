"""The report's figures from what the fold kept: each incident's latencies, phases and lost GPU-hours, each job's
ETTR, MTTR by fault class, restarts and restart loops, and the lemon candidates across jobs (definitions in
`recovery.report.fold`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from recovery.report.state import NS, Incident, JobFold
from recovery.report.state import seconds as _s
from recovery.sim.accounting import percentile

WIDESPREAD_FAULTS = 8
"""an incident with more faults than this is a crash many ranks reported at once: its process faults implicate no
node as a lemon"""


def job_report(job: JobFold, end: int) -> dict[str, Any]:
    incidents = list(job.incidents)
    if job.incident is not None:
        incidents.append(job.incident)
    start = job.started if job.started is not None else (job.first_seen or end)
    stop = job.ended if job.ended is not None else end
    wall = max(0, stop - start)
    step_ns = job.step_ns or 0.0
    reports = [incident_report(job, inc, end, step_ns) for inc in incidents]
    lost_by_cause = sum_dicts(r["lost_s_by_phase"] for r in reports)
    lost_s = sum(lost_by_cause.values())
    by_cause = {k: round(v * job.gpus / 3600, 3) for k, v in lost_by_cause.items()}
    lost_gpu_hours = lost_s * job.gpus / 3600
    points = list(job.step_points)
    if job.last_step is not None and (not points or points[-1] != job.last_step):
        points.append(job.last_step)
    return {
        "job": job.id, "gpus": job.gpus, "nodes": len(job.nodes), "policies": job.policies,
        "policy_params": job.params,
        "state": job.end_state or job.state, "end_reason": job.end_reason, "started_ns": job.started,
        "ended_ns": job.ended,
        "wall_s": _s(wall), "step": job.step, "reports_steps": job.speaks,
        "step_time_s": round(step_ns / NS, 3) if step_ns else None,
        "ettr": round(max(0.0, 1 - lost_s / (wall / NS)), 6) if wall else None,
        # a script that reports no steps redid, after each restart, the work since its own last snapshot, which
        # nothing measures: its ETTR is at most this
        "ettr_upper_bound": bool(incidents) and not job.speaks,
        "lost_s": round(lost_s, 3), "lost_gpu_hours": round(lost_gpu_hours, 3),
        "lost_s_by_cause": lost_by_cause, "lost_gpu_hours_by_cause": by_cause,
        "mttr_by_fault_class": mttr(reports), "restarts_by_granularity": restarts(reports),
        "restart_loops": sum(1 for r in reports if r["restart_loop"]),
        "dead_letters": sum(job.dead_letters.values()),
        "dead_letters_by_code": dict(sorted(job.dead_letters.items())),
        "policy_errors": job.dead_letters.get("policy_error", 0) + job.policy_failures,
        "policy_failures": job.policy_failures, "first_policy_failures": job.first_policy_failures,
        "first_dead_letters": job.first_dead_letters,
        "decisions_by_kind": dict(sorted(job.decision_counts.items())),
        "incidents": reports,
        "steps": [[_s(ts - start), step] for ts, step in points],
        "other_decisions": job.loose, "other_decisions_omitted": job.loose_omitted,
    }

def never_ran(job: JobFold, end: int) -> dict[str, Any]:
    """A job that never started: what it asked for and why it did not run (counted in no figure)."""
    why = job.refused or job.unserved or (f"ended before it started: {job.end_reason}" if job.ended is not None
                                          else "not started by the end of the log")
    return {"job": job.id, "gpus": job.gpus, "nodes": len(job.nodes), "state": job.end_state or job.state,
            "reason": why, "submitted_ns": job.first_seen,
            "waited_s": _s((job.ended or end) - (job.first_seen or end))}


LOWER_BOUND = "a lower bound (the script reports no steps, and its restarted processes printed nothing)"


def ran_again(job: JobFold, inc: Incident) -> tuple[int | None, str]:
    """When the job ran again after the incident's fault, and what that is measured to. A script that reports
    steps: its first step past the resume point (the incident's close). One that reports none (a stock script): the
    first optimizer step of a restarted process, where the step hook counts them; else the first output of a
    restarted process, which its agent sees; without one, the start of every restarted process, which is only a
    lower bound. The engine's close of a stock script's incident (its restarted processes ran the
    ladder's `running_grace_s` without exiting) is a wait, not a measurement, and is never the answer."""
    if job.speaks:
        if inc.outcome == "recovered":
            return inc.closed, "first step past the resume point"
        return None, "no step past the resume point was reported"
    if inc.generation is None:
        return None, "no restart started"
    if job.counted and inc.first_step is not None:
        return inc.first_step, "first optimizer step of a restarted process (counted by the step hook)"
    if inc.first_output is not None:
        return inc.first_output, "first output of a restarted process (the script reports no steps)"
    if inc.all_started is not None:
        return inc.all_started, f"restarted processes started: {LOWER_BOUND}"
    return None, "the restarted processes were not all seen to start: lost time runs until the incident closed"


def incident_report(job: JobFold, inc: Incident, end: int, step_ns: float) -> dict[str, Any]:
    start = job.started if job.started is not None else (job.first_seen or inc.opened)
    first = inc.first_signal if inc.first_signal is not None else inc.opened
    closed = inc.closed
    stop = closed if closed is not None else end
    back, basis = ran_again(job, inc)
    phases = [{"phase": "detection", "start_s": _s(first - start), "seconds": _s(inc.opened - first)}]
    phases += [{"phase": p.name, "start_s": _s(p.start - start), "seconds": _s((p.end or stop) - p.start)}
               for p in inc.phases]
    # Lost: the job's time until it ran again. A stock script's incident stays open through the grace in which
    # its restarted processes already train: that time is not lost.
    lost_until = back if back is not None and not job.speaks else stop
    seconds_by_phase: dict[str, float] = {"detection": _s(inc.opened - first)}
    for p in inc.phases:
        seconds = _s(max(0, min(p.end or stop, lost_until) - p.start))
        seconds_by_phase[p.name] = seconds_by_phase.get(p.name, 0.0) + seconds
    recompute_s = (inc.lost_steps or 0) * step_ns / NS
    if recompute_s:
        seconds_by_phase["recompute"] = recompute_s
    seconds_by_phase = {k: round(v, 3) for k, v in seconds_by_phase.items() if v}
    gpu_hours = {k: round(v * job.gpus / 3600, 3) for k, v in seconds_by_phase.items()}
    grans = [a["granularity"] for a in inc.attempts]
    escalations = [{"from": a["granularity"], "to": b["granularity"], "after": a["outcome"],
                    "reason": a["outcome_reason"]}
                   for a, b in zip(inc.attempts, inc.attempts[1:], strict=False)]
    # the root: what began first (a node lost before its peers' exits were heard), not what was confirmed first
    began = min((f.get("onset_ts", f["ts"]) for f in inc.faults), default=None)
    roots = [f for f in inc.faults if f.get("onset_ts", f["ts"]) == began]
    root = roots[0] if roots else None
    first_rank = min((f["ranks"][0] for f in roots if f["ranks"]), default=None)
    return {
        "id": inc.id, "job": job.id, "cause": inc.cause,
        "fault_class": (root["class"] if root is not None else None) or inc.cause,
        "root_faults": roots, "faults": inc.faults, "fault_count": inc.fault_count,
        "first_failing_rank": first_rank,
        "opened_s": _s(inc.opened - start), "first_signal_s": _s(first - start),
        "closed_s": _s(closed - start) if closed is not None else None,
        "outcome": inc.outcome or "open",
        "detection_latency_s": _s(inc.opened - first),
        "decision_latency_s": _s(inc.first_command - inc.opened) if inc.first_command is not None else None,
        "recovery_s": _s(stop - inc.opened), "ttr_s": _s(back - first) if back is not None else None,
        "ttr_basis": basis, "ttr_lower_bound": basis.endswith(LOWER_BOUND),
        "open_s": _s(stop - first),
        "phases": phases, "granularity": grans[-1] if grans else None, "attempts": inc.attempts,
        "escalations": escalations,
        # a script that reports no checkpoints resumes from its own snapshot, which the engine never hears of: its
        # plan's "step 0" is not where it resumed
        "checkpoint": ({**inc.checkpoint, "source": "the script's own"} if inc.checkpoint and not
                       job.reports_checkpoints else
                       {**inc.checkpoint, "source": "the plan"} if inc.checkpoint else None),
        "dying_checkpoint": inc.dying if job.speaks else None,
        "lost_steps": inc.lost_steps, "step_at_fault": inc.step_at_open,
        "lost_s_by_phase": seconds_by_phase, "lost_gpu_hours_by_phase": gpu_hours,
        "lost_gpu_hours": round(sum(gpu_hours.values()), 3),
        "restart_loop": inc.restart_loop, "before_window": inc.before_window,
        "decisions": inc.decisions, "decisions_omitted": inc.decisions_omitted,
        "stacks": inc.stacks.report() if inc.stacks is not None else None,
    }

def checkpoint_text(ckpt: dict[str, Any] | None) -> str:
    """Where the incident's restart resumed from: the plan's checkpoint, or a stock script's own snapshot."""
    if not ckpt:
        return "-"
    if ckpt.get("source") == "the script's own":
        return "the script's own"
    return f"step {ckpt['checkpoint_step']} " + ",".join(ckpt["tiers"])


def lemons(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    nodes: dict[str, list[dict[str, Any]]] = {}
    devices: dict[tuple[str, int], set[str]] = {}
    for inc in incidents:
        # a crash reported by many ranks at once (a job-wide failure) implicates none of their nodes
        widespread = inc["fault_count"] > WIDESPREAD_FAULTS
        for fault in inc["faults"]:
            if widespread and fault["class"] in ("process", "preemption"):
                continue
            for node in fault["nodes"]:
                history = nodes.setdefault(node, [])
                entry = {"incident": inc["id"], "job": inc["job"], "class": fault["class"], "code": fault["code"],
                         "device": fault["device"], "ts": fault["ts"]}
                if not history or history[-1]["incident"] != inc["id"] or history[-1]["code"] != fault["code"]:
                    history.append(entry)
                if fault["device"] is not None:
                    devices.setdefault((node, int(fault["device"])), set()).add(inc["id"])
    lemons = []
    for node, history in nodes.items():
        distinct = sorted({h["incident"] for h in history})
        if len(distinct) < 2:
            continue
        repeat = sorted(d for (n, d), incs in devices.items() if n == node and len(incs) >= 2)
        lemons.append({"node": node, "incidents": len(distinct), "jobs": sorted({h["job"] for h in history}),
                       "devices_repeating": repeat, "history": sorted(history, key=lambda h: h["ts"])})
    lemons.sort(key=lambda lemon: (-lemon["incidents"], lemon["node"]))
    return lemons


def sum_dicts(dicts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return {k: round(v, 3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def mttr(incidents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault class: incidents, how many recovered, time to recovery p50/p95 (s), and the mean seconds in each
    phase (the breakdown the HTML chart draws)."""
    out: dict[str, dict[str, Any]] = {}
    for cls in sorted({str(i["fault_class"]) for i in incidents}):
        of = [i for i in incidents if str(i["fault_class"]) == cls]
        ttr = [i["ttr_s"] for i in of if i["ttr_s"] is not None]
        phases: dict[str, float] = {}
        for inc in of:
            for p in inc["phases"]:
                phases[p["phase"]] = phases.get(p["phase"], 0.0) + p["seconds"]
        p50, p95 = percentile(ttr, 50), percentile(ttr, 95)
        out[cls] = {"incidents": len(of), "recovered": len(ttr),
                    "lower_bounds": sum(1 for i in of if i["ttr_s"] is not None and i["ttr_lower_bound"]),
                    "p50_s": None if math.isnan(p50) else round(p50, 3),
                    "p95_s": None if math.isnan(p95) else round(p95, 3),
                    "mean_phase_s": {k: round(v / len(of), 3) for k, v in phases.items()}}
    return out


def restarts(incidents: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for inc in incidents:
        for attempt in inc["attempts"]:
            counts = out.setdefault(str(attempt["granularity"]), {})
            counts["started"] = counts.get("started", 0) + 1
            outcome = attempt["outcome"]
            if outcome is None and attempt is inc["attempts"][-1]:
                outcome = "recovered" if inc["outcome"] == "recovered" else None
            if outcome is not None:
                counts[outcome] = counts.get(outcome, 0) + 1
    return dict(sorted(out.items()))

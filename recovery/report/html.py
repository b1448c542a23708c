"""The report as one self-contained HTML file: inline SVG drawn here, inline CSS, no script or font from anywhere,
so it opens on a laptop with no network. Per job a timeline (the step line above, incidents as Gantt bars of their
phases below, faults as markers), the time-to-recovery breakdown by phase and fault class, and the lemon list.

Every incident bar is a `<g class="incident-bar">`, every chart an element with class `chart` and an id: the test
counts bars and checks each chart's pixels in a screenshot. A small inline script only records where each chart
landed on the page (`data-layout` on `<body>`), for that test; the charts draw without it.
"""

from __future__ import annotations

import html
import os
from typing import Any

from recovery.report.figures import checkpoint_text
from recovery.report.fold import REPORT_VERSION
from recovery.report.stacks import describe

PHASE_COLORS = {
    "detection": "#9e9e9e", "settling": "#b39ddb", "planning": "#7986cb", "waiting": "#e57373",
    "saving": "#4db6ac", "stopping": "#ffb74d", "rescheduling": "#f06292", "restoring": "#64b5f6",
    "paused": "#a1887f", "recompute": "#ba68c8",
}
WIDTH = 1160
LANE = 22


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _fmt_s(seconds: float) -> str:
    if seconds >= 86_400:
        return f"{seconds / 86_400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _timeline(job: dict[str, Any], index: int) -> str:
    """The job's timeline: steps as a line (top), one Gantt lane per fault class (incident phases), fault markers."""
    incidents = job["incidents"]
    steps = job["steps"]
    span = max([job["wall_s"], 1.0] + [p[0] for p in steps] +
               [(i["closed_s"] or i["opened_s"] + i["open_s"]) for i in incidents])
    left, right = 120, 20
    plot = WIDTH - left - right
    classes = sorted({str(i["fault_class"]) for i in incidents}) or ["(none)"]
    step_h = 120
    gantt_top = step_h + 30
    height = gantt_top + LANE * len(classes) + 40

    def x(seconds: float) -> float:
        return left + plot * max(0.0, seconds) / span

    parts = [f'<svg class="chart timeline" id="timeline-{index}" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<title>job {_e(job["job"])}: steps, incidents and faults over time</title>',
             f'<rect x="{left}" y="10" width="{plot}" height="{step_h - 10}" fill="#fafafa" stroke="#ddd"/>']
    top = max([s for _, s in steps] + [1])
    if steps:
        # a step holds until the next report: drawn as stairs, so a stall is flat and a roll-back drops at once
        def y(step: int) -> float:
            return 10 + (step_h - 12) * (1 - step / top)
        path = [f"M{x(steps[0][0]):.1f},{y(steps[0][1]):.1f}"]
        path += [f"H{x(t):.1f}V{y(s):.1f}" for t, s in steps[1:]]
        path.append(f"H{x(job['wall_s']):.1f}")
        parts.append(f'<path class="steps" d="{"".join(path)}" fill="none" stroke="#1565c0" stroke-width="2"/>')
    parts.append(f'<text x="{left - 8}" y="20" text-anchor="end" class="axis">step {top:,}</text>'
                 f'<text x="{left - 8}" y="{step_h}" text-anchor="end" class="axis">0</text>')
    for lane, cls in enumerate(classes):
        y = gantt_top + lane * LANE
        parts.append(f'<rect x="{left}" y="{y}" width="{plot}" height="{LANE - 4}" fill="#f3f3f3"/>'
                     f'<text x="{left - 8}" y="{y + 14}" text-anchor="end" class="axis">{_e(cls)}</text>')
    for inc in incidents:
        lane = classes.index(str(inc["fault_class"]))
        y = gantt_top + lane * LANE
        tip = (f'{inc["id"]}: {inc["fault_class"]}, {inc["outcome"]}, TTR '
               f'{_fmt_s(inc["ttr_s"]) if inc["ttr_s"] is not None else "open"}; '
               + ", ".join(f'{p["phase"]} {p["seconds"]:.1f}s' for p in inc["phases"]))
        parts.append(f'<g class="incident-bar" data-incident="{_e(inc["id"])}"><title>{_e(tip)}</title>')
        for p in inc["phases"]:
            # every phase at least a sliver wide, so that a short incident in a long log stays visible
            w = max(2.0, plot * p["seconds"] / span) if p["seconds"] or p["phase"] != "detection" else 0
            if w:
                parts.append(f'<rect x="{x(p["start_s"]):.1f}" y="{y}" width="{w:.1f}" height="{LANE - 4}" '
                             f'fill="{PHASE_COLORS.get(p["phase"], "#607d8b")}"/>')
        parts.append("</g>")
        marked: set[int] = set()
        for fault in inc["faults"]:
            fx = x(fault["at_s"])
            if round(fx) in marked:  # faults a pixel apart are one marker
                continue
            marked.add(round(fx))
            parts.append(f'<path class="fault-marker" d="M{fx:.1f},{y - 1} l-5,-8 h10 z" fill="#c62828">'
                         f'<title>{_e(fault["reason"])}</title></path>')
    axis_y = gantt_top + LANE * len(classes) + 16
    for k in range(6):
        t = span * k / 5
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle" class="axis">{_fmt_s(t)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _mttr_chart(mttr: dict[str, dict[str, Any]]) -> str:
    """Mean seconds per phase of each fault class's incidents, stacked, with p50 and p95 time to recovery."""
    rows = list(mttr.items())
    left, right = 160, 200
    plot = WIDTH - left - right
    height = 40 + 30 * max(1, len(rows)) + 30
    longest = max([sum(m["mean_phase_s"].values()) for _, m in rows] + [1e-9])
    parts = [f'<svg class="chart" id="mttr-chart" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
             f'xmlns="http://www.w3.org/2000/svg" role="img"><title>time to recovery by phase and fault class</title>']
    for row, (cls, m) in enumerate(rows):
        y = 30 + 30 * row
        parts.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" class="axis">{_e(cls)} '
                     f'({m["incidents"]})</text>')
        at = float(left)
        for phase, seconds in m["mean_phase_s"].items():
            w = plot * seconds / longest
            if w > 0:
                parts.append(f'<rect x="{at:.1f}" y="{y}" width="{max(w, 1.5):.1f}" height="20" '
                             f'fill="{PHASE_COLORS.get(phase, "#607d8b")}"><title>{_e(phase)}: {seconds:.1f} s mean'
                             f'</title></rect>')
                at += w
        p50 = "-" if m["p50_s"] is None else _fmt_s(m["p50_s"])
        p95 = "-" if m["p95_s"] is None else _fmt_s(m["p95_s"])
        parts.append(f'<text x="{WIDTH - right + 8}" y="{y + 15}" class="axis">p50 {p50}, p95 {p95}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _legend() -> str:
    items = "".join(f'<span class="key"><i style="background:{c}"></i>{_e(p)}</span>' for p, c in PHASE_COLORS.items())
    return f'<div class="legend">{items}<span class="key"><b class="marker">&#9660;</b>fault</span></div>'


def _lemons(lemons: list[dict[str, Any]]) -> str:
    if not lemons:
        body = '<tr><td colspan="4">no node is in two or more incidents</td></tr>'
    else:
        rows = []
        for lemon in lemons:
            history = "; ".join(" ".join(str(h[k]) for k in ("incident", "class", "code") if h[k] is not None)
                                for h in lemon["history"])
            rows.append(f'<tr><td>{_e(lemon["node"])}</td><td>{lemon["incidents"]}</td>'
                        f'<td>{_e(", ".join(lemon["jobs"]))}</td><td>{_e(history)}</td></tr>')
        body = "".join(rows)
    return (f'<table class="chart lemons" id="lemons"><thead><tr><th>node</th><th>incidents</th><th>jobs</th>'
            f'<th>history</th></tr></thead><tbody>{body}</tbody></table>')


def _failed_checks(nodes: list[dict[str, Any]]) -> str:
    """Nodes whose health checks failed (none: no section at all)."""
    if not nodes:
        return ""
    rows = "".join(f'<tr><td>{_e(n["node"])}</td><td>{n["failed_runs"]}</td><td>{_e(", ".join(n["checks"]))}</td>'
                   f'<td>{_e(", ".join(n["when"]))}</td><td>{_e(n["saw"])}</td>'
                   f'<td>{"no" if n["passed_ns"] is None else "yes"}</td></tr>' for n in nodes)
    return ('<h2>Nodes that failed their health checks</h2><table class="chart checks" id="checks"><thead><tr>'
            '<th>node</th><th>failed runs</th><th>checks</th><th>when</th><th>last saw</th><th>passed since</th>'
            f'</tr></thead><tbody>{rows}</tbody></table>')


def _incident_table(job: dict[str, Any]) -> str:
    rows = []
    for inc in job["incidents"]:
        grans = " &rarr; ".join(_e(a["granularity"]) for a in inc["attempts"]) or "-"
        source = _e(checkpoint_text(inc["checkpoint"]))
        ttr = "-" if inc["ttr_s"] is None else ("&ge;" if inc["ttr_lower_bound"] else "") + f'{inc["ttr_s"]:.1f}'
        rows.append(f'<tr><td>{_e(inc["id"])}</td><td>{_e(inc["fault_class"])}</td>'
                    f'<td>{inc["detection_latency_s"]:.1f}</td><td>{grans}</td><td>{source}</td>'
                    f'<td>{"?" if inc["lost_steps"] is None else inc["lost_steps"]}</td>'
                    f'<td title="{_e(inc["ttr_basis"])}">{ttr}</td>'
                    f'<td>{inc["lost_gpu_hours"]:.2f}</td><td>{_e(inc["outcome"])}</td></tr>')
        if inc.get("stacks"):
            # the hang's localization: who stood out in the stacks taken before it was acted on
            lines = "<br>".join(_e(line) for line in describe(inc["stacks"]))
            rows.append(f'<tr class="stacks"><td></td><td colspan="8">{lines}</td></tr>')
    return ('<table class="incidents"><thead><tr><th>incident</th><th>fault</th><th>detect s</th><th>granularity'
            '</th><th>checkpoint</th><th>lost steps</th><th>TTR s</th><th>GPU-h</th><th>outcome</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


_CSS = """
body{font:13px system-ui,sans-serif;margin:20px;width:1200px;color:#222;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.bad{color:#c62828}
.axis{font:11px system-ui,sans-serif;fill:#555}
.legend{margin:6px 0}.key{margin-right:14px}.key i{display:inline-block;width:12px;height:12px;margin-right:4px;
vertical-align:middle}.marker{color:#c62828;margin-right:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f0f0f0}.summary td:first-child{font-weight:bold}
"""

_LAYOUT_SCRIPT = """
document.body.dataset.layout = JSON.stringify(Array.from(document.querySelectorAll('.chart')).map(function (c) {
  var r = c.getBoundingClientRect();
  return {id: c.id, x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height};
}));
"""


def _job_dead_letters(job: dict[str, Any]) -> str:
    failed = ""
    if job["policy_failures"]:
        items = "".join(f'<li>seq {_e(str(f["seq"]))} {_e(f["reason"])}</li>' for f in job["first_policy_failures"])
        failed = (f'<p class="bad">a policy failed {job["policy_failures"]:,} time(s); the built-in answered:</p>'
                  f'<ul class="bad">{items}</ul>')
    if not job["dead_letters"]:
        return failed
    items = "".join(f'<li>seq {_e(str(d["seq"]))} [{_e(d["code"])}] {_e(d["reason"])}</li>'
                    for d in job["first_dead_letters"])
    raised = job["policy_errors"] - job["policy_failures"]
    policy = f'; a policy raised {raised:,} time(s)' if raised else ""
    return (f'<p class="bad">{job["dead_letters"]:,} of this job\'s inputs were dead-lettered{policy}:</p>'
            f'<ul class="bad">{items}</ul>') + failed


def _never_ran(jobs: list[dict[str, Any]]) -> str:
    """The jobs that never ran: a table after the charts of those that did (they have no chart and no figure)."""
    if not jobs:
        return ""
    rows = "".join(f'<tr><td>{_e(j["job"])}</td><td>{j["gpus"]}</td><td>{_e(j["state"])}</td><td>{_e(j["reason"])}'
                   f'</td></tr>' for j in jobs)
    return (f'<h2>Jobs that never ran ({len(jobs)}): in no figure</h2><table class="never-ran"><thead><tr><th>job'
            f'</th><th>GPUs</th><th>state</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>')


def render_html(report: dict[str, Any]) -> str:
    s = report["summary"]
    ettr = "-" if s["ettr"] is None else ("&le;" if s["ettr_upper_bound"] else "") + f'{s["ettr"]:.4f}'
    summary = (f'<table class="summary"><tr><td>records</td><td>{report["records"]:,}</td></tr>'
               f'<tr><td>jobs / incidents</td><td>{s["jobs"]} / {s["incidents"]}'
               + (f' ({len(report["never_ran"])} more never ran)' if report["never_ran"] else "") + '</td></tr>'
               f'<tr><td>ETTR</td><td>{ettr}</td></tr>'
               f'<tr><td>lost GPU-hours</td><td>{s["lost_gpu_hours"]:,.2f} ('
               + _e(", ".join(f"{k} {v:,.2f}" for k, v in s["lost_gpu_hours_by_cause"].items())) + ')</td></tr>'
               f'<tr><td>restart loops</td><td>{s["restart_loops"]}</td></tr>'
               f'<tr><td>dead letters</td><td class="{"bad" if s["dead_letters"] else ""}">{s["dead_letters"]:,}'
               + (f' ({_e(", ".join(f"{k} {v:,}" for k, v in s["rejections"].items()))})' if s["dead_letters"]
                  else "")
               + (f'; a policy raised {s["policy_errors"]:,} time(s)' if s["policy_errors"] else "")
               + '</td></tr></table>')
    jobs, tables = [], []
    for index, job in enumerate(report["jobs"]):
        jobs.append(f'<h2>job {_e(job["job"])}: {job["gpus"]} GPUs, {_e(job["state"])} at step {job["step"]:,}, '
                    f'ETTR {"-" if job["ettr"] is None else ("&le;" if job["ettr_upper_bound"] else "")}'
                    f'{"" if job["ettr"] is None else format(job["ettr"], ".4f")}</h2>'
                    + (f'<p class="bad">failed: {_e(job["end_reason"])}</p>' if job["state"] == "failed"
                       and job["end_reason"] else "") + _job_dead_letters(job) + _timeline(job, index))
        opened = " open" if len(job["incidents"]) <= 30 else ""
        tables.append(f'<details{opened}><summary>incidents of job {_e(job["job"])} ({len(job["incidents"])})'
                      f'</summary>{_incident_table(job)}</details>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>recovery postmortem</title>'
            f'<meta name="report-version" content="{REPORT_VERSION}"><style>{_CSS}</style></head><body>'
            f'<h1>Postmortem</h1>{summary}{_legend()}{"".join(jobs)}{_never_ran(report["never_ran"])}'
            f'<h2>Time to recovery by phase and fault class (mean seconds per incident)</h2>'
            f'{_mttr_chart(s["mttr_by_fault_class"])}'
            f'<h2>Lemon candidates: nodes in two or more incidents</h2>{_lemons(report["lemons"])}'
            f'{_failed_checks(report.get("health_checks_failed", []))}'
            f'<h2>Incidents</h2>{"".join(tables)}'
            f'<script>{_LAYOUT_SCRIPT}</script></body></html>')


def write_html(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(report))

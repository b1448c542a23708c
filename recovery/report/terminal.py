"""The report in a terminal, with rich: the whole log, each job, each incident with its phases, attempts and the why
of every decision, and the lemon candidates."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from recovery.report.figures import checkpoint_text
from recovery.report.screen import Column, fitted_tables, screen_console
from recovery.report.stacks import describe

MAX_INCIDENTS = 50
TIMED_LISTED = 4
"""the what-if lists the commands it timed as recorded one by one up to this many, else counts them by kind"""
"""incidents shown in full per job in the terminal; --json and --html have all of them"""


def _num(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def _ettr(value: float | None, upper_bound: bool) -> str:
    """ETTR, `≤` when it is a bound (a script that reports no steps: the work it redid is not known)."""
    return ("≤" if upper_bound and value is not None else "") + _num(value, digits=4)


def _cause_text(inputs: dict[str, Any]) -> str:
    cause = inputs.get("cause")
    if cause is None:
        return f"seq {inputs['cause_seq']}"
    data = cause.get("data") or {}
    brief = " ".join(f"{k}={v}" for k, v in data.items() if k != "spec" and v not in (None, "", [], {}))
    where = cause.get("node") or cause.get("job") or ""
    return f"seq {inputs['cause_seq']} {cause['type']}@{where} {brief}"[:160]


def render(report: dict[str, Any], console: Console | None = None, decisions: bool = True) -> None:
    """Print the report. `decisions`: each incident's decisions with their why (policy, rule, inputs)."""
    console = console or screen_console()
    s = report["summary"]
    span = report["span"]
    console.print(Text.assemble(
        ("postmortem ", "bold"), f"of {report['records']:,} records over {span['seconds']:,.1f} s: ",
        f"{s['jobs']} job(s)", f" (and {len(report['never_ran'])} that never ran)" if report["never_ran"] else "",
        f", {s['incidents']} incident(s), ETTR ", (_ettr(s["ettr"], s["ettr_upper_bound"]), "bold"),
        f", lost {s['lost_gpu_hours']:,.2f} GPU-hours, {s['restart_loops']} restart loop(s)",
        *_dead_letters(s["dead_letters"], s["policy_errors"] - s["policy_failures"], s["rejections"]),
        *_policy_failures(s["policy_failures"])))
    console.print(_mttr_table(s["mttr_by_fault_class"], "time to recovery by fault class (whole log)"))
    console.print(_restarts_table(s["restarts_by_granularity"]))
    if s["lost_gpu_hours_by_cause"]:
        lost = Table(title="lost GPU-hours by cause (whole log)")
        Column("cause").add_to(lost)
        Column("GPU-hours", "number").add_to(lost)
        for cause, hours in s["lost_gpu_hours_by_cause"].items():
            lost.add_row(cause, f"{hours:,.3f}")
        console.print(lost)
    for job in report["jobs"]:
        _job(console, job, decisions)
    if report["never_ran"]:
        never = [[job["job"], str(job["gpus"]), job["state"], Text(job["reason"])] for job in report["never_ran"]]
        for table in fitted_tables("jobs that never ran (in no figure above)", NEVER_RAN_COLUMNS, never,
                                   console.width):
            console.print(table)
    lemons: list[list[str | Text]] = []
    for lemon in report["lemons"]:
        history = "; ".join(f"{h['incident']} {h['class'] or ''} {h['code'] or ''}".strip() for h in lemon["history"])
        lemons.append([lemon["node"], str(lemon["incidents"]), Text(", ".join(lemon["jobs"])),
                       Text(", ".join(map(str, lemon["devices_repeating"])) or "-"), Text(history)])
    for table in fitted_tables("lemon candidates: nodes in two or more incidents", LEMON_COLUMNS, lemons,
                               console.width) if lemons else []:
        console.print(table)
    if not lemons:
        console.print(Text("no lemon candidates: no node is in two incidents"))
    failed = [[node["node"], str(node["failed_runs"]), Text(", ".join(node["checks"])), Text(", ".join(node["when"])),
               Text(node["saw"]), "no" if node["passed_ns"] is None else "yes"]
              for node in report.get("health_checks_failed", [])]
    for table in fitted_tables("nodes that failed their health checks", CHECK_COLUMNS, failed,
                               console.width) if failed else []:
        console.print(table)
    for note in report["notes"]:
        console.print(f"note: {note}")


def _dead_letters(count: int, policy_errors: int, by_code: dict[str, int]) -> list[str | tuple[str, str]]:
    """What went wrong that no incident shows: inputs the engine refused, a policy that raised among them."""
    if not count:
        return []
    codes = ", ".join(f"{code} {n:,}" for code, n in by_code.items())
    out: list[str | tuple[str, str]] = [", ", (f"{count:,} dead letter(s)", "bold red"), f" ({codes})"]
    if policy_errors:
        out += [": ", (f"a policy raised {policy_errors:,} time(s)", "bold red")]
    return out


def _policy_failures(count: int) -> list[str | tuple[str, str]]:
    """A plugin that erred or looped: the built-in answered in its place (decisions `policy.failed`)."""
    if not count:
        return []
    return [", ", (f"a policy failed {count:,} time(s)", "bold red"), " (the built-in answered)"]


def _job(console: Console, job: dict[str, Any], decisions: bool) -> None:
    policies = ", ".join(job["policies"].values()) or "?"
    console.rule(Text(f"job {job['job']}", style="bold"))
    at = f"at step {job['step']:,}" if job["reports_steps"] else "(the script reports no steps)"
    console.print(f"{job['gpus']} GPUs on {job['nodes']} nodes, {policies}; {job['state']} {at}; "
                  f"wall {job['wall_s']:,.1f} s, ETTR {_ettr(job['ettr'], job['ettr_upper_bound'])}, lost "
                  f"{job['lost_gpu_hours']:,.3f} GPU-hours, step time {_num(job['step_time_s'], ' s', 3)}, "
                  f"{job['restart_loops']} restart loop(s)")
    if job["state"] == "failed" and job["end_reason"]:
        console.print(Text(f"failed: {job['end_reason']}", style="bold red"))
    if job["dead_letters"]:
        console.print(Text.assemble(*_dead_letters(job["dead_letters"], job["policy_errors"] - job["policy_failures"],
                                                   job["dead_letters_by_code"])))
        for letter in job["first_dead_letters"]:
            console.print(Text(f"  seq {letter['seq']} [{letter['code']}] {letter['reason']}", style="red"))
    if job["policy_failures"]:
        console.print(Text(f"a policy failed {job['policy_failures']:,} time(s); the built-in answered:",
                           style="bold red"))
        for failure in job["first_policy_failures"]:
            console.print(Text(f"  seq {failure['seq']} {failure['reason']}", style="red"))
    rows = [_incident_row(inc) for inc in job["incidents"][:MAX_INCIDENTS]]
    for table in fitted_tables(f"incidents of {job['job']}", INCIDENT_COLUMNS, rows, console.width):
        console.print(table)
    for inc in job["incidents"][:MAX_INCIDENTS]:
        for line in _agent_exits(inc):
            console.print(Text(line, style="bold red"))
    for measured, basis in dict.fromkeys((inc["ttr_s"] is not None, inc["ttr_basis"])
                                         for inc in job["incidents"][:MAX_INCIDENTS]):
        console.print(Text(f"TTR {'measured to' if measured else 'not measured'}: {basis}", style="dim"))
    if job["incidents"] and not job["reports_steps"]:
        console.print(Text("the script reports no steps: the work it redid since its own snapshot is not known, and "
                           "lost time ends when it ran again", style="dim"))
    if len(job["incidents"]) > MAX_INCIDENTS:
        console.print(f"... and {len(job['incidents']) - MAX_INCIDENTS} more incidents (see --json or --html)")
    if not decisions:
        return
    for inc in job["incidents"][:MAX_INCIDENTS]:
        console.print(_incident_panel(inc))


NEVER_RAN_COLUMNS = (Column("job"), Column("GPUs", "number"), Column("state"), Column("why", "text"))
LEMON_COLUMNS = (Column("node"), Column("incidents", "number"), Column("jobs", "text"),
                 Column("devices repeating", "text"), Column("history", "text"))
CHECK_COLUMNS = (Column("node"), Column("failed\nruns", "number"), Column("checks", "text"), Column("when", "text"),
                 Column("last saw", "text"), Column("passed\nsince"))
"""a node whose checks failed: as often and where, what the last failure saw, and whether a later run passed"""
INCIDENT_COLUMNS = (Column("incident"), Column("fault", "text"), Column("first\nrank", "number"),
                    Column("detect\ns", "number"), Column("decide\ns", "number"), Column("granularity", "text"),
                    Column("checkpoint", "text"), Column("lost\nsteps", "number"), Column("TTR s", "number"),
                    Column("GPU-h", "number"), Column("outcome"))
"""an incident's row: what names it first, then what struck and how it was answered, then the figures"""


def _incident_row(inc: dict[str, Any]) -> list[str | Text]:
    root = inc["root_faults"][0] if inc["root_faults"] else {}
    fault = f"{inc['fault_class']} {root.get('code') or ''}".strip()
    grans = " -> ".join(a["granularity"] for a in inc["attempts"]) or "-"
    return [inc["id"], Text(fault), str(inc["first_failing_rank"] if inc["first_failing_rank"] is not None else "-"),
            _num(inc["detection_latency_s"], digits=2), _num(inc["decision_latency_s"], digits=2), Text(grans),
            Text(checkpoint_text(inc["checkpoint"])), "?" if inc["lost_steps"] is None else str(inc["lost_steps"]),
            ("≥" if inc["ttr_lower_bound"] else "") + _num(inc["ttr_s"]), _num(inc["lost_gpu_hours"], digits=3),
            inc["outcome"] + (" (loop)" if inc["restart_loop"] else "")]


def _agent_exits(inc: dict[str, Any]) -> list[str]:
    """The root cause when it was the control plane's own part: a node's agent that stopped (crashed, killed), as
    the agent that started after it said."""
    said = dict.fromkeys((node, f["agent_exit"]) for f in inc["root_faults"] if f.get("agent_exit")
                         for node in f["nodes"])
    return [f"{inc['id']}: the agent of {node} {why} (said by the agent that started after it)"
            for node, why in said]


def _incident_panel(inc: dict[str, Any]) -> Panel:
    phases = "  ".join(f"{p['phase']} {p['seconds']:.1f}s" for p in inc["phases"] if p["seconds"] or
                       p["phase"] != "detection")
    lines: list[Any] = [Text(f"phases: {phases}")]
    lines.extend(Text(line, style="bold red") for line in _agent_exits(inc))
    for esc in inc["escalations"]:
        lines.append(Text(f"escalated {esc['from']} -> {esc['to']} ({esc['after']}): {esc['reason']}",
                          style="yellow"))
    if inc["dying_checkpoint"]:
        d = inc["dying_checkpoint"]
        lines.append(Text(f"dying checkpoint at step {d['step']} {d['how']}: {d['outcome'] or 'pending'}"))
    if inc.get("stacks"):
        lines.extend(Text(line, style="magenta") for line in describe(inc["stacks"]))
    if inc["lost_gpu_hours_by_phase"]:
        lines.append(Text("GPU-hours lost: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                         inc["lost_gpu_hours_by_phase"].items())))
    # Three columns whatever the width: the decision and its policy are identifiers (never broken), the rule and
    # its cause free text beneath each other, which at 80 columns leaves the text most of the line.
    why = Table(show_header=True, box=None, pad_edge=False)
    why.add_column("seq", justify="right", no_wrap=True)
    why.add_column("decision / policy", no_wrap=True)
    why.add_column("rule / cause", overflow="fold")
    for d in inc["decisions"]:
        why.add_row(str(d["seq"]), Text.assemble(d["kind"], "\n", (d["policy"], "dim")),
                    Text.assemble(d["rule"], "\n", (_cause_text(d["inputs"]), "dim")))
    lines.append(why)
    return Panel(Group(*lines), title=f"{inc['id']}: {inc['fault_class']}, {inc['outcome']}", title_align="left")


def _mttr_table(mttr: dict[str, dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in ("class", "incidents", "recovered", "p50 s", "p95 s"):
        Column(column, "ident" if column == "class" else "number").add_to(table)
    bounded = False
    for cls, m in mttr.items():
        at_least = "≥" if m.get("lower_bounds") else ""  # some of the times are lower bounds: so are the figures
        bounded = bounded or bool(at_least)
        table.add_row(cls, str(m["incidents"]), str(m["recovered"]), at_least + _num(m["p50_s"]),
                      at_least + _num(m["p95_s"]))
    if bounded:
        table.caption = ("≥: among the times, lower bounds (restarts of scripts that report no steps and printed "
                         "nothing)")
    return table


def _restarts_table(restarts: dict[str, dict[str, int]]) -> Table:
    outcomes = ("started", "recovered", "failed", "timed_out", "superseded")
    table = Table(title="recovery attempts by granularity")
    Column("granularity").add_to(table)
    for column in outcomes:
        Column(column, "number").add_to(table)
    for granularity, counts in restarts.items():
        table.add_row(granularity, *(str(counts.get(o, 0)) for o in outcomes))
    return table


def _side(row: dict[str, Any] | None, change: str = "") -> Text:
    """One side of a differing decision; the policy on a line of its own, since half of 80 columns is less than a
    decision and a plugin's name together. `change`: the hunk's (replace, insert, delete), on the left side."""
    text = Text(f"{change}\n" if change else "", style="dim")
    if row is None:
        return text.append("-")
    text.append(f"#{row['seq']} +{row['at_s']:.1f}s {row['kind']}", style="bold")
    text.append(f"\n[{row['policy']}]\n{row['rule']}")
    if row["commands"]:
        text.append(f"\ncommands: {', '.join(row['commands'])}")
    text.append(f"\ncause: {row['cause']}", style="dim")
    return text


def render_diff(diff: dict[str, Any], console: Console | None = None, limit: int = 40) -> None:
    """Print a diff of two logs' decisions: policies that differ, the first differing input and decision, then
    every differing hunk side by side (the first `limit` rows)."""
    console = console or screen_console()
    a, b = diff["labels"]
    if diff["same"]:
        console.print(f"same decisions: {a} and {b} decided alike ({diff['records'][0]:,} and "
                      f"{diff['records'][1]:,} records)")
    for p in diff["policies"]:
        console.print(Text(f"job {p['job']} {p['family']} policy differs ({', '.join(p['changed'])}): "
                           f"{a} {p[a]} / {b} {p[b]}", style="yellow"))
    first_input = diff["first_input_difference"]
    if first_input is not None:
        sides = " / ".join(f"{k} {first_input[k]['input'] if first_input[k] else 'ends'}" for k in (a, b))
        console.print(Text(f"inputs differ from input #{first_input['index']}: {sides}"))
    first = diff["first_decision_difference"]
    if first is None:
        return
    console.print(Text(f"first differing decision (job {first['job']}, decision #{first['index']}):", style="bold"))
    table = Table(show_lines=True)
    table.add_column(a, overflow="fold", ratio=1)
    table.add_column(b, overflow="fold", ratio=1)
    table.add_row(_side(first[a]), _side(first[b]))
    console.print(table)
    rows = 0
    for job in diff["jobs"]:
        if job["same"]:
            continue
        table = Table(title=f"job {job['job']}: decisions that differ ({job['decisions'][0]} and "
                            f"{job['decisions'][1]} decisions)", show_lines=True)
        table.add_column(a, overflow="fold", ratio=1)
        table.add_column(b, overflow="fold", ratio=1)
        for hunk in job["hunks"]:
            for left, right in _pairs(hunk[a], hunk[b]):
                if rows >= limit:
                    break
                table.add_row(_side(left, hunk["change"]), _side(right))
                rows += 1
        console.print(table)
    total = sum(max(len(h[a]), len(h[b])) for job in diff["jobs"] for h in job["hunks"])
    if total > rows:
        console.print(f"... {total - rows} more rows (--json has them all)")


def _pairs(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    return [(left[i] if i < len(left) else None, right[i] if i < len(right) else None)
            for i in range(max(len(left), len(right)))]


def render_whatif(result: dict[str, Any], console: Console | None = None, limit: int = 40) -> None:
    """Print a what-if: what was kept and re-simulated, the figures of both simulated runs, the decisions that
    differ."""
    console = console or screen_console()
    recorded, chosen = result["policies"]["recorded"], result["policies"]["what-if"]
    changed = [f"{f}: {recorded[f]['name']} -> {chosen[f]['name']}"
               + (f" {chosen[f]['params']}" if chosen[f]["params"] else "")
               for f in chosen if chosen[f] != recorded[f]]
    console.print(Text.assemble(("what-if ", "bold"), f"of {result['log']} (job {result['job']}): ",
                                "; ".join(changed) or "the recorded policies"))
    c = result["cluster"]
    step_from = {"measured": "measured", "given": "--step-time-s"}.get(c["step_time_from"],
                                                                      "assumed: the job reported none; --step-time-s")
    params_from = ("as given" if c.get("model_params_from") == "--model-params"
                   else "assumed: the most one replica holds; --model-params")
    console.print(f"the simulated cluster: {c['nodes']} nodes of {c['ranks_per_node']} ranks, {c['spares']} spares, "
                  f"layout {c['layout']}, a {c['model_params'] / 1e9:,.3g}B-parameter model ({params_from}"
                  f"), {c['step_time_s']} s a step ({step_from}), storage checkpoint every "
                  f"{c['storage_every_s'] or '-'} s, {c['days'] * 86_400:,.0f} s (the log's span and "
                  f"{c['tail_s']:,.0f} s more with no faults); executors "
                  f"{'fail as the cost model says' if c['executor_failures'] else 'never fail'}")
    if c.get("report_every_s"):
        console.print(f"the recorded engine found a silence: every simulated rank reports each {c['report_every_s']:g} "
                      f"s (the recorded agents' period) and the engine watches every {c['watchdog_interval_s']:g} s "
                      f"(the recorded spec's)")
    inputs = result["inputs"]
    _render_choice(result, console)
    console.print(Text(f"kept from the log ({inputs['faults']} faults): "
                       + ", ".join(f"{k} {v}" for k, v in inputs["kept"].items())))
    if inputs.get("executors"):
        console.print(Text("replayed from the log, for the simulated commands of the same kind and order, the "
                           "recorded executors' answers: " + "; ".join(inputs["executors"])))
    timed = inputs.get("timed_as_recorded") or {}
    if timed.get("commands"):
        # a long night carries out thousands of commands: past a few, how many of each kind is what reads
        listed = ("; ".join(timed["answers"]) if timed["commands"] <= TIMED_LISTED
                  else ", ".join(f"{k} {v}" for k, v in timed["by_kind"].items()))
        console.print(Text(f"{timed['commands']} commands timed as recorded (decision to done ack), for the simulated "
                           f"commands of the same kind and order: {listed}", style="dim"))
    console.print(Text("re-simulated (answers to the recorded decisions, training, timers): "
                       + ", ".join(f"{k} {v}" for k, v in inputs["resimulated"].items()), style="dim"))
    measured = [f"{k} {v['value']}" for k, v in result["calibration"].items() if v["from"] == "measured"]
    console.print(Text("measured from the log: " + (", ".join(measured) or "nothing"), style="dim"))
    for name, figure in result["assumed"].items():
        console.print(Text(f"assumed: {name} {figure['value']} ({figure['how']})", style="yellow"))
    _render_reproduction(result["reproduction"], console)
    spans = result["figures"]
    title = "figures over the log's span, as `report` counts them on every log"
    if not result["reproduction"]["reproduced"]:
        title += " (the simulated run does not reproduce the log: compare the simulated columns with each other)"
    table = Table(title=title)
    for column in ("", "recorded log", "recorded policies", "what-if", "difference"):
        table.add_column(column, justify="right" if column else "left")
    rec, base, what = spans["recorded log"], spans["recorded policies"], spans["what-if"]

    def delta(x: float | None, y: float | None, digits: int) -> str:
        return "-" if x is None or y is None else f"{y - x:+.{digits}f}"

    table.add_row("ETTR", _num(rec["ettr"], digits=4), _num(base["ettr"], digits=4), _num(what["ettr"], digits=4),
                  delta(base["ettr"], what["ettr"], 4))
    table.add_row("lost GPU-hours", _num(rec["lost_gpu_hours"], digits=3), _num(base["lost_gpu_hours"], digits=3),
                  _num(what["lost_gpu_hours"], digits=3), delta(base["lost_gpu_hours"], what["lost_gpu_hours"], 3))
    classes = sorted(set(rec["mttr_by_fault_class"]) | set(base["mttr_by_fault_class"])
                     | set(what["mttr_by_fault_class"]))
    for cls in classes:
        x, y, z = (side["mttr_by_fault_class"].get(cls, {}).get("p50_s") for side in (rec, base, what))
        table.add_row(f"MTTR p50 {cls} (s)", _num(x), _num(y), _num(z), delta(y, z, 1))
    console.print(table)
    sim = result["delta"]
    console.print(Text(f"the simulator's own ledger over the span and the {result['cluster']['tail_s']:,.0f} s tail "
                       f"(checkpoint stalls included, MTTR from the fault itself): ETTR {sim['ettr']:+.4f}, lost "
                       f"GPU-hours {sim['lost_gpu_hours']:+.3f}", style="dim"))
    render_diff(result["diff"], console, limit)


def _render_choice(result: dict[str, Any], console: Console) -> None:
    """Which job was replayed and why, the jobs left out, and the history the simulated engine heard first."""
    choice = result.get("job_choice") or {}
    console.print(Text(f"job {result['job']}: {choice.get('why') or 'as asked (--job)'}"))
    left_out = choice.get("left_out") or []
    alongside = [o["job"] for o in left_out if o["alongside"]]
    before = [o["job"] for o in left_out if not o["alongside"]]
    if alongside:
        console.print(Text(f"left out: the simulator runs one job; the log's jobs alongside it "
                           f"({', '.join(alongside)}) and their inputs are not simulated", style="yellow"))
    if before:
        incidents = {o["job"]: o["incidents"] for o in left_out}
        console.print(Text("left out, all their records before the job was submitted (what the job's nodes said "
                           "then is replayed as history): " + ", ".join(
            f"{job} ({incidents[job]} incident(s))" for job in before), style="dim"))
    history = result["inputs"].get("history") or {}
    if history.get("events"):
        console.print(Text(f"the cluster's history, heard by the simulated engine before the job's submission at its "
                           f"recorded times: {history['events']} node events of its nodes ("
                           + ", ".join(f"{k} {v}" for k, v in history["by_kind"].items()) + ")"))
    for left in history.get("left") or []:
        console.print(Text(f"out of service before the job, where the simulated node joins healthy: {left}",
                           style="yellow"))


def _render_reproduction(rep: dict[str, Any], console: Console) -> None:
    """Whether the recorded policies, simulated, repeat the recorded night; if not, where they part and why."""
    tolerance = rep["tolerance_s"]
    decisions = ", ".join(f"{d['decision']} {d['at_s']:g}s" for d in rep["recorded"][:12])
    if rep["reproduced"]:
        console.print(Text(f"reproduced: the recorded policies, simulated, repeat the log's {len(rep['recorded'])} "
                           f"recovery decisions and its MTTR per class within {tolerance:g} s ({decisions})",
                           style="green"))
        return
    first = rep["first_difference"]
    where = "MTTR differs by more than the tolerance" if first is None else (
        f"decision #{first['index']}: recorded {_decision_at(first['recorded'])}, "
        f"simulated {_decision_at(first['simulated'])}")
    console.print(Text(f"NOT reproduced within {tolerance:g} s: {where}", style="bold red"))
    for cls, m in rep["mttr_by_fault_class"].items():
        if not m["within_tolerance"]:
            console.print(Text(f"  MTTR p50 {cls}: recorded {_num(m['recorded_p50_s'])} s, simulated "
                               f"{_num(m['simulated_p50_s'])} s", style="red"))
    why = rep["not_recreated"] or ["none the log shows: the simulator's model of the cluster differs from it"]
    for reason in why:
        console.print(Text(f"  the simulator does not re-create: {reason}", style="red"))


def _decision_at(decision: dict[str, Any] | None) -> str:
    return "nothing" if decision is None else f"{decision['decision']} at {decision['at_s']:g} s"

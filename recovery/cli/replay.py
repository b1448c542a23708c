"""`recovery-replay`: rebuild every state and decision from a log, for postmortems and audit.

    recovery-replay run LOG              final state of each job, incidents and decision counts
    recovery-replay verify LOG [--job J] re-derive every decision and diff against the recorded ones
    recovery-replay timeline LOG --job J events, states and decisions of one job, in order
    recovery-replay export --nats URL [--job J] [--since T] [-o FILE]
                                         the JetStream log as JSONL (the format LOG is in)
    recovery-replay report LOG [--job J] [--since T] [--until T] [--json] [--html FILE]
                                         the postmortem: incidents, phases, MTTR, lost GPU-hours, lemons, why
    recovery-replay whatif LOG --policy FAMILY=NAME[:k=v,...]
                                         the log's faults under other policies, the cluster simulated
    recovery-replay diff A B             the decisions that differ between two logs, side by side

Each of run, verify, timeline and report reads a JSONL export (LOG) or, with `--nats URL`, the live JetStream
stream (`--stream`, default RECOVERY); whatif and diff read exports. Every command, export too, also takes a data
directory as LOG: a `recovery-run --standalone` run's or a daemon's, read through a nats-server started on a copy of
its store and stopped when the command ends (the log of a daemon that still runs, at its URL). Each takes `--json`
for machine-readable output (report's shape is versioned and documented in docs/on-call.md, "report"); diff exits 1
when the decisions differ. Exit status: 0 fine, 1 divergence, 2 bad usage or unreadable log (a line that is not a
record, a last line cut short, a recorded decision of a schema this version cannot read: each named with its line;
a data directory that holds no log).

A per-job export (`export --job J`) keeps every input record, since the engine's decisions for J depend on
the whole cluster (node events, spares other jobs took), and leaves out only other jobs' outputs except
their job.accepted; its header names J, and verify then compares J's decisions, J's dead letters and those
naming no job, and every job's acceptance: exact whenever verify of the whole log is. An export cut by
--since or --start-seq lacks the state before it: verify says it cannot be exact instead of calling a
divergence a bug.

verify explains a divergence from the policies in force for the job (`job.accepted` names each policy as
name@version; the replay names what is installed now): a changed policy, a policy whose plugin is not
installed (named), or, with the same policies, a bug. Records are told apart by subject: only records on
decision and dead-letter subjects are recorded outputs; anything on an event subject is an input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from events.codec import encode_record
from recovery.cli.replay_source import (
    connect_log,
    log_partitions,
    open_data_dirs,
    partition_replays,
    report_records,
)
from recovery.cli.timeline import cmd_timeline
from recovery.cli.timeline import timeline_rows as timeline_rows  # where it was defined before its own module
from recovery.log import ExportHeader, export_filter
from recovery.log.verify import (
    LogReplay,
    UnreadableLog,
    canonical,
    caveats,
    dead_letters_compared,
    first_divergence,
    forged_timers,
    in_scope,
    rejection_divergence,
    rejection_in_scope,
    unfired_timers,
)
from recovery.report import source as report_source
from recovery.report.diff import diff_logs
from recovery.report.fold import build_report
from recovery.report.html import write_html
from recovery.report.whatif import TOLERANCE_S, whatif

NS = 1_000_000_000
EXPORT_HELP = "JSONL export of the log, or the data directory of a `recovery-run --standalone` run or of a daemon"
LOG_HELP = f"{EXPORT_HELP} (or --nats)"


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str, now_ns: int | None = None) -> int:
    """`--since`: nanoseconds since the epoch, an ISO 8601 time (UTC unless it says), or an age such as
    `90s`, `15m`, `2h`, `1d` before now."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    match = _RELATIVE.match(text)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86_400}[match.group(2)]
        now = time.time_ns() if now_ns is None else now_ns
        return now - int(float(match.group(1)) * unit * NS)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: give nanoseconds, an ISO 8601 time or an age like 15m") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp()) * NS + when.microsecond * 1000


def cmd_export(args: argparse.Namespace) -> int:
    if not args.nats:
        raise ValueError("give a data directory or --nats URL")
    since = parse_since(args.since) if args.since else None
    count = asyncio.run(_export(args.nats, args.stream, args.output, args.job, since, args.start_seq))
    if args.output != "-":
        print(f"{count} records written to {args.output}", file=sys.stderr)
    return 0


async def _export(url: str, stream: str, output: str, job: str | None, since: int | None, start_seq: int) -> int:
    log = await connect_log(url, stream)
    try:
        if output != "-":
            return int(await log.export(output, start_seq, job, since, replayable=True))
        # The same header and filter as the file export above (recovery.log.export_log), to standard output.
        count = 0
        out = sys.stdout.buffer
        header = ExportHeader.for_filters(job, since, start_seq, replayable=True)
        if header is not None:
            out.write(header.encode() + b"\n")
        keep = export_filter(job, since, replayable=True)
        async for record in log.read(start_seq):
            if keep(record):
                out.write(encode_record(record) + b"\n")
                count += 1
        out.flush()
        return count
    finally:
        await log.close()


def _json(obj: Any) -> bytes:
    """Indented JSON; integers beyond 64 bits (which orjson refuses) through the standard library."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2)
    except orjson.JSONEncodeError:
        return json.dumps(obj, indent=2, default=str).encode()


def cmd_run(args: argparse.Namespace) -> int:
    replays = partition_replays(args, None, every=True)
    first = replays[0].partition
    count = None if first is None else first.count  # None: a log of one partition
    # A partitioned log's partitions each decided alone about their own jobs: their answers side by side are the
    # log's, each job with its partition; a node event's dead letter, which every partition derives, counted once.
    jobs: dict[str, dict[str, Any]] = {}
    decisions: list[tuple[tuple[int, int, int], Any]] = []
    rejections: dict[tuple[int, str, str], Any] = {}
    notes: list[str] = []
    for part in replays:
        index = -1 if part.partition is None else part.partition.index
        for job_id, job in part.replay.engine.snapshot()["jobs"].items():
            jobs[job_id] = job if part.partition is None else {**job, "partition": index}
        decisions += [((d.cause_seq, index, d.index), d) for d in part.replay.decisions]
        for rej in part.replay.rejections:
            rejections.setdefault((rej.seq, rej.code, rej.reason), rej)
        notes += [n for n in [*(f"the replay cannot be exact: {c}" for c in caveats(part.replay)),
                              *part.replay.unreadable] if n not in notes]
    ordered = [d for _, d in sorted(decisions, key=lambda pair: pair[0])]
    if count is not None:  # several engines' jobs: in the order of their ids (one engine's: in its own order)
        jobs = dict(sorted(jobs.items()))
    rejected = [r for _, r in sorted(rejections.items(), key=lambda pair: pair[0][0])]
    inputs = replays[0].log_inputs
    if args.json:
        out: dict[str, Any] = {"inputs": inputs, "jobs": jobs,
                               "decisions": [d.model_dump(mode="json") for d in ordered],
                               "rejections": [r.model_dump(mode="json") for r in rejected]}
        if count is not None:
            out["partitions"] = count
        sys.stdout.buffer.write(_json(out) + b"\n")
        return 0
    where = "" if count is None else f" in {count} partitions"
    print(f"{inputs} input records, {len(ordered)} decisions, {len(rejected)} rejections{where}")
    for job_id, job in jobs.items():
        part_of = "" if count is None else f" (partition {job['partition']})"
        print(f"\njob {job_id}{part_of}: {job['state']} at step {job['step']}, generation {job['generation']}, "
              f"{job['alive']}/{job['world']} ranks alive, nodes {', '.join(job['nodes'])}")
        print(f"  policies: {', '.join(job['policies'].values())}; restarts used {job['restarts_used']}")
        for inc in job["incidents"] + ([job["incident"]] if job["incident"] else []):
            mttr = "" if inc["closed"] is None else f", {(inc['closed'] - inc['opened']) / NS:.1f}s"
            grans = " -> ".join(f"{a['granularity']}({a['outcome']})" for a in inc["attempts"])
            print(f"  incident {inc['id']}: {inc['fault_class'] or inc['cause']}, {inc['outcome'] or 'open'}"
                  f"{mttr}, lost steps {'?' if inc['lost_steps'] is None else inc['lost_steps']}; {grans}")
    for rej in rejected:
        print(f"rejected seq {rej.seq} [{rej.code}]: {rej.reason}")
    for note in notes:
        print(f"note: {note}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    replays = [(r.partition, r.replay) for r in partition_replays(args, args.job)]
    if len(replays) == 1 and replays[0][0] is None:
        ok, out = _verify_one(replays[0][1], args, "")
        if args.json:
            sys.stdout.buffer.write(_json(out) + b"\n")
        return 0 if ok else 1
    # A partitioned log: each partition's engine read its own jobs' events and every node's, and decided alone.
    results = [(part, *_verify_one(result, args, f"partition {part.index} of {part.count}: "))
               for part, result in replays if part is not None]
    ok = all(good for _, good, _ in results)
    if args.json:
        sys.stdout.buffer.write(_json({"ok": ok, "partitions": results[0][0].count, "results": [
            {"partition": part.index, **out} for part, _, out in results]}) + b"\n")
    return 0 if ok else 1


def _verify_one(result: LogReplay, args: argparse.Namespace, label: str) -> tuple[bool, dict[str, Any]]:
    """Compare one replay's decisions and dead letters with the recorded ones: (ok, the JSON answer); the text
    answer is printed unless --json, each line after `label`."""
    if result.unreadable:
        more = f" (and {len(result.unreadable) - 1} more)" if len(result.unreadable) > 1 else ""
        raise UnreadableLog(f"{result.unreadable[0]}{more}: use the recovery-replay of the version that wrote it")
    job = result.job
    divergence = first_divergence(result)
    letters = rejection_divergence(result)
    ok = divergence is None and letters is None
    limits = caveats(result)
    notes = [f"{len(result.foreign)} records on output subjects are not decisions or dead letters, so the engine "
             f"did not write them (first: {result.foreign[0]}); not compared"] if result.foreign else []
    rejected = [r for r in result.rejections if rejection_in_scope(r, job)]
    if rejected and not dead_letters_compared(result):
        notes.append(f"the log holds no dead letters; the replay rejects {len(rejected)} records "
                     f"(first: seq {rejected[0].seq} [{rejected[0].code}]); not compared")
    compared = [d for d in result.decisions if in_scope(d, job)]
    recorded = [d for d in result.recorded_decisions if in_scope(d, job)]
    # A log with nothing in it (an empty file, a stream read before anything came, a job name mistyped) proves
    # nothing: "ok" there would pass a check that never ran.
    unfired = unfired_timers(result, job) if isinstance(result, LogReplay) else []
    forged = forged_timers(result, job)
    if unfired or forged:
        ok = False
    empty = (not result.inputs and not recorded and not result.recorded_rejections) or \
        (job is not None and job not in result.engine.jobs and not limits)  # a cut export may start after it
    if empty:
        ok = False
        notes.insert(0, "nothing to verify: the log holds no input event" if job is None else
                     f"nothing to verify: job {job} was never submitted in this log")
    if args.json:
        out = {"ok": ok, "empty": empty, "unfired_timers": unfired, "forged_timers": forged, "job": job,
               "exact": not limits, "caveats": limits, "notes": notes,
               "inputs": result.inputs, "decisions": len(compared), "recorded": len(recorded),
               "divergence": None if divergence is None else divergence.as_dict(),
               "rejections_match": letters is None,
               "rejection_divergence": None if letters is None else letters.as_dict()}
        return ok, out
    out = {"ok": ok}
    if divergence is not None:
        print(f"{label}DIVERGENCE at decision #{divergence.index} (caused by seq {divergence.cause_seq}): "
              f"{divergence.verdict}")
        if divergence.recorded is not None:
            print(f"  recorded: {canonical(divergence.recorded).decode()}")
        if divergence.derived is not None:
            print(f"  replayed: {canonical(divergence.derived).decode()}")
    elif letters is not None:
        print(f"{label}DIVERGENCE in rejections: {letters.verdict}")
    elif empty:
        print(f"{label}EMPTY: {notes.pop(0)}")
    elif forged:
        print(f"{label}FORGED TIMER FIRINGS: {len(forged)}, dead-lettered; decisions match otherwise")
        for line in forged[:20]:
            print(f"  {line}")
    elif unfired:
        print(f"{label}TIMERS NEVER FIRED: {len(unfired)}; decisions match otherwise")
        for line in unfired[:20]:
            print(f"  {line}")
    else:
        which = "" if job is None else f" (job {job}'s and every job's acceptance)"
        print(f"{label}ok: {len(compared)} decisions{which} from {result.inputs} inputs match the "
              f"{len(recorded)} recorded")
    for note in notes:
        print(f"note: {note}")
    if ok:
        for limit in limits:
            print(f"note: the replay cannot be exact, so this check is not either: {limit}")
    return ok, out


def cmd_report(args: argparse.Namespace) -> int:
    since = parse_since(args.since) if args.since else None
    until = parse_since(args.until) if args.until else None
    report = build_report(report_records(args), job=args.job, since=since, until=until)
    if args.html:
        write_html(report, args.html)
        print(f"report written to {args.html}", file=sys.stderr)
    if args.json:
        sys.stdout.buffer.write(_json(report) + b"\n")
    elif not args.html:
        # imported here for start-up time (rich takes 40 ms), as timeline does
        from recovery.report.terminal import render

        render(report, decisions=not args.brief)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = getattr(args, "shown", None) or (args.a, args.b)  # a data directory read as an export: named as given
    diff = diff_logs(report_source.iter_file(args.a), report_source.iter_file(args.b), job=args.job,
                     labels=(a, b) if a != b else ("A", "B"))
    if args.json:
        sys.stdout.buffer.write(_json(diff) + b"\n")
    else:
        from recovery.report.terminal import render_diff

        render_diff(diff, limit=args.limit)
    return 0 if diff["same"] else 1


def cmd_whatif(args: argparse.Namespace) -> int:
    result = whatif(args.log, args.policy, job=args.job, model_params=args.model_params,
                    executor_failures=args.executor_failures, keep_logs=args.keep_logs, tail_s=args.tail_s,
                    partitions=log_partitions(args.log, args.partitions), step_time_s=args.step_time_s,
                    tolerance_s=args.tolerance_s, node_not_ready_s=args.node_not_ready_s)
    if args.json:
        sys.stdout.buffer.write(_json(result) + b"\n")
    else:
        from recovery.report.terminal import render_whatif

        render_whatif(result, limit=args.limit)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, helptext in (("run", cmd_run, "final state of each job and the decisions"),
                                 ("verify", cmd_verify, "re-derive decisions and diff with the recorded ones"),
                                 ("timeline", cmd_timeline, "events, states and decisions of one job")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("log", nargs="?", help=LOG_HELP)
        p.add_argument("--nats", metavar="URL", help="read the live JetStream log instead of a file")
        p.add_argument("--stream", default="RECOVERY", help="the log's stream with --nats (default RECOVERY)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name == "timeline":
            p.add_argument("--job", required=True)
            p.add_argument("--all", action="store_true", help="include the signs of life: heartbeats of ranks and "
                                                             "agents, steps, progress reports and watchdog ticks")
        if name == "verify":
            p.add_argument("--job", help="compare only this job's decisions and dead letters, and every job's "
                                         "acceptance (a per-job export names its job itself)")
        if name in ("run", "verify"):
            p.add_argument("--partitions", type=int, metavar="P",
                           help="the log's partitions (default: read from the log); a partitioned log is "
                                "replayed partition by partition, each through an engine of its own")
    p = sub.add_parser("report", help="the postmortem of a log: incidents, phases, MTTR, lost GPU-hours, lemons",
                       description="The postmortem of a log, streamed (one record at a time): per incident the root "
                                   "faults, detection and decision latency, phases, escalations, checkpoint source, "
                                   "lost steps and GPU-hours, and why each decision was taken; per job and overall "
                                   "ETTR, MTTR by fault class, restarts by granularity and restart loops; nodes in "
                                   "several incidents. --json prints the versioned shape of docs/on-call.md.")
    p.add_argument("log", nargs="?", help=LOG_HELP)
    p.add_argument("--nats", metavar="URL", help="read the live JetStream log instead of a file")
    p.add_argument("--stream", default="RECOVERY", help="the log's stream with --nats (default RECOVERY)")
    p.add_argument("--job", help="only this job's incidents and decisions")
    p.add_argument("--since", help="only records at or after this log time: ns, ISO 8601, or an age (15m, 2h)")
    p.add_argument("--until", help="only records at or before this log time (same forms as --since)")
    p.add_argument("--json", action="store_true", help="the report as JSON (shape version in its `report` field)")
    p.add_argument("--html", metavar="FILE", help="also write one self-contained HTML file with the charts")
    p.add_argument("--brief", action="store_true", help="terminal: leave out each decision's why")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("whatif", help="the log's faults under other policies, the cluster's answers simulated",
                       description="Keep the recorded job, cluster and faults; let the simulator (recovery.sim: its "
                                   "executors, training, checkpoints and cost model) play every answer of the cluster, "
                                   "once under the recorded policies and once under --policy; print which inputs "
                                   "were kept and which re-simulated, the decisions that differ, and the difference "
                                   "in ETTR, MTTR and lost GPU-hours.")
    p.add_argument("log", help=EXPORT_HELP)
    p.add_argument("--policy", action="append", default=[], metavar="FAMILY=NAME[:key=value,...]",
                   help="replace one family's policy, e.g. rescheduling=torchelastic-like-rescheduling or "
                        "checkpoint=newest-complete:peer=false (repeatable); none: the recorded policies alone, "
                        "to check that the simulator reproduces the log")
    p.add_argument("--step-time-s", type=float, help="the step time of a job that reported no steps (default: the "
                                                     "simulator's 6 s, marked assumed)")
    p.add_argument("--node-not-ready-s", type=float,
                   help="how long before its node.not_ready a host that went away died (default: just after its "
                        "ranks' last report, marked assumed; else the platform's 40 s grace)")
    p.add_argument("--tolerance-s", type=float, default=TOLERANCE_S,
                   help=f"how far a simulated recovery decision or MTTR may be from the recorded one and still "
                        f"reproduce it (default {TOLERANCE_S:g})")
    p.add_argument("--job", help="the job to replay (default: the one a postmortem of the log is about: a per-job "
                                 "export's, else the one with the most incidents, the last submitted of a tie)")
    p.add_argument("--model-params", type=float, help="model parameters for the cost of moving state (default: the "
                                                      "most one replica of the layout holds, marked assumed)")
    p.add_argument("--executor-failures", action="store_true",
                   help="executors fail and time out with the cost model's probabilities (default: never)")
    p.add_argument("--tail-s", type=float, default=3600.0,
                   help="simulate this long past the log's end, with no new faults, so that recoveries under way "
                        "finish (default 3600)")
    p.add_argument("--keep-logs", metavar="DIR", help="keep both simulated logs in DIR (for report, diff, verify)")
    p.add_argument("--partitions", type=int, metavar="P",
                   help="the log's partitions (default: read from the log); on a partitioned log the job has only "
                        "its partition's spares, as it had")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=40, help="rows of differing decisions shown (default 40)")
    p.set_defaults(func=cmd_whatif)
    p = sub.add_parser("diff", help="the decisions that differ between two logs of the same inputs, side by side",
                       description="The first and every decision that differ between two logs, side by side with "
                                   "their causes, the policies (names, versions, parameters) that differ, and the "
                                   "first input that differs. Exit 0: the same decisions, 1: they differ.")
    p.add_argument("a", help=f"the first log: {EXPORT_HELP}")
    p.add_argument("b", help=f"the second log: {EXPORT_HELP}")
    p.add_argument("--job", help="only this job's decisions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=40, help="rows of differing decisions shown (default 40)")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("export", help="write the JetStream log as JSONL",
                       description="Write the JetStream log as JSONL. A per-job export starts with a header line "
                                   "naming the job and its filters, which verify reads.")
    p.add_argument("log", nargs="?", metavar="DATA_DIR", help="a stopped daemon's (or `recovery-run "
                                                              "--standalone` run's) data directory (or --nats)")
    p.add_argument("--nats", metavar="URL", help="NATS server of the log")
    p.add_argument("--stream", default="RECOVERY", help="the log's stream (default RECOVERY)")
    p.add_argument("--job", help="an incident of this job: every input record (every job's and node's events: the "
                                 "job's decisions depend on them), the job's decisions and dead letters, the dead "
                                 "letters of records naming no job, and every job's job.accepted; only other "
                                 "jobs' other outputs are left out, so verify re-derives the job's decisions exactly")
    p.add_argument("--since", help="only records at or after this log time: ns, ISO 8601, or an age (15m, 2h); "
                                   "a replay then lacks the state before it, and verify says it cannot be exact")
    p.add_argument("--start-seq", type=int, default=1, help="first stream sequence to read (cuts like --since)")
    p.add_argument("-o", "--output", default="-", help="JSONL file to write (default: standard output)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with contextlib.ExitStack() as held:  # a data directory's server, stopped however the command ends
            open_data_dirs(args, held)
            return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"recovery-replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

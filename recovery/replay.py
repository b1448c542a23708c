"""`recovery-replay`: rebuild every state and decision from a log, for postmortems and audit.

    recovery-replay run LOG              final state of each job, incidents and decision counts
    recovery-replay verify LOG           re-derive every decision and diff against the recorded ones
    recovery-replay timeline LOG --job J events, states and decisions of one job, in order
    recovery-replay export --nats URL [--job J] [--since T] [-o FILE]
                                         the JetStream log as JSONL (the format LOG is in)

Each of run, verify and timeline reads a JSONL export (LOG) or, with `--nats URL`, the live JetStream
stream (`--stream`, default RECOVERY). Each takes `--json` for machine-readable output. Exit status: 0
fine, 1 divergence, 2 bad usage or unreadable log.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from events.envelope import RawRecord, Record
from events.outputs import Decision
from recovery.log import iter_file, record_matches
from recovery.recorder import Replay, replay

NS = 1_000_000_000


def _dump(model: Any) -> bytes:
    return orjson.dumps(model.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


@dataclass(frozen=True)
class Divergence:
    index: int
    cause_seq: int | None
    recorded: Decision | None
    derived: Decision | None
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "cause_seq": self.cause_seq, "verdict": self.verdict,
                "recorded": None if self.recorded is None else self.recorded.model_dump(mode="json"),
                "derived": None if self.derived is None else self.derived.model_dump(mode="json")}


def first_divergence(result: Replay) -> Divergence | None:
    """Compare derived decisions with recorded ones in order; the first difference, explained."""
    recorded, derived = result.recorded_decisions, result.decisions
    for index in range(max(len(recorded), len(derived))):
        rec = recorded[index] if index < len(recorded) else None
        der = derived[index] if index < len(derived) else None
        if rec is not None and der is not None and _dump(rec) == _dump(der):
            continue
        cause = (rec or der).cause_seq if (rec or der) is not None else None  # type: ignore[union-attr]
        if rec is None:
            verdict = "the replay made a decision the log does not have (log cut short, or new behaviour)"
        elif der is None:
            verdict = "the log has a decision the replay does not make"
        elif rec.policy != der.policy:
            verdict = f"changed policy: recorded {rec.policy}, replayed {der.policy}"
        else:
            verdict = ("same policies, different decision: an engine or policy change without a version "
                       "bump, or non-determinism: a bug")
        return Divergence(index, cause, rec, der, verdict)
    return None


def _records(source: str | argparse.Namespace) -> Iterator[Record | RawRecord]:
    """The records of a JSONL file, or of the JetStream stream when the arguments carry `--nats`."""
    if isinstance(source, str):
        return iter_file(source)
    if getattr(source, "nats", None):
        if source.log:
            raise ValueError("give either a LOG file or --nats, not both")
        return iter(asyncio.run(_read_nats(source.nats, source.stream)))
    if not source.log:
        raise ValueError("give a LOG file or --nats URL")
    return iter_file(source.log)


async def _connect_log(url: str, stream: str) -> Any:
    """A read-only view of the stream: it is neither created nor reconfigured (that is the daemon's job)."""
    import nats
    import nats.errors
    import nats.js.errors

    from recovery.jetstream import JetStreamLog

    try:
        nc = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=3, name="recovery-replay")
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise OSError(f"cannot connect to {url}: {exc!r}") from None
    js = nc.jetstream(timeout=10)
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        await nc.close()
        raise OSError(f"no stream {stream!r} on {url}") from None
    return JetStreamLog(nc, js, stream, owns_connection=True)


async def _read_nats(url: str, stream: str) -> list[Record | RawRecord]:
    log = await _connect_log(url, stream)
    try:
        return [record async for record in log.read()]
    finally:
        await log.close()


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
    since = parse_since(args.since) if args.since else None
    count = asyncio.run(_export(args.nats, args.stream, args.output, args.job, since, args.start_seq))
    if args.output != "-":
        print(f"{count} records written to {args.output}", file=sys.stderr)
    return 0


async def _export(url: str, stream: str, output: str, job: str | None, since: int | None, start_seq: int) -> int:
    from events.codec import encode_record

    log = await _connect_log(url, stream)
    try:
        if output != "-":
            return int(await log.export(output, start_seq, job, since))
        count = 0
        out = sys.stdout.buffer
        async for record in log.read(start_seq):
            if record_matches(record, job, since):
                out.write(encode_record(record) + b"\n")
                count += 1
        out.flush()
        return count
    finally:
        await log.close()


def _clock(ts: int, origin: int) -> str:
    return f"+{(ts - origin) / NS:10.3f}s"


def _utc(ts: int) -> str:
    return datetime.fromtimestamp(ts / NS, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _summary(envelope: Any) -> str:
    data = envelope.data.model_dump(mode="json", exclude_defaults=True)
    if envelope.type == "job.submitted":
        spec = data["spec"]
        return f"{len(spec['nodes'])} nodes, layout {spec['layout']}"
    return " ".join(f"{k}={v}" for k, v in data.items())


def cmd_run(args: argparse.Namespace) -> int:
    result = replay(_records(args))
    snapshot = result.engine.snapshot()
    if args.json:
        out = {"inputs": result.inputs, "jobs": snapshot["jobs"],
               "decisions": [d.model_dump(mode="json") for d in result.decisions],
               "rejections": [r.model_dump(mode="json") for r in result.rejections]}
        sys.stdout.buffer.write(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    print(f"{result.inputs} input records, {len(result.decisions)} decisions, {len(result.rejections)} rejections")
    for job_id, job in snapshot["jobs"].items():
        print(f"\njob {job_id}: {job['state']} at step {job['step']}, generation {job['generation']}, "
              f"{job['alive']}/{job['world']} ranks alive, nodes {', '.join(job['nodes'])}")
        print(f"  policies: {', '.join(job['policies'].values())}; restarts used {job['restarts_used']}")
        for inc in job["incidents"] + ([job["incident"]] if job["incident"] else []):
            mttr = "" if inc["closed"] is None else f", {(inc['closed'] - inc['opened']) / NS:.1f}s"
            grans = " -> ".join(f"{a['granularity']}({a['outcome']})" for a in inc["attempts"])
            print(f"  incident {inc['id']}: {inc['fault_class'] or inc['cause']}, {inc['outcome'] or 'open'}"
                  f"{mttr}, lost steps {inc['lost_steps']}; {grans}")
    for rej in result.rejections:
        print(f"rejected seq {rej.seq} [{rej.code}]: {rej.reason}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    result = replay(_records(args))
    divergence = first_divergence(result)
    rejections_match = [_dump(r) for r in result.rejections] == [_dump(r) for r in result.recorded_rejections]
    ok = divergence is None and (rejections_match or not result.recorded_rejections)
    if args.json:
        out = {"ok": ok, "inputs": result.inputs, "decisions": len(result.decisions),
               "recorded": len(result.recorded_decisions),
               "divergence": None if divergence is None else divergence.as_dict(),
               "rejections_match": rejections_match}
        sys.stdout.buffer.write(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
        return 0 if ok else 1
    if divergence is not None:
        print(f"DIVERGENCE at decision #{divergence.index} (caused by seq {divergence.cause_seq}): "
              f"{divergence.verdict}")
        if divergence.recorded is not None:
            print(f"  recorded: {_dump(divergence.recorded).decode()}")
        if divergence.derived is not None:
            print(f"  replayed: {_dump(divergence.derived).decode()}")
        return 1
    if not ok:
        print("DIVERGENCE in rejections: the replay rejects different records than the log recorded")
        return 1
    print(f"ok: {len(result.decisions)} decisions from {result.inputs} inputs match the "
          f"{len(result.recorded_decisions)} recorded")
    return 0


def timeline_rows(records: Sequence[Record | RawRecord] | Iterator[Record | RawRecord], job: str,
                  include_progress: bool = False) -> list[dict[str, Any]]:
    """The job's inputs and decisions in log order, with the state after each decision."""
    rows: list[dict[str, Any]] = []
    nodes: set[str] = set()
    state = "submitted"
    for record in records:
        if isinstance(record, RawRecord):
            continue
        env = record.envelope
        if env.type == "decision":
            if env.data.job != job:
                continue
            d = env.data
            state = d.state
            nodes.update(d.detail.get("nodes", ()))  # nodes the job moved to are its nodes from then on
            rows.append({"seq": record.seq, "ts": record.ts, "what": f"decision {d.kind}",
                         "detail": d.reason + (f" [{', '.join(c.kind for c in d.commands)}]" if d.commands else ""),
                         "state": state, "policy": d.policy})
            continue
        if env.type == "rejection":
            if env.data.job == job:
                rows.append({"seq": record.seq, "ts": record.ts, "what": f"rejected {env.data.code}",
                             "detail": env.data.reason, "state": state, "policy": None})
            continue
        if env.job == job:
            if env.type == "job.submitted":
                nodes.update(env.data.spec.nodes)
            if env.type in ("process.heartbeat", "progress.step") and not include_progress:
                continue
            if env.type == "timer.fired" and "/watchdog/" in env.data.timer_id and not include_progress:
                continue
        elif not (env.node is not None and env.node in nodes):
            continue
        rows.append({"seq": record.seq, "ts": record.ts, "what": env.type, "detail": _summary(env),
                     "state": state, "policy": None})
    return rows


def cmd_timeline(args: argparse.Namespace) -> int:
    rows = timeline_rows(_records(args), args.job, include_progress=args.all)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    if not rows:
        print(f"nothing in the log for job {args.job}")
        return 2
    origin = rows[0]["ts"]
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # pragma: no cover - rich is a dependency; plain text keeps the CLI usable without it
        for r in rows:
            print(f"{_clock(r['ts'], origin)} {r['seq']:>7} {r['what']:<28} {r['state']:<13} {r['detail']}")
        return 0
    table = Table(title=f"job {args.job} from {_utc(origin)}", show_lines=False)
    for column in ("time", "seq", "event / decision", "state", "detail"):
        table.add_column(column, overflow="fold")
    for r in rows:
        style = "bold" if r["what"].startswith("decision") else ("red" if r["what"].startswith("rejected") else "")
        # Text cells: details such as "[migrate_ranks]" are data, not console markup.
        table.add_row(*(Text(c) for c in (_clock(r["ts"], origin), str(r["seq"]), r["what"], r["state"], r["detail"])),
                      style=style)
    console = Console()
    # Piped output has no terminal width: give the table room rather than folding every cell.
    Console(width=console.width if console.is_terminal else 200).print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, helptext in (("run", cmd_run, "final state of each job and the decisions"),
                                 ("verify", cmd_verify, "re-derive decisions and diff with the recorded ones"),
                                 ("timeline", cmd_timeline, "events, states and decisions of one job")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("log", nargs="?", help="JSONL export of the log (or --nats)")
        p.add_argument("--nats", metavar="URL", help="read the live JetStream log instead of a file")
        p.add_argument("--stream", default="RECOVERY", help="the log's stream with --nats (default RECOVERY)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name == "timeline":
            p.add_argument("--job", required=True)
            p.add_argument("--all", action="store_true", help="include heartbeats, steps and watchdog ticks")
    p = sub.add_parser("export", help="write the JetStream log as JSONL")
    p.add_argument("--nats", metavar="URL", required=True, help="NATS server of the log")
    p.add_argument("--stream", default="RECOVERY", help="the log's stream (default RECOVERY)")
    p.add_argument("--job", help="only the records of this job (its events, decisions and dead letters)")
    p.add_argument("--since", help="only records at or after this log time: ns, ISO 8601, or an age (15m, 2h)")
    p.add_argument("--start-seq", type=int, default=1, help="first stream sequence to read")
    p.add_argument("-o", "--output", default="-", help="JSONL file to write (default: standard output)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"recovery-replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`recovery-ctl`: talk to a running `recovery-daemon` over NATS request/reply (`recovery.ctl.<verb>`).

    recovery-ctl jobs                          live job states
    recovery-ctl incidents [--all]             open incidents (and closed ones with --all)
    recovery-ctl job J                         one job in full (JSON)
    recovery-ctl status                        the daemon: readiness, last sequence, snapshot, lag
    recovery-ctl submit SPEC.json|.toml [--job J]
    recovery-ctl inject TYPE (--job J | --node N) [--data JSON] [--id ID]
    recovery-ctl scale J DP | pause J [--reason R] | resume J | cancel J [--reason R]
    recovery-ctl force J GRANULARITY [--reason R]

The server: `--nats URL`, else RECOVERY_NATS_URL, else the embedded daemon's `<data dir>/nats.url`
(`--data-dir`, RECOVERY_DATA_DIR, default ./recovery-data), else nats://127.0.0.1:4222. `--json` prints the
daemon's answer as JSON. Exit status: 0 done, 1 refused (or the event was rejected), 2 bad usage or no answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tomllib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors
import orjson

from recovery.control import SUBJECT
from recovery.embedded import URL_FILE


class CtlFailure(Exception):
    pass


def default_url(data_dir: str | None = None) -> str:
    env = os.environ.get("RECOVERY_NATS_URL")
    if env:
        return env
    directory = Path(data_dir or os.environ.get("RECOVERY_DATA_DIR") or "recovery-data")
    url_file = directory / URL_FILE
    if url_file.is_file():
        text = url_file.read_text().strip()
        if text:
            return text
    return "nats://127.0.0.1:4222"


async def request(url: str, verb: str, body: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    try:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False,
                                name="recovery-ctl")
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise CtlFailure(f"cannot connect to {url}: {exc!r}") from None
    try:
        msg = await nc.request(f"{SUBJECT}.{verb}", orjson.dumps(body), timeout=timeout)
    except nats.errors.NoRespondersError:
        raise CtlFailure(f"no recovery-daemon answers on {url}") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise CtlFailure(f"the daemon did not answer within {timeout}s") from None
    finally:
        await nc.close()
    reply: dict[str, Any] = orjson.loads(msg.data)
    return reply


def load_spec(path: str) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    data: Any = tomllib.loads(raw.decode()) if path.endswith(".toml") else orjson.loads(raw)
    if not isinstance(data, dict):
        raise CtlFailure(f"{path}: a job spec file holds an object")
    return data


def build_body(args: argparse.Namespace) -> dict[str, Any]:
    verb = args.verb
    body: dict[str, Any] = {}
    if verb in ("submit", "inject", "scale", "pause", "resume", "cancel", "force"):
        body["id"] = args.id or f"ctl-{verb}-{secrets.token_hex(6)}"
    if verb == "submit":
        data = load_spec(args.spec)
        spec = data.get("spec", data) if isinstance(data.get("spec"), dict) else data
        job = args.job or data.get("job")
        if not job:
            raise CtlFailure("give the job's id with --job or a top-level 'job' key in the file")
        body.update(job=job, spec={k: v for k, v in spec.items() if k != "job"})
    elif verb == "inject":
        body["type"] = args.type
        if args.job:
            body["job"] = args.job
        if args.node:
            body["node"] = args.node
        try:
            body["data"] = orjson.loads(args.data) if args.data else {}
        except orjson.JSONDecodeError as exc:
            raise CtlFailure(f"--data is not JSON: {exc}") from None
    elif verb in ("job", "scale", "pause", "resume", "cancel", "force"):
        body["job"] = args.job
        if verb == "scale":
            body["dp"] = args.dp
        if verb == "force":
            body["granularity"] = args.granularity
        if getattr(args, "reason", None):
            body["reason"] = args.reason
    elif verb == "incidents":
        body["all"] = args.all
    return body


def _when(ns: int | None) -> str:
    if not ns:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S")


def render(verb: str, reply: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if verb == "jobs":
        table = Table(title=f"{len(reply['jobs'])} job(s)")
        columns = ("job", "state", "step", "generation", "alive", "dp", "nodes", "incident", "attempt",
                   "incidents_closed", "restarts_used")
        for column in columns:
            table.add_column(column.replace("_", " "))
        for row in reply["jobs"]:
            alive = f"{row['alive']}/{row['world']}"
            table.add_row(*(Text(str(alive if c == "alive" else ("-" if row[c] is None else row[c])))
                            for c in columns))
        console.print(table)
    elif verb == "incidents":
        table = Table(title=f"{len(reply['incidents'])} incident(s)")
        incident_columns = ("job", "incident", "cause", "fault_class", "opened", "phase", "faults", "attempts",
                            "outcome", "lost_steps")
        for column in incident_columns:
            table.add_column(column.replace("_", " "))
        for row in reply["incidents"]:
            cells = {**row, "opened": _when(row["opened"]), "attempts": " -> ".join(row["attempts"])}
            table.add_row(*(Text("-" if cells[c] is None else str(cells[c])) for c in incident_columns))
        console.print(table)
    elif verb == "status":
        table = Table(title="recovery-daemon", show_header=False)
        for key, value in reply["status"].items():
            table.add_row(key, Text(str(value)))
        console.print(table)
    elif verb == "job":
        console.print_json(orjson.dumps(reply["job"]).decode())
    else:
        applied = reply.get("applied")
        console.print(f"{reply['subject']} seq {reply['seq']} id {reply['id']}"
                      + (" (duplicate)" if reply.get("duplicate") else "")
                      + ("" if applied else " - not applied yet"))
        for d in reply.get("decisions", []):
            commands = f" [{', '.join(d['commands'])}]" if d["commands"] else ""
            console.print(Text(f"  decision {d['job']}: {d['kind']} -> {d['state']}: {d['reason']}{commands}"))
        for r in reply.get("rejections", []):
            console.print(Text(f"  rejected [{r['code']}]: {r['reason']}", style="red"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-ctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats", help="NATS URL of the daemon's server")
    parser.add_argument("--data-dir", help="the embedded daemon's data directory (to find its nats.url)")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.add_argument("--timeout", type=float, default=10.0)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("status", help="the daemon's state")
    sub.add_parser("jobs", help="live job states")
    p = sub.add_parser("incidents", help="open incidents")
    p.add_argument("--all", action="store_true", help="closed incidents too")
    p = sub.add_parser("job", help="one job in full")
    p.add_argument("job")
    p = sub.add_parser("submit", help="submit a job spec (JSON or TOML)")
    p.add_argument("spec", help="file: the spec, or {'job': ..., 'spec': {...}}")
    p.add_argument("--job", help="job id (else the file's 'job')")
    p.add_argument("--id", help="event id (dedupe key): repeat it to retry safely")
    p = sub.add_parser("inject", help="inject an event")
    p.add_argument("type", help="event type, e.g. process.exited or device.fault")
    p.add_argument("--job")
    p.add_argument("--node")
    p.add_argument("--data", help="the event's data as JSON")
    p.add_argument("--id", help="event id (dedupe key)")
    p = sub.add_parser("scale", help="ask an elastic job for a data-parallel size")
    p.add_argument("job")
    p.add_argument("dp", type=int)
    p.add_argument("--id")
    for verb in ("pause", "resume", "cancel"):
        p = sub.add_parser(verb, help=f"{verb} a job")
        p.add_argument("job")
        p.add_argument("--id")
        if verb != "resume":
            p.add_argument("--reason", default="")
    p = sub.add_parser("force", help="start a recovery attempt of this granularity now")
    p.add_argument("job")
    p.add_argument("granularity")
    p.add_argument("--reason", default="")
    p.add_argument("--id")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.nats or default_url(args.data_dir)
    try:
        body = build_body(args)
        reply = asyncio.run(request(url, args.verb, body, args.timeout))
    except (CtlFailure, OSError, tomllib.TOMLDecodeError, orjson.JSONDecodeError) as exc:
        print(f"recovery-ctl: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(reply, option=orjson.OPT_INDENT_2) + b"\n")
    elif not reply.get("ok"):
        print(f"recovery-ctl: {reply.get('error')}", file=sys.stderr)
    else:
        render(args.verb, reply)
    if not reply.get("ok") or reply.get("rejections"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

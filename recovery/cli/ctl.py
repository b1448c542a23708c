"""`recovery-ctl`: talk to a running `recovery-daemon` over NATS request/reply (`recovery.ctl.<verb>`).

    recovery-ctl jobs                          live job states
    recovery-ctl nodes                         the nodes: their agents (seen when, in what state), jobs and ranks
    recovery-ctl incidents [--all]             open incidents (and closed ones with --all)
    recovery-ctl job J                         one job in full (JSON)
    recovery-ctl status                        the daemon: readiness, last sequence, snapshot, lag
    recovery-ctl submit SPEC.json|.toml [--job J]
    recovery-ctl inject TYPE (--job J | --node N) [--data JSON] [--id ID]
    recovery-ctl scale J DP | pause J [--reason R] | resume J | cancel J [--reason R]
    recovery-ctl force J GRANULARITY [--reason R]
    recovery-ctl partitions                    how many partitions the control plane has

The server: `--nats URL`, else RECOVERY_NATS_URL, else the embedded daemon's `<data dir>/nats.url`
(`--data-dir`, RECOVERY_DATA_DIR, default ./recovery-data), else nats://127.0.0.1:4222. `--json` prints the
daemon's answer as JSON. `--timeout S` (default 5) bounds the whole exchange: connecting and the answer.

On a partitioned control plane (several active daemons, `partitions` P > 1) the daemons say P when asked, and each
request goes where it belongs (`recovery.cli.ctl_routes`): a job's to the job's partition, status, jobs, nodes and
incidents to every partition, merged, each row with its partition; a partition that gives no answer within the
timeout is named (exit 5) and the others' answers shown. `--partitions P` skips asking.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from nats.aio.client import Client

from recovery.cli import ctl_routes
from recovery.service.control import PARTITIONS_VERB, SUBJECT, partition_subject
from recovery.service.embedded import URL_FILE

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2  # argparse's own code for a bad command line
EXIT_NO_NATS = 3
EXIT_NO_DAEMON = 4
EXIT_PARTIAL = 5
DEFAULT_TIMEOUT_S = 5.0

_PARTITION_NOTE = " (partitioned: the job's partition, or none)"
EXIT_CODES = f"""exit status:
  {EXIT_OK}  done
  {EXIT_REFUSED}  the daemon refused the request, or rejected the event
  {EXIT_USAGE}  bad usage: arguments, spec file or --data
  {EXIT_NO_NATS}  no NATS server could be reached at the URL within --timeout
  {EXIT_NO_DAEMON}  NATS is up but no recovery-daemon answered on {SUBJECT}.<verb> within --timeout{_PARTITION_NOTE}
  {EXIT_PARTIAL}  some partitions did not answer within --timeout: the others' answer is shown, the silent named"""


class CtlFailure(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class NoAnswer(CtlFailure):
    """Nobody answered a request: `why` says how (nobody subscribed, or not within the timeout)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message, EXIT_NO_DAEMON)
        self.why = why


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def connect(url: str, timeout: float) -> Client:
    """Connect within `timeout` seconds or raise CtlFailure(EXIT_NO_NATS). nats-py left to itself never gives up:
    `max_reconnect_attempts=0` does not mean "no retries" while connecting (only a positive value discards a
    server), and a server that accepts the TCP connection but never speaks is waited for in every attempt."""
    failures: list[BaseException] = []

    async def record(exc: Exception) -> None:
        failures.append(exc)  # instead of nats-py's default: a traceback on stderr for every attempt

    servers = [part.strip() for part in url.split(",") if part.strip()]
    try:
        return await asyncio.wait_for(
            nats.connect(servers, name="recovery-ctl", connect_timeout=max(timeout, 0.1),
                         max_reconnect_attempts=1, reconnect_time_wait=min(0.5, timeout / 4),
                         allow_reconnect=False, error_cb=record),
            timeout)
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        cause = failures[-1] if failures and not isinstance(failures[-1], TimeoutError) else exc
        why = f"no answer within {timeout:g}s" if isinstance(cause, TimeoutError) else _describe(cause)
        raise CtlFailure(f"cannot reach NATS at {url}: {why}", EXIT_NO_NATS) from None


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


async def request(url: str, verb: str, body: dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S,
                  partitions: int | None = None) -> dict[str, Any]:
    """The daemon's answer to one request; CtlFailure with EXIT_NO_NATS or EXIT_NO_DAEMON if there is none
    within `timeout` seconds in all. On a partitioned control plane (`partitions`, else as the daemons say) the
    answer of the job's partition, or the partitions' answers merged (`recovery.cli.ctl_routes`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    nc = await connect(url, timeout)
    try:
        if partitions is None or partitions == 1:
            reply = await _exchange(nc, url, f"{SUBJECT}.{verb}", body, deadline, timeout)
            count = reply.get("partitions")
            # only a partitioned daemon's refusal names a count: an unpartitioned one has done what was asked
            if partitions is not None or reply.get("ok") or not isinstance(count, int) or count <= 1:
                return reply
            partitions = count
        return await _partitioned(nc, url, verb, body, partitions, deadline, timeout)
    finally:
        # Bounded: closing flushes, and a server that just went away must not hold the answer back.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 1.0)


async def _partitioned(nc: Client, url: str, verb: str, body: dict[str, Any], count: int, deadline: float,
                       timeout: float) -> dict[str, Any]:
    asked = ctl_routes.targets(verb, body, count)
    if verb not in ctl_routes.FLEET_VERBS:
        (index,) = asked
        reply = await _exchange(nc, url, partition_subject(index, verb), body, deadline, timeout,
                                f" (partition {index} of {count}: no daemon serves it now)")
        return {**reply, "partition": index, "partitions": count}

    async def ask(index: int) -> dict[str, Any] | str:
        try:
            reply = await _exchange(nc, url, partition_subject(index, verb), body, deadline, timeout)
        except NoAnswer as exc:
            return exc.why
        return reply if reply.get("ok") else str(reply.get("error"))

    replies = await asyncio.gather(*(ask(k) for k in asked))
    answers = {k: r for k, r in zip(asked, replies, strict=True) if isinstance(r, dict)}
    missing = {k: r for k, r in zip(asked, replies, strict=True) if isinstance(r, str)}
    if not answers:
        why = "; ".join(f"{k}: {r}" for k, r in sorted(missing.items()))
        raise CtlFailure(f"no partition of {count} answered on {SUBJECT}.p.<k>.{verb} at {url} ({why})",
                         EXIT_NO_DAEMON)
    return ctl_routes.merge(verb, count, answers, missing)


async def _exchange(nc: Client, url: str, subject: str, body: dict[str, Any], deadline: float, timeout: float,
                    which: str = "") -> dict[str, Any]:
    """One request and its answer by `deadline` (the event loop's clock); CtlFailure if none."""
    loop = asyncio.get_running_loop()
    try:
        msg = await nc.request(subject, orjson.dumps(body), timeout=max(deadline - loop.time(), 0.001))
    except nats.errors.NoRespondersError:
        raise NoAnswer(f"no recovery-daemon answered on {subject} at {url}: none is subscribed{which}",
                       "none is subscribed") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise NoAnswer(f"no recovery-daemon answered on {subject} at {url} within {timeout:g}s{which}",
                       f"no answer within {timeout:g}s") from None
    except nats.errors.Error as exc:  # the connection closed under the request: NATS went away
        raise CtlFailure(f"lost the connection to NATS at {url}: {_describe(exc)}", EXIT_NO_NATS) from None
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
    if verb in ("submit", "inject", "scale", "pause", "resume", "cancel", "force", "release"):
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
    elif verb in ("job", "scale", "pause", "resume", "cancel", "force", "release"):
        body["job"] = args.job
        if verb == "scale":
            body["dp"] = args.dp
        if verb == "force":
            body["granularity"] = args.granularity
        if verb == "release":
            body["node"] = args.node
            if args.device is not None:
                body["device"] = args.device
        if getattr(args, "reason", None):
            body["reason"] = args.reason
        if verb == "cancel" and args.grace > 0:
            body.update(grace_s=args.grace, signal=args.signal)
    elif verb == "incidents":
        body["all"] = args.all
    return body


def _listed(names: Sequence[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _ranks(ranks: Sequence[int]) -> str:
    """Consecutive ranks as a range: a node of 8 ranks is `8-15`."""
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else (f"{ranks[0]}-{ranks[-1]}" if ranks[-1] - ranks[0] == len(ranks) - 1
                                                  else ", ".join(map(str, ranks)))  # wraps between ranks


def _when(ns: int | None) -> str:
    if not ns:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%H:%M:%S")


JOB_COLUMNS = ("job", "state", "phase", "step", "alive", "incident", "attempt", "generation", "restarts_used", "dp",
               "nodes", "incidents_closed")
"""`jobs`' columns, the most wanted first: a narrow terminal shows a prefix of them"""
INCIDENT_COLUMNS = ("job", "incident", "cause", "phase", "outcome", "opened", "fault_class", "lost_steps", "faults",
                    "attempts")


FREE_TEXT = frozenset({"cause", "attempts", "state"})
"""columns of words that may wrap at 80 columns: an incident's cause, its attempts, a job's state with the nodes it
lacks an agent on; every other cell of `jobs` and `incidents` is a name or a number, never broken"""
WRAPPED_MIN = 16
"""the fewest characters a free-text column is counted at (recovery.report.screen.TEXT_MIN; not imported, for
start-up time: rich is imported only to render)"""
NODE_FREE_TEXT = frozenset({"ranks", "out"})
"""`nodes`' columns that may wrap at their words: the node's ranks (its job is whole, over its state), why it is out"""


def _column_width(column: str, rows: Sequence[dict[str, str]], wrapped: bool = False) -> int:
    """A column's characters in a box table: its widest cell or header, and 3 for padding and border; `wrapped`: a
    free-text column's, which wraps at its words, no more than its longest word or TEXT_MIN."""
    widest = max([len(column), *(len(line) for row in rows for line in row[column].splitlines())])
    if wrapped and column in FREE_TEXT:
        words = max([len(column), *(len(word) for row in rows for word in row[column].split())])
        widest = min(widest, max(words, WRAPPED_MIN))
    return widest + 3


def table_width(columns: Sequence[str], rows: Sequence[dict[str, str]]) -> int:
    return 1 + sum(_column_width(column, rows) for column in columns)


def fitting_columns(columns: Sequence[str], rows: Sequence[dict[str, str]], width: int) -> tuple[str, ...]:
    """The longest prefix of `columns` whose table fits in `width` characters; the first two always (a job and
    its state say something; three letters of twelve columns say nothing)."""
    used = 1
    shown: list[str] = []
    for column in columns:
        need = _column_width(column, rows, wrapped=True)
        if len(shown) >= 2 and used + need > width:
            break
        shown.append(column)
        used += need
    return tuple(shown)


def render(verb: str, reply: dict[str, Any], wide: bool = False) -> None:
    # Imported here for start-up time (rich takes 40 ms): --json does without it.
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from recovery.report.screen import screen_console

    console = screen_console()
    if verb in ("jobs", "incidents"):
        columns = JOB_COLUMNS if verb == "jobs" else INCIDENT_COLUMNS
        if "partitions" in reply:  # a partitioned control plane's merged answer: where each row lives, third
            columns = (*columns[:2], "partition", *columns[2:])
        if verb == "jobs":
            rows = [{c: str(row["alive"]) + f"/{row['world']}" if c == "alive" else
                     ("-" if row[c] is None else str(row[c])) for c in columns} for row in reply["jobs"]]
            for row, job in zip(rows, reply["jobs"], strict=True):
                if job.get("no_agent"):  # why it does not start: said where a narrow terminal still shows it
                    row["state"] += f"\n(no agent on {_listed(job['no_agent'])})"
        else:
            rows = [{c: "-" if cells[c] is None else str(cells[c]) for c in columns}
                    for cells in ({**row, "opened": _when(row["opened"]), "attempts": " -> ".join(row["attempts"])}
                                  for row in reply["incidents"])]
        shown = columns if wide else fitting_columns(columns, rows, console.width)
        if wide:  # every column whole: wider than the terminal if need be, never cut to a few letters
            console = Console(width=max(console.width, table_width(columns, rows)))
        hidden = len(columns) - len(shown)
        table = Table(title=f"{len(rows)} {'job' if verb == 'jobs' else 'incident'}(s)",
                      caption=f"{hidden} more column(s): --wide, or --json" if hidden else None)
        for column in shown:
            # every shown column fits whole (fitting_columns): only free text may wrap, and at its words
            table.add_column(column.replace("_", " "), no_wrap=column not in FREE_TEXT, overflow="fold")
        for row in rows:
            table.add_row(*(Text(row[c]) for c in shown))
        console.print(table)
    elif verb == "nodes":
        out = ("out",) if any(row.get("out") for row in reply["nodes"]) else ()  # why a node takes no ranks
        columns = ("node", "agent", "seen", "job", "ranks", *out, *(("partition",) if "partitions" in reply else ()))
        table = Table(title=f"{len(reply['nodes'])} node(s)")
        for column in columns:
            table.add_column(column, no_wrap=column not in NODE_FREE_TEXT, overflow="fold")
        for row in reply["nodes"]:
            cells = {**row, "seen": _when(row["seen"]), "job": "-" if row["job"] is None else
                     f"{row['job']}\n({row['job_state']})", "ranks": _ranks(row["ranks"])}
            table.add_row(*(Text("-" if cells.get(c) is None else str(cells[c])) for c in columns))
        console.print(table)
    elif verb == "status":
        # a partitioned control plane's answer: each partition's owner's status, by partition
        statuses = ({f"partition {k} of {reply['partitions']}": v for k, v in reply["status"].items()}
                    if "partitions" in reply else {"recovery-daemon": reply["status"]})
        for title, status in statuses.items():
            table = Table(title=title, show_header=False)
            for key, value in status.items():
                table.add_row(Text(key, no_wrap=True), Text(str(value)))
            console.print(table)
    elif verb == PARTITIONS_VERB:
        owned = reply.get("owned")
        console.print(f"{reply['partitions']} partition(s)" + ("" if owned is None else
                      f"; {reply.get('instance')}, which answered, owns {owned}"))
    elif verb == "job":
        console.print_json(orjson.dumps(reply["job"]).decode())
    else:
        applied = reply.get("applied")
        where = f" (partition {reply['partition']} of {reply['partitions']})" if "partition" in reply else ""
        console.print(f"{reply['subject']} seq {reply['seq']} id {reply['id']}{where}"
                      + (" (duplicate)" if reply.get("duplicate") else "")
                      + ("" if applied else " - not applied yet"))
        for d in reply.get("decisions", []):
            commands = f" [{', '.join(d['commands'])}]" if d["commands"] else ""
            console.print(Text(f"  decision {d['job']}: {d['kind']} -> {d['state']}: {d['reason']}{commands}"))
        for r in reply.get("rejections", []):
            console.print(Text(f"  rejected [{r['code']}]: {r['reason']}", style="red"))


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recovery-ctl", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats", help="NATS URL of the daemon's server")
    parser.add_argument("--data-dir", help="the embedded daemon's data directory (to find its nats.url)")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"give up after S seconds in all, connecting included (default {DEFAULT_TIMEOUT_S:g}); "
                             f"exit {EXIT_NO_NATS} if NATS cannot be reached, {EXIT_NO_DAEMON} if no daemon answers")
    parser.add_argument("--partitions", type=int, metavar="P",
                        help="the control plane's partitions (default: as the daemons say; 1 is one daemon's wire)")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("status", help="the daemon's state (each partition's, on a partitioned control plane)")
    sub.add_parser(PARTITIONS_VERB, help="how many partitions the control plane has")
    p = sub.add_parser("jobs", help="live job states (the columns that fit the terminal; --wide for all)")
    p.add_argument("--wide", action="store_true", help="every column, however wide the terminal")
    sub.add_parser("nodes", help="the nodes: their agents (seen when; ready, spare, gone, none), jobs and ranks")
    p = sub.add_parser("incidents", help="open incidents (the columns that fit the terminal; --wide for all)")
    p.add_argument("--all", action="store_true", help="closed incidents too")
    p.add_argument("--wide", action="store_true", help="every column, however wide the terminal")
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
        if verb == "cancel":
            p.add_argument("--grace", type=float, default=0.0, metavar="S",
                           help="the ranks get --signal and S seconds to save and end by themselves before they are "
                                "killed (default 0: killed at once)")
            p.add_argument("--signal", choices=("SIGTERM", "SIGINT"), default="SIGTERM",
                           help="what a graceful cancel sends the ranks first (default SIGTERM)")
    p = sub.add_parser("force", help="start a recovery attempt of this granularity now")
    p.add_argument("job")
    p.add_argument("granularity")
    p.add_argument("--reason", default="")
    p.add_argument("--id")
    p = sub.add_parser("release", help="end a node's (or one device's) isolation now: it was checked or replaced")
    p.add_argument("job", help="the job whose incident isolated it")
    p.add_argument("node")
    p.add_argument("--device", type=int, help="only this device of the node")
    p.add_argument("--reason", default="")
    p.add_argument("--id")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.nats or default_url(args.data_dir)
    try:
        body = build_body(args)
        if args.partitions is not None and args.partitions < 1:
            raise CtlFailure(f"--partitions {args.partitions}: give 1 or more")
        reply = asyncio.run(request(url, args.verb, body, args.timeout, args.partitions))
    except CtlFailure as exc:
        print(f"recovery-ctl: {exc}", file=sys.stderr)
        return exc.code
    except (OSError, tomllib.TOMLDecodeError, orjson.JSONDecodeError) as exc:  # reading the spec file
        print(f"recovery-ctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(reply, option=orjson.OPT_INDENT_2) + b"\n")
    elif not reply.get("ok"):
        print(f"recovery-ctl: {reply.get('error')}", file=sys.stderr)
    else:
        render(args.verb, reply, wide=getattr(args, "wide", False))
    if not reply.get("ok") or reply.get("rejections"):
        return EXIT_REFUSED
    if reply.get("missing"):
        silent = ", ".join(f"{m['partition']} ({m['why']})" for m in reply["missing"])
        print(f"recovery-ctl: partition(s) {silent} of {reply['partitions']} did not answer: "
              f"their jobs are not in this answer", file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

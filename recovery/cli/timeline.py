"""`recovery-replay timeline`: one job's inputs and decisions in log order, with the state after each decision.

What a person reads first is what happened, not that every agent and rank was alive: heartbeats, steps, progress
reports and watchdog ticks (most of a real run's log) are left out unless `--all` asks for them. Every event of a
node names its node (`node.heartbeat@n0`), since the job's nodes all send the same ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from events.envelope import RawRecord, Record
from events.subjects import is_output
from recovery.cli.replay_source import records
from recovery.log import rejection_jobs
from recovery.log.verify import DEAD_LETTER_SUBJECTS, DECISION_SUBJECTS

if TYPE_CHECKING:
    from rich.console import Console

NS = 1_000_000_000
SIGNS_OF_LIFE = frozenset({"process.heartbeat", "progress.step", "progress.report", "progress.summary",
                           "node.heartbeat"})
"""inputs that say only that a rank or an agent is alive and where it is: shown with --all"""


def _clock(ts: int, origin: int) -> str:
    return f"+{(ts - origin) / NS:.3f}s"


def _utc(ts: int) -> str:
    return datetime.fromtimestamp(ts / NS, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _summary(envelope: Any) -> str:
    data = envelope.data.model_dump(mode="json", exclude_defaults=True)
    if envelope.type == "job.submitted":
        spec = data["spec"]
        return f"{len(spec['nodes'])} nodes, layout {spec['layout']}"
    return " ".join(f"{k}={v}" for k, v in data.items())


def _sign_of_life(env: Any) -> bool:
    return env.type in SIGNS_OF_LIFE or (env.type == "timer.fired" and "/watchdog/" in env.data.timer_id)


def timeline_rows(log: Sequence[Record | RawRecord] | Iterator[Record | RawRecord], job: str,
                  include_progress: bool = False) -> list[dict[str, Any]]:
    """The job's inputs and decisions in log order, with the state after each decision. Decisions and dead
    letters are what sits on their subjects; a record of another type there, or one typed `decision` on an
    event subject, is not the engine's. `node`: the node an event came from, if it names one."""
    rows: list[dict[str, Any]] = []
    nodes: set[str] = set()
    state = "submitted"
    for record in log:
        if isinstance(record, RawRecord):
            continue
        env = record.envelope
        if is_output(record.subject):
            if env.type == "decision" and record.subject.startswith(DECISION_SUBJECTS):
                if env.data.job != job:
                    continue
                d = env.data
                state = d.state
                nodes.update(d.detail.get("nodes", ()))  # nodes the job moved to are its nodes from then on
                rows.append({"seq": record.seq, "ts": record.ts, "what": f"decision {d.kind}",
                             "detail": d.reason + (f" [{', '.join(c.kind for c in d.commands)}]" if d.commands else ""),
                             "state": state, "policy": d.policy, "node": None})
            elif (env.type == "rejection" and record.subject.startswith(DEAD_LETTER_SUBJECTS)
                  and job in rejection_jobs(env.data)):
                rows.append({"seq": record.seq, "ts": record.ts, "what": f"rejected {env.data.code}",
                             "detail": env.data.reason, "state": state, "policy": None, "node": None})
            continue
        if env.job == job:
            if env.type == "job.submitted":
                nodes.update(env.data.spec.nodes)
        elif not (env.node is not None and env.node in nodes):
            continue
        if not include_progress and _sign_of_life(env):
            continue
        # An input typed like an output is hostile or broken input (the daemon rejects it): never shown as one.
        what = env.type if env.type not in ("decision", "rejection") else f"input typed {env.type}"
        rows.append({"seq": record.seq, "ts": record.ts, "what": what, "detail": _summary(env),
                     "state": state, "policy": None, "node": env.node})
    return rows


def render_timeline(rows: list[dict[str, Any]], job: str, console: Console) -> None:
    """The rows as a table of three columns at any width: the time and the sequence (numbers, never broken), then
    what happened (a decision with the state it leads to) over its detail, which wraps at words in the rest of the
    line; a fourth and fifth column of state and detail left the detail a few letters at 80 columns."""
    # imported here for start-up time (rich takes 40 ms): --json and the other commands do without it
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    origin = rows[0]["ts"]
    table = Table(title=f"job {job} from {_utc(origin)}", box=None, pad_edge=False, show_lines=False)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("event / decision, then its detail", overflow="fold")
    for r in rows:
        decision = r["what"].startswith("decision")
        style = "bold" if decision else ("red" if r["what"].startswith("rejected") else "")
        what = r["what"] + (f"@{r['node']}" if r.get("node") else "")
        # Text cells: details such as "[migrate_ranks]" are data, not console markup.
        head = Text.assemble((what, style), (f"  -> {r['state']}", "dim") if decision else "")
        cell = Group(head, Padding(Text(r["detail"]), (0, 0, 0, 2))) if r["detail"] else head
        table.add_row(Text(_clock(r["ts"], origin)), Text(str(r["seq"])), cell)
    console.print(table)


def cmd_timeline(args: argparse.Namespace) -> int:
    rows = timeline_rows(records(args), args.job, include_progress=args.all)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
        return 0
    if not rows:
        print(f"nothing in the log for job {args.job}")
        return 2
    from recovery.report.screen import screen_console

    render_timeline(rows, args.job, screen_console())
    return 0

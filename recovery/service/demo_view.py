"""The demo's live view: what the terminal shows while `recovery-daemon --demo` runs (every job's state, its
incident and attempt, and the stream of decisions), drawn with rich."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from events.envelope import RawRecord, Record
from events.outputs import Decision
from recovery.service.daemon import Daemon

NS = 1_000_000_000


class LiveView:
    """What the terminal shows: every job's state, its incident and attempt, and the stream of decisions."""

    def __init__(self, daemon: Daemon, seconds: float) -> None:
        self.daemon = daemon
        self.seconds = seconds
        self.started = time.monotonic()
        self.feed: deque[tuple[float, str, str, str]] = deque(maxlen=14)
        self.mttr: list[float] = []
        self.incidents = 0
        daemon.listeners.append(self.on_record)

    def on_record(self, record: Record | RawRecord, effects: list[Any]) -> None:
        for effect in effects:
            if not isinstance(effect, Decision):
                self.feed.append((time.monotonic(), "-", f"rejected [{effect.code}]", effect.reason))
                continue
            if effect.kind in ("fault.confirmed",):
                self.incidents += 1
            if effect.kind == "incident.closed":
                self.mttr.append(effect.detail.get("mttr_ns", 0) / NS)
            commands = f" [{', '.join(c.kind for c in effect.commands)}]" if effect.commands else ""
            self.feed.append((time.monotonic(), effect.job, f"{effect.kind} -> {effect.state}",
                              effect.reason + commands))

    def render(self) -> Any:
        engine = self.daemon.engine
        elapsed = time.monotonic() - self.started
        jobs = Table(title=f"recovery-daemon demo  {elapsed:4.0f}s / {self.seconds:.0f}s   "
                           f"log seq {engine.last_seq}   snapshot seq {self.daemon.snapshot_seq}",
                     title_justify="left", expand=True)
        for column in ("job", "state", "step", "gen", "ranks", "nodes", "incident", "attempt / phase", "closed"):
            jobs.add_column(column)
        colours = {"running": "green", "recovering": "yellow", "paused": "cyan", "failed": "red",
                   "cancelled": "red", "completed": "blue"}
        for job_id in sorted(engine.jobs):
            job = engine.jobs[job_id]
            incident = job.incident
            attempt = incident.attempt if incident is not None else None
            phase = job.phase or ""
            what = f"{attempt.granularity.value} / {phase}" if attempt is not None else phase
            jobs.add_row(job_id, Text(job.state, style=colours.get(job.state, "magenta")), str(job.step),
                         str(job.generation), f"{sum(job.alive)}/{job.world}", " ".join(job.nodes),
                         incident.id if incident else "", what, str(len(job.closed)))
        feed = Table(title="decisions", title_justify="left", expand=True, show_header=False)
        feed.add_column("t", width=6)
        feed.add_column("job", width=6)
        feed.add_column("decision", width=34)
        feed.add_column("why", overflow="fold")
        for at, job_id, what, why in self.feed:
            feed.add_row(f"{at - self.started:5.1f}s", job_id, what, Text(why))
        mttr = f"median MTTR {statistics.median(self.mttr):.1f}s" if self.mttr else "no incident closed yet"
        footer = Text(f"incidents opened {self.incidents}, closed {len(self.mttr)}; {mttr}. "
                      f"Ctrl-C stops early.", style="dim")
        return Group(jobs, feed, footer)

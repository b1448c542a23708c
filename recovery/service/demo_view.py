"""The demo's live view: what the terminal shows while `recovery-daemon --demo` runs (every job's state, its
incident and attempt, and the stream of decisions), drawn with rich."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from events.envelope import RawRecord, Record
from events.outputs import Decision
from recovery.report.screen import NARROWEST, Column, shortened
from recovery.service.daemon import Daemon

NS = 1_000_000_000
JOB_COLUMNS = (Column("job"), Column("state\nphase"), Column("step", "number"), Column("gen", "number"),
               Column("ranks", "number"), Column("incident\nattempt"), Column("closed", "number"),
               Column("nodes", "text"))
"""the jobs' columns: names and numbers whole, the nodes wrapped between them"""


class LiveView:
    """What the terminal shows: every job's state, its incident and attempt, and the stream of decisions."""

    def __init__(self, daemon: Daemon, seconds: float) -> None:
        self.daemon = daemon
        self.seconds = seconds
        self.started = time.monotonic()
        self.feed: deque[tuple[float, str, str, str]] = deque(maxlen=40)
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

    def job_ids(self) -> list[str]:
        """The jobs the demo ran, for the commands that read its log (`recovery-replay timeline ... --job`)."""
        return sorted(self.daemon.engine.jobs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.render(options.max_width, options.height or console.height)

    def render(self, width: int = NARROWEST, height: int = 40) -> Group:
        """The screen in `width` x `height`: the jobs, then the newest decisions first, as many as fit below them,
        each on at most two lines (a live screen taller than the terminal loses its bottom, which is where the
        newest were)."""
        engine = self.daemon.engine
        elapsed = time.monotonic() - self.started
        jobs = Table(title=f"recovery-daemon demo  {elapsed:4.0f}s / {self.seconds:.0f}s   "
                           f"log seq {engine.last_seq}   snapshot seq {self.daemon.snapshot_seq}",
                     title_justify="left", expand=True, box=box.SIMPLE_HEAD, pad_edge=False)
        # The state over its phase and the incident over its attempt's granularity: whole words in two narrow
        # columns, where a column each cut them to `recover…` and `in_pla…` at 80 columns.
        for column in JOB_COLUMNS:
            column.add_to(jobs)
        colours = {"running": "green", "recovering": "yellow", "paused": "cyan", "failed": "red",
                   "cancelled": "red", "completed": "blue"}
        for job_id in self.job_ids():
            job = engine.jobs[job_id]
            incident = job.incident
            attempt = incident.attempt if incident is not None else None
            state = Text(job.state, style=colours.get(job.state, "magenta"))
            if job.phase:
                state.append(f"\n{job.phase}", style="dim")
            what = Text(incident.id if incident else "")
            if attempt is not None:
                what.append(f"\n{attempt.granularity.value}", style="dim")
            jobs.add_row(job_id, state, str(job.step), str(job.generation), f"{sum(job.alive)}/{job.world}", what,
                         str(len(job.closed)), Text(" ".join(job.nodes)))
        room = height - 6 - 2 * len(engine.jobs) - 3  # the jobs' title, header, rows and rule; the feed's title; footer
        feed = Table(title="decisions, newest first", title_justify="left", expand=True, show_header=False,
                     box=None, pad_edge=False)
        feed.add_column("t", justify="right", no_wrap=True)
        feed.add_column("job", no_wrap=True)
        feed.add_column("decision / why", overflow="fold")
        newest = [(f"{at - self.started:5.1f}s", job_id, what, why)
                  for at, job_id, what, why in list(reversed(self.feed))[: max(3, room // 2)]]
        # the reason gets what the time, the job and the gaps between the columns leave of the line
        taken = max([6, *(len(t) for t, _, _, _ in newest)]) + max([3, *(len(j) for _, j, _, _ in newest)]) + 4
        for at, job_id, what, why in newest:
            feed.add_row(at, job_id, Text.assemble((what, "bold"), "\n", shortened(why, max(20, width - taken))))
        mttr = f"median MTTR {statistics.median(self.mttr):.1f}s" if self.mttr else "no incident closed yet"
        footer = Text(f"incidents opened {self.incidents}, closed {len(self.mttr)}; {mttr}. "
                      f"Ctrl-C stops early.", style="dim")
        return Group(jobs, feed, footer)

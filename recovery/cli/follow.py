"""Following one job as `recovery-run` shows it: its decisions and events as they are made (core NATS subscriptions
beside the streams), a few lines per incident, its progress now and then, and its end; and, when its ranks run on
this host, their output, each line prefixed with the rank as torchrun prefixes it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

from events import subjects
from recovery.report.screen import terminal_width

ENDED = ("completed", "failed", "cancelled")
PROGRESS_EVERY_S = 10.0
"""how often the job's step is printed while nothing else happens"""
RANK_LOG = re.compile(r"\.rank(\d+)\.gen(\d+)\.log$")


_SILENT_FOR = re.compile(r"silent for more than ([0-9.]+)s")
"""the built-in detection's words for a silent agent or rank: its bound, the silence at least"""

@dataclass
class JobFollower:
    """What `recovery-run` prints about a job, from its decisions and events; `ended` is set with its final state."""

    job: str
    out: TextIO = field(default_factory=lambda: sys.stderr)
    started: float = field(default_factory=time.monotonic)
    state: str = "submitted"
    reason: str = ""
    step: int = -1
    incidents: int = 0
    recovered_s: list[float] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    sdk: bool = False
    """a rank spoke through the SDK: steps measure the job; without, only its processes and their output do"""
    counted: bool = False
    """only the step hook reports the job's steps (`recovery.client.steps`): a script without the SDK, measured to
    a restarted process's first optimizer step"""
    fault_at: float | None = None
    """when the latest incident's fault was confirmed (this process's clock); None once its restart was said to run"""
    generation: int | None = None
    """the generation the latest incident's latest restart started"""
    recovering: bool = False
    defer_verdict: bool = False
    """the caller says the verdict last (standalone: after stopping what it started), so it is not said at the end"""
    caps: set[str] = field(default_factory=set)
    granularity: str = ""  # the attempt under way's
    hung_since: dict[int, float] = field(default_factory=dict)
    """rank -> when it stopped making progress, as its agent's hang report said"""
    live: set[tuple[int, int]] = field(default_factory=set)
    """the job's processes started and not yet exited, as (rank, generation)"""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """set while no process of the job is live (after one started)"""
    _printed_step: int = -1
    _printed_at: float = 0.0

    def say(self, message: str) -> None:
        """What happens, under its prefix. In a terminal (or with COLUMNS given) wrapped at words to its width, since
        the terminal itself would wrap a reason or a path inside a value; written to a file or a pipe without a
        width, one line a message, which grep finds whole."""
        prefix = f"[recovery-run {time.monotonic() - self.started:6.1f}s] "
        if not (_is_terminal(self.out) or os.environ.get("COLUMNS", "").isdigit()):
            print(prefix + message, file=self.out, flush=True)
            return
        width = max(terminal_width(self.out), len(prefix) + 20)
        lines = textwrap.wrap(message, width, initial_indent=prefix, subsequent_indent=" " * len(prefix),
                              break_long_words=False, break_on_hyphens=False) or [prefix.rstrip()]
        print("\n".join(lines), file=self.out, flush=True)

    def on_decision(self, decision: dict[str, Any]) -> None:
        kind, reason, detail = decision.get("kind"), decision.get("reason", ""), decision.get("detail") or {}
        self.state = decision.get("state", self.state)
        if kind == "job.started":
            self.say(f"{self.job}: running")
        elif kind == "fault.confirmed":
            self.incidents += 1
            if not self.recovering:  # the first fault of an incident: its restart is measured from its onset
                self.recovering, self.fault_at = True, self._onset(reason, detail)
            self.say(f"fault: {reason}")
        elif kind == "attempt.started":
            self.granularity = str(detail.get("granularity", "?"))
            self.say(f"recovery: {self.granularity} ({reason})")
        elif kind == "checkpoint.dying_failed" and not self.speaks:
            pass  # no rank speaks through the SDK, so none could ever save one: nothing failed that could succeed
        elif kind in ("attempt.failed", "attempt.timed_out", "checkpoint.dying_failed", "job.paused"):
            self.say(f"{kind}: {reason}")
        elif kind == "checkpoint.plan":
            if "reform" in self.caps and self.granularity in ("in_place", "migrate"):
                # the survivors keep their processes and hand the restarted ranks their live state (the SDK's
                # agreement, HSDP's replicas): no checkpoint is read, whatever the plan's newest one
                self.say("the restarted rank(s) take their state from a live replica; the others keep theirs")
            elif not self.speaks or (self.caps and "checkpoints" not in self.caps):
                self.say("resuming from the script's own snapshot, if it keeps one (it reports no checkpoints)")
            elif detail.get("checkpoint_step") is not None:
                self.say(f"resuming from the checkpoint of step {detail['checkpoint_step']}")
        elif kind == "ranks.rescheduling" and isinstance(detail.get("generation"), int):
            self.generation = detail["generation"]
        elif kind == "incident.closed":
            self._closed(reason, detail)
        if self.state in ENDED and not self.ended.is_set():
            self.reason = reason
            if not self.defer_verdict:
                self.say(self.verdict())
            self.ended.set()

    def _closed(self, reason: str, detail: dict[str, Any]) -> None:
        self.recovering = False  # a stock script's first output may come after the close: it is still said
        if self.counted and reason.startswith("progress:"):
            # closed by a restarted process's first counted optimizer step: the restart's true time
            self.said_running(self.fault_at)
            return
        if not self.speaks:
            # A stock script's incident closes after the ladder's grace (its processes ran so long without exiting):
            # a wait, not a measure. When it ran again was said at its first output.
            self.say(f"incident closed: {reason}")
            return
        mttr = detail.get("mttr_ns")  # from the incident's opening to the first step past the resume point
        if isinstance(mttr, int):
            self.recovered_s.append(mttr / 1e9)
        lost = detail.get("lost_steps")
        took = f" in {mttr / 1e9:.1f}s (to the first step past the resume point)" if isinstance(mttr, int) else ""
        self.say(f"recovered{took}{f', {lost} step(s) lost' if lost is not None else ''}")

    def _onset(self, reason: str, detail: dict[str, Any]) -> float:
        """When the confirmed fault began (this process's clock): a hang its agent saw, when the rank stopped
        making progress; a silent agent or rank, its silence bound before; anything else, now."""
        now = time.monotonic()
        fault = detail.get("fault") if isinstance(detail.get("fault"), dict) else {}
        began = [self.hung_since[r] for r in fault.get("ranks") or [] if r in self.hung_since]
        silent = _SILENT_FOR.search(reason)
        if silent is not None:
            began.append(now - float(silent.group(1)))
        return min([now, *began])

    @property
    def speaks(self) -> bool:
        """A rank reports through the SDK itself (not only the step hook's counts)."""
        return self.sdk and not self.counted

    def said_running(self, fault_at: float | None) -> None:
        """A restarted process of a script without the SDK counted its first optimizer step: said once."""
        if fault_at is not None:
            took = time.monotonic() - fault_at
            self.recovered_s.append(took)
            self.say(f"running again {took:.1f}s after the fault (to a restarted rank's first optimizer step; the "
                     f"steps lost are the script's to say)")
        self.fault_at = None

    def verdict(self) -> str:
        """The job's end in one line, with the reason (a failed job's quotes the script's error when it said one)."""
        return f"{self.job} {self.state}{f': {self.reason}' if self.reason else ''}"

    def on_event(self, envelope: dict[str, Any]) -> None:
        data = envelope.get("data") or {}
        type_ = envelope.get("type")
        self._track(type_, data)
        if type_ == "process.hang" and isinstance(data.get("rank"), int):
            still = data.get("seconds_without_progress")
            if isinstance(still, int | float) and 0 <= still < 1e9:
                self.hung_since[data["rank"]] = time.monotonic() - still
        if type_ == "process.capabilities" and isinstance(data.get("caps"), list):
            self.caps |= {str(c) for c in data["caps"]}
            self.counted = "counts" in self.caps and "steps" not in self.caps
        if type_ in ("progress.step", "progress.report", "progress.summary", "process.heartbeat"):
            # the agents fold their ranks' words into one progress.report a period (what recovery-ctl's step is), or
            # the daemon a job's into one progress.summary
            self.sdk = True
            for entry in data.get("ranks") or [] if type_ in ("progress.report", "progress.summary") else [data]:
                if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                    self.step = max(self.step, entry["step"])
                    if (self.counted and not self.recovering and self.fault_at is not None
                            and entry.get("attempt") == self.generation):
                        self.said_running(self.fault_at)  # its incident closed before (the ladder's grace)
        elif (type_ == "process.output" and self.fault_at is not None and not self.sdk and not self.counted
              and data.get("attempt") == self.generation):
            self.say(f"running again {time.monotonic() - self.fault_at:.1f}s after the fault (to a restarted rank's "
                     f"first output: the script reports no steps)")
            self.fault_at = None  # said once per incident
        elif type_ == "process.exited" and not self.ended.is_set():
            if data.get("signal") is not None:
                self.say(f"rank {data.get('rank')} (generation {data.get('attempt')}) killed by signal "
                         f"{data['signal']}")
            elif data.get("exit_code") not in (0, None):
                self.say(f"rank {data.get('rank')} (generation {data.get('attempt')}) exited with "
                         f"{data['exit_code']}{_said(data.get('error'))}")

    def _track(self, type_: object, data: dict[str, Any]) -> None:
        """Keep `live` and `stopped` from the agents' process.started and process.exited."""
        rank, attempt = data.get("rank"), data.get("attempt")
        if not isinstance(rank, int) or not isinstance(attempt, int):
            return
        if type_ == "process.started":
            self.live.add((rank, attempt))
            self.stopped.clear()
        elif type_ == "process.exited":
            self.live.discard((rank, attempt))
            if not self.live:
                self.stopped.set()

    def tick(self) -> None:
        """Print the step now and then while the job runs."""
        now = time.monotonic()
        if self.step > self._printed_step and now - self._printed_at >= PROGRESS_EVERY_S and not self.ended.is_set():
            self._printed_step, self._printed_at = self.step, now
            self.say(f"step {self.step}")

    async def subscribe(self, nc: Client) -> None:
        """Before the job is submitted, so that nothing of it is missed."""

        async def on_decision(msg: Msg) -> None:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                self.on_decision(orjson.loads(msg.data).get("data") or {})

        async def on_event(msg: Msg) -> None:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                self.on_event(orjson.loads(msg.data))

        await nc.subscribe(subjects.decision(self.job), cb=on_decision)
        await nc.subscribe(f"{subjects.PREFIX}.ev.job.{self.job}.>", cb=on_event)


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # a closed or foreign stream: not a terminal to fit
        return False


def _said(error: object) -> str:
    """`: ValueError: bad lr (train.py:42 in main)` from an exit's `error`, if it carries one."""
    if not isinstance(error, dict) or (not error.get("message") and not error.get("type")):
        return ""
    what = f"{error.get('type')}: {error.get('message')}" if error.get("type") else str(error.get("message"))
    return f": {what}" + (f" ({error['place']})" if error.get("place") else "")


class RankOutput:
    """The output files the agents on this host write for the job's ranks (`<runtime dir>/<job>.rank<r>.gen<g>.log`),
    followed and printed line by line as `[rank<r>]:` (`[rank<r>.<g>]:` from a restart of generation g)."""

    def __init__(self, runtime_dirs: list[Path], job: str, out: TextIO | None = None) -> None:
        self.runtime_dirs = runtime_dirs
        self.job = job
        self.out = out or sys.stdout
        self._read: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def poll(self, final: bool = False) -> None:
        for directory in self.runtime_dirs:
            for path in sorted(directory.glob(f"{self.job}.rank*.gen*.log")):
                match = RANK_LOG.search(path.name)
                if match is None:
                    continue
                rank, generation = int(match.group(1)), int(match.group(2))
                prefix = f"[rank{rank}]" if generation == 0 else f"[rank{rank}.{generation}]"
                try:
                    with path.open("rb") as log:
                        log.seek(self._read.get(path, 0))
                        data = log.read()
                except OSError:
                    continue
                self._read[path] = self._read.get(path, 0) + len(data)
                lines = (self._partial.pop(path, b"") + data).split(b"\n")
                if not final:
                    self._partial[path], lines = lines[-1], lines[:-1]
                for line in lines:
                    if line or not final:
                        print(f"{prefix}: {line.decode(errors='replace')}", file=self.out, flush=True)


async def follow(follower: JobFollower, output: RankOutput | None = None,
                 check: Callable[[], Awaitable[str | None]] | None = None, poll_s: float = 0.1,
                 check_every_s: float = 5.0) -> str:
    """Until the job ends: its final state. Prints the ranks' output and the progress meanwhile; `check` (the job's
    state asked of the daemon) now and then, in case the deciding message was missed (a reconnection)."""
    checked = time.monotonic()
    while not follower.ended.is_set():
        if output is not None:
            output.poll()
        follower.tick()
        if check is not None and time.monotonic() - checked >= check_every_s:
            checked = time.monotonic()
            state = await check()
            if state in ENDED and not follower.ended.is_set():
                follower.on_decision({"state": state})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(follower.ended.wait(), poll_s)
    if output is not None:
        output.poll(final=True)
    return follower.state

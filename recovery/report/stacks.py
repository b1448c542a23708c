"""Hang localization in the postmortem: the stacks the agents took before a suspected hang was acted on
(`process.stacks`), grouped by what each rank's main thread was doing. In a collective hang most ranks wait in the
same frames (the all_reduce); the odd ones out are what they wait for: a rank stuck in its data loader, in I/O, in a
deadlock of its own.

Folded one event at a time in bounded memory: one sample of frames per distinct stack, the ranks in each, and the
errors of ranks that could not be read (a 16,384-rank job's stacks are never held at once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FRAMES_KEPT = 12
"""innermost frames kept per distinct stack, for the report"""
MAX_GROUPS = 64
"""distinct stacks kept per incident: past this, further ones count as `other`"""
_THREAD = re.compile(r'^Thread (?:0x)?[0-9a-fA-F]+ \((?:idle|active|gil)[^)]*\)(?:: "(?P<name>[^"]*)")?')
_FRAME = re.compile(r"^\s{4}(?P<frame>\S.*)$")
_LOCATION = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")
_LIBRARY = re.compile(r"/(?:lib/python\d[.\d]*|site-packages|dist-packages)/|^<frozen |^<string>$")


def main_frames(stack: str) -> tuple[str, ...]:
    """The frames of the main thread (py-spy prints each thread's innermost frame first), else of the first
    thread. The frames' local variables, if printed, are left out: they differ from rank to rank."""
    threads: list[tuple[str | None, list[str]]] = []
    for line in stack.splitlines():
        thread = _THREAD.match(line)
        if thread is not None:
            threads.append((thread.group("name"), []))
            continue
        frame = _FRAME.match(line)
        if frame is not None and threads and not line.startswith("        "):
            threads[-1][1].append(frame.group("frame").strip())
    if not threads:
        return ()
    main = next((frames for name, frames in threads if name == "MainThread"), threads[0][1])
    return tuple(main)


def short(frame: str) -> str:
    """`function (file:line)` with the file's base name, as a reader names a frame."""
    where = _LOCATION.match(frame)
    if where is None:
        return frame
    return f"{where.group('function')} ({where.group('file').rsplit('/', 1)[-1]}:{where.group('line')})"


def innermost_own(frames: list[str]) -> str:
    """The innermost frame of the script itself, not of Python's library or an installed package (a rank stuck
    in its data loader waits in `threading`, but the loader is what to name); the innermost of all without one."""
    for frame in frames:
        where = _LOCATION.match(frame)
        if where is not None and not _LIBRARY.search(where.group("file")):
            return short(frame)
    return short(frames[0]) if frames else "(no frames)"


@dataclass
class StackGroups:
    """Ranks by the stack of their main thread, for one incident."""

    groups: dict[tuple[str, ...], list[int]] = field(default_factory=dict)
    other: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    dumps: int = 0

    def add(self, data: dict[str, Any]) -> None:
        """One node's `process.stacks`."""
        self.dumps += 1
        for entry in data.get("ranks", []):
            rank = int(entry["rank"])
            if entry.get("error"):
                self.errors[rank] = str(entry["error"])[:300]
                continue
            frames = main_frames(str(entry.get("stack", "")))
            key = frames[:FRAMES_KEPT]
            if key in self.groups:
                self.groups[key].append(rank)
            elif len(self.groups) < MAX_GROUPS:
                self.groups[key] = [rank]
            else:
                self.other.append(rank)

    def report(self) -> dict[str, Any]:
        """The groups, biggest first, and the odd ones out: the ranks outside the biggest group, when it holds most
        ranks (with two groups of one rank each nothing stands out)."""
        groups = sorted(([sorted(ranks), list(frames)] for frames, ranks in self.groups.items()),
                        key=lambda g: (-len(g[0]), g[0]))
        seen = sum(len(ranks) for ranks, _ in groups) + len(self.other)
        odd: list[dict[str, Any]] = []
        if len(groups) > 1 and len(groups[0][0]) > seen / 2:
            odd = [{"ranks": ranks, "frame": innermost_own(frames)} for ranks, frames in groups[1:]]
        return {
            "dumps": self.dumps,
            "groups": [{"ranks": ranks, "count": len(ranks), "frame": innermost_own(frames),
                        "frames": [short(f) for f in frames]} for ranks, frames in groups],
            "other_ranks": sorted(self.other),
            "odd": odd,
            "errors": {str(rank): why for rank, why in sorted(self.errors.items())},
        }


def describe(stacks: dict[str, Any]) -> list[str]:
    """Lines for the terminal report: who stands out, and where the others are."""
    lines = []
    groups = stacks["groups"]
    if stacks["odd"]:
        for odd in stacks["odd"]:
            lines.append(f"stacks: rank(s) {_ranks(odd['ranks'])} stand out, in {odd['frame']}")
        lines.append(f"stacks: the other {groups[0]['count']} rank(s) in {groups[0]['frame']}")
    elif groups:
        lines.extend(f"stacks: rank(s) {_ranks(g['ranks'])} in {g['frame']}" for g in groups[:4])
    if stacks["errors"]:
        first = next(iter(stacks["errors"].items()))
        lines.append(f"stacks: {len(stacks['errors'])} rank(s) not read (rank {first[0]}: {first[1]})")
    return lines


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")

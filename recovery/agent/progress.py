"""Edge aggregation: a node's ranks' heartbeats and steps, folded into one `progress.report` per job per period.

At 131,072 ranks, one message per heartbeat and per step is more than a control plane should carry: what the
engine needs of a live rank is that it lives and how far it got. The agent keeps, per job, each rank's newest word
(its step if it reported one, with its generation) and sends them together every `report_s`. Whatever changes
the job's state (a process started or exited, a checkpoint, an ack) still travels on its own, and the fold of that
job is sent first, so that the engine sees every rank's words in the order they were said. A rank's first word
in a generation (it joined a new process group) and its first step there go at once, with the fold: a recovery
waits for exactly those, and must not wait for the period's end.

The agent also watches for silence itself: a rank whose SDK spoke and then said nothing for `rank_silence_s` is
reported as `process.hang` (a SIGSTOPped process, one stuck holding the GIL), once per silence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankWord:
    step: int | None
    attempt: int
    compute_s: float = 0.0
    """the compute times of the steps the rank reported in the period, in all (the report carries their mean)"""
    compute_steps: int = 0


@dataclass
class ProgressFold:
    """What the ranks of each job said since the last report, newest word per rank, in the order first heard."""

    pending: dict[str, dict[int, RankWord]] = field(default_factory=dict)
    known: dict[tuple[str, int], tuple[int, bool]] = field(default_factory=dict)
    """(job, rank) -> the generation of its newest word, and whether it reported a step in it"""
    said: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(job, rank) -> (generation, step) of the last step the fold took: a heartbeat carries the rank's current
    step, and a period of heartbeats alone must not say that step again"""

    def note(self, job: str, rank: int, step: int | None, attempt: int, compute_s: float | None = None) -> bool:
        """A heartbeat (`step` None, or the step it carries) or a step of `rank` in generation `attempt`. True if
        it is news to send now, not at the period's end: the rank's first word in a generation (a process that
        joined it) or its first step there (the progress that ends a recovery). `compute_s`: the step's compute time,
        if the rank measured it."""
        seen = self.known.get((job, rank))
        if seen is not None and attempt < seen[0]:
            return False  # a late word of an older generation: dropped by the fold, and no news
        news = seen is None or seen[0] != attempt or (step is not None and not seen[1])
        self.known[job, rank] = (attempt, step is not None or (seen is not None and seen[0] == attempt and seen[1]))
        if step is not None:
            if self.said.get((job, rank)) == (attempt, step):
                step = None  # said already (a heartbeat's copy of it, or the step after its heartbeat): a bare beat
            else:
                self.said[job, rank] = (attempt, step)
        self._keep(job, rank, step, attempt, compute_s)
        return news

    def forget(self, job: str, rank: int) -> None:
        """The rank's process is gone: its replacement's first word is news again."""
        self.known.pop((job, rank), None)
        self.said.pop((job, rank), None)

    def _keep(self, job: str, rank: int, step: int | None, attempt: int, compute_s: float | None) -> None:
        ranks = self.pending.setdefault(job, {})
        word = ranks.get(rank)
        if word is None:
            word = ranks[rank] = RankWord(step, attempt)
        elif attempt > word.attempt:
            # a newer generation's word replaces the older one's, and its compute times (another process's)
            word.step, word.attempt, word.compute_s, word.compute_steps = step, attempt, 0.0, 0
        elif attempt == word.attempt and step is not None:
            word.step = step  # the latest step said (a roll-back to a resume point included); a bare beat keeps it
        elif attempt < word.attempt:
            return
        if compute_s is not None:  # a step's measure, also when the step itself was said already
            word.compute_s += compute_s
            word.compute_steps += 1

    def take(self, job: str) -> dict[str, Any] | None:
        """The `progress.report` data of `job` since the last one, or None if its ranks said nothing."""
        ranks = self.pending.pop(job, None)
        if not ranks:
            return None
        return {"ranks": [_entry(rank, word) for rank, word in ranks.items()]}

    def jobs(self) -> list[str]:
        return list(self.pending)


def _entry(rank: int, word: RankWord) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "step": word.step, "attempt": word.attempt}
    if word.compute_steps:
        entry["compute_s"] = round(word.compute_s / word.compute_steps, 6)
        entry["compute_steps"] = word.compute_steps
    return entry


def measured(value: object) -> float | None:
    """A compute time the SDK sent, if it is one (seconds, finite, 0 .. a day): a bad one is dropped, not relayed
    into a report the engine would refuse whole."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 86_400:
        return float(value)
    return None


@dataclass
class SilenceWatch:
    """When each rank's SDK last spoke (agent clock), and which silences were reported already."""

    heard: dict[tuple[str, int], float] = field(default_factory=dict)
    reported: set[tuple[str, int]] = field(default_factory=set)

    def spoke(self, job: str, rank: int, now: float) -> None:
        self.heard[job, rank] = now
        self.reported.discard((job, rank))

    def forget(self, job: str, rank: int) -> None:
        """The rank's process is gone (or replaced): its silence is its exit's, not a hang."""
        self.heard.pop((job, rank), None)
        self.reported.discard((job, rank))

    def silent(self, now: float, after_s: float) -> list[tuple[str, int, float]]:
        """(job, rank, seconds) of each rank silent longer than `after_s` and not reported yet; marks them."""
        found = []
        for key, heard in self.heard.items():
            if key not in self.reported and now - heard > after_s:
                self.reported.add(key)
                found.append((key[0], key[1], now - heard))
        return found

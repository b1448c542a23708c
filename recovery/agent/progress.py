"""Edge aggregation: a node's ranks' heartbeats and steps, folded into one `progress.report` per job per period.

At 131,072 ranks, one message per heartbeat and per step is more than a control plane should carry: what the
engine needs of a live rank is that it lives and how far it got. The agent keeps, per job, each rank's newest word
(its step if it reported one, with its generation) and sends them together every `report_s`. Whatever changes
the job's state (a process started or exited, a checkpoint, an ack) still travels on its own, and the fold of that
job is sent first, so that the engine sees every rank's words in the order they were said. A rank's first word
in a generation (it joined a new process group) and its first step there go at once, with the fold: a recovery
waits for exactly those, and must not wait for the period's end.

A step may carry its loss: the fold keeps each rank's worst of the period (the first non-finite one, else the
highest) with its step and the data the script named for it, so a bad step is never folded away; a non-finite loss,
or one above LOSS_NEWS_FACTOR times the median of the rank's recent ones, goes at once, as news.

The agent also watches for silence itself: a rank whose SDK spoke and then said nothing for `rank_silence_s` is
reported as `process.hang` (a SIGSTOPped process, one stuck holding the GIL), once per silence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOSS_NEWS_FACTOR = 2.0
"""a loss above this many times the median of its rank's recent ones goes at once, with the fold (the engine's policy
decides whether it is a spike; this only keeps one from waiting for the period's end)"""
LOSS_RECENT = 16
"""the recent finite losses the agent keeps per rank for that"""
NON_FINITE = ("nan", "inf", "-inf")


@dataclass
class RankWord:
    step: int | None
    attempt: int
    compute_s: float = 0.0
    """the compute times of the steps the rank reported in the period, in all (the report carries their mean)"""
    compute_steps: int = 0
    loss: float | str | None = None  # the period's worst loss: the first non-finite one ("nan", ...), else the highest
    loss_step: int | None = None
    skip: list[str] | None = None  # the data the script named for loss_step

    def keep_loss(self, loss: float | str, step: int, skip: list[str] | None) -> None:
        if self.loss is None or _worse(loss, self.loss):
            self.loss, self.loss_step, self.skip = loss, step, skip


def _worse(loss: float | str, than: float | str) -> bool:
    if isinstance(than, str):
        return False  # the first non-finite loss of the period is the one to roll back
    return isinstance(loss, str) or loss > than


@dataclass
class ProgressFold:
    """What the ranks of each job said since the last report, newest word per rank, in the order first heard."""

    pending: dict[str, dict[int, RankWord]] = field(default_factory=dict)
    known: dict[tuple[str, int], tuple[int, bool]] = field(default_factory=dict)
    """(job, rank) -> the generation of its newest word, and whether it reported a step in it"""
    said: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(job, rank) -> (generation, step) of the last step the fold took: a heartbeat carries the rank's current
    step, and a period of heartbeats alone must not say that step again"""
    losses: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """(job, rank) -> its recent finite losses (LOSS_RECENT), for the promptness of a high one"""

    def note(self, job: str, rank: int, step: int | None, attempt: int, compute_s: float | None = None,
             loss: float | str | None = None, skip: list[str] | None = None) -> bool:
        """A heartbeat (`step` None, or the step it carries) or a step of `rank` in generation `attempt`, with the
        step's compute time and loss if the rank measured them. True if it is news to send now, not at the period's
        end: the rank's first word in a generation (a process that joined it), its first step there (the progress
        that ends a recovery), or a loss that may be a bad step (non-finite, or well above the rank's recent ones):
        a roll-back should not wait, while the job trains on from a poisoned state."""
        seen = self.known.get((job, rank))
        if seen is not None and attempt < seen[0]:
            return False  # a late word of an older generation: dropped by the fold, and no news
        news = seen is None or seen[0] != attempt or (step is not None and not seen[1])
        self.known[job, rank] = (attempt, step is not None or (seen is not None and seen[0] == attempt and seen[1]))
        stepped = step
        if step is not None:
            if self.said.get((job, rank)) == (attempt, step):
                step = None  # said already (a heartbeat's copy of it, or the step after its heartbeat): a bare beat
            else:
                self.said[job, rank] = (attempt, step)
        word = self._keep(job, rank, step, attempt, compute_s)
        if word is not None and loss is not None and stepped is not None:
            word.keep_loss(loss, stepped, skip)
            news = self._loss_news(job, rank, loss) or news
        return news

    def _loss_news(self, job: str, rank: int, loss: float | str) -> bool:
        if isinstance(loss, str):
            return True
        recent = self.losses.setdefault((job, rank), [])
        high = len(recent) >= 4 and loss > LOSS_NEWS_FACTOR * sorted(recent)[len(recent) // 2]
        recent.append(loss)
        del recent[:-LOSS_RECENT]
        return high

    def forget(self, job: str, rank: int) -> None:
        """The rank's process is gone: its replacement's first word is news again, its losses its own."""
        self.known.pop((job, rank), None)
        self.said.pop((job, rank), None)
        self.losses.pop((job, rank), None)

    def _keep(self, job: str, rank: int, step: int | None, attempt: int, compute_s: float | None
              ) -> RankWord | None:
        ranks = self.pending.setdefault(job, {})
        word = ranks.get(rank)
        if word is None:
            word = ranks[rank] = RankWord(step, attempt)
        elif attempt > word.attempt:
            # a newer generation's word replaces the older one's: its compute times and loss (another process's)
            word.step, word.attempt, word.compute_s, word.compute_steps = step, attempt, 0.0, 0
            word.loss, word.loss_step, word.skip = None, None, None
        elif attempt == word.attempt and step is not None:
            word.step = step  # the latest step said (a roll-back to a resume point included); a bare beat keeps it
        elif attempt < word.attempt:
            return None
        if compute_s is not None:  # a step's measure, also when the step itself was said already
            word.compute_s += compute_s
            word.compute_steps += 1
        return word

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
    if word.loss is not None:
        entry.update(loss=word.loss, loss_step=word.loss_step)
        if word.skip:
            entry["skip"] = word.skip
    return entry


def measured(value: object) -> float | None:
    """A compute time the SDK sent, if it is one (seconds, finite, 0 .. a day): a bad one is dropped, not relayed
    into a report the engine would refuse whole."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 86_400:
        return float(value)
    return None


def wire_loss(value: Any) -> float | str | None:
    """A loss as the SDK sent it, as the wire carries it: a finite float, or "nan", "inf" or "-inf"; None if it is
    none of these (a script's mistake must not spoil the report of its job's other ranks)."""
    if isinstance(value, str):
        return value if value in NON_FINITE else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if number != number:
            return "nan"
        if number in (float("inf"), float("-inf")):
            return "inf" if number > 0 else "-inf"
        return number
    return None


def wire_skip(value: Any) -> list[str] | None:
    """The data names the SDK sent, as the wire takes them (at most 64, each 1..128 printable characters)."""
    if not isinstance(value, list):
        return None
    names = [str(v) for v in value if isinstance(v, str | int) and not isinstance(v, bool)]
    return [n for n in names if 0 < len(n) <= 128 and n.isprintable()][:64] or None


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

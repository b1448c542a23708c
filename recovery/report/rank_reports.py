"""What a recorded job's ranks said of themselves, read for the what-if: their steps (the job's pace, the
persistent checkpoints' timing), when each was last heard, their compute times and their losses. Two of these the
recorded engine may have acted on without any fault of the cluster's: a rank whose compute times stood out (a
straggler, drained at a checkpoint) and a loss it judged bad (a bad step, rolled back). Both are kept as faults the
simulated job re-creates: the straggler from when its compute times stood out, the bad step as the loss reports the
engine took as one, at the step the simulated job reached.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from policies.base import LOSS_HISTORY
from recovery.report.night import Draft, Night, RecordedCluster, median
from recovery.sim.config import NS
from recovery.sim.faults import LossReport

RECENT_STEPS = 64
"""how many recent steps' first reports are kept, to time the persistent checkpoints taken at them"""
PENDING_RECORDS = 256
"""how far after an input the decision that takes it as a signal may come (it follows its cause at once)"""
COMPUTE_JITTER = 0.25
"""a rank's compute time further than this share from its run's first starts a new run: the straggler's run began
where its compute times stood out (measurements jitter by less)"""
KEPT = 1000
"""how many of each measurement are kept (the recent ones)"""


class RankReports:
    """The ranks' reports, as `recovery.report.recorded._Reader` meets them: the base of its one pass over the log."""

    def __init__(self) -> None:
        self.cluster: RecordedCluster | None = None
        self.placement: list[str] = []
        self.recovering = False
        self.last_step: tuple[int, int] | None = None
        self.reached: dict[int, int] = {}
        """step -> when it was first reported, for the recent steps of this stretch of training"""
        self.saved: set[int] = set()
        """steps of persistent checkpoints whose next step is not reported yet"""
        self.heard: dict[int, int] = {}
        """rank -> when it last reported (a step or a heartbeat)"""
        self.runs: dict[int, tuple[float, int]] = {}
        """rank -> its current run of compute times: the first of them, and since when (just after the rank's report
        before the run, or the job's start)"""
        self.computed: dict[int, int] = {}
        """rank -> when it last reported a compute time"""
        self.losses: dict[int, tuple[int, int, int, str, list[dict[str, Any]]]] = {}
        """recent records that carry a loss, by sequence: (when, the job's newest step before it, how many losses
        were heard before it, its kind, the entries with a loss), until the decision that may take one as a bad step"""
        self.finite: deque[float] = deque(maxlen=2 * LOSS_HISTORY)
        """the recent finite losses reported: what the engine judges a spike against"""
        self.heard_losses = 0
        """how many finite losses were ever appended to `finite`"""
        self.bad: Draft | None = None
        """the bad step of the open incident: the further loss reports the engine takes as its go with it"""
        self.straggling: dict[str, tuple[Draft, int]] = {}
        """node -> its straggler, and when it was found, while the node is in the placement"""
        self.stragglers: list[tuple[Draft, int]] = []
        """stragglers whose nodes left the placement, and when"""

    @property
    def night(self) -> Night:
        assert self.cluster is not None
        return self.cluster.night

    def count(self, table: str, kind: str) -> None:
        assert self.cluster is not None
        counts = self.cluster.kept if table == "kept" else self.cluster.resimulated
        counts[kind] = counts.get(kind, 0) + 1

    def uncount(self, table: str, kind: str) -> None:
        assert self.cluster is not None
        counts = self.cluster.kept if table == "kept" else self.cluster.resimulated
        counts[kind] -= 1
        if counts[kind] <= 0:
            del counts[kind]

    # -- what each report says ------------------------------------------------------------------------
    def progress_step(self, seq: int, data: dict[str, Any], ts: int) -> None:
        before = self.newest_step()
        if isinstance(data.get("step"), int):
            self.step(int(data["step"]), ts)
        self.heard_from(data.get("rank"), ts)
        if isinstance(data.get("compute_s"), int | float):
            self.compute(data.get("rank"), float(data["compute_s"]), ts)
        if data.get("loss") is not None:
            self.losses[seq] = (ts, before, self.heard_losses, "progress.step", [data])
            self.loss_heard(data["loss"])
        self.count("resimulated", "progress.step")

    def progress_report(self, seq: int, data: dict[str, Any], ts: int) -> None:
        """A node agent's fold of its ranks' reports: each entry is read as that rank's step and word would be."""
        before = self.newest_step()
        entries = [e for e in data.get("ranks") or [] if isinstance(e, dict)]
        for entry in entries:
            if isinstance(entry.get("step"), int):
                self.step(int(entry["step"]), ts)
            self.heard_from(entry.get("rank"), ts)
            if isinstance(entry.get("compute_s"), int | float) and entry.get("compute_steps"):
                self.compute(entry.get("rank"), float(entry["compute_s"]), ts)
        with_loss = [e for e in entries if e.get("loss") is not None]
        if with_loss:
            self.losses[seq] = (ts, before, self.heard_losses, "progress.report", with_loss)
            for entry in with_loss:
                self.loss_heard(entry["loss"])
        self.count("resimulated", "progress.report")

    def loss_heard(self, loss: Any) -> None:
        if isinstance(loss, int | float) and math.isfinite(loss):
            self.finite.append(float(loss))
            self.heard_losses += 1

    def newest_step(self) -> int:
        return self.last_step[1] if self.last_step is not None else 0

    def step(self, step: int, ts: int) -> None:
        cluster = self.cluster
        assert cluster is not None
        cluster.ranks_reported = True
        # the pace of training only: a gap that spans a recovery is not a step time
        if self.last_step is not None and step > self.last_step[1] and not self.recovering:
            cluster.step_times.append((ts - self.last_step[0]) / NS / (step - self.last_step[1]))
            cluster.step_ts.append(ts)
            del cluster.step_times[:-KEPT], cluster.step_ts[:-KEPT]
        if self.last_step is None or step > self.last_step[1]:
            self.last_step = (ts, step)
        if step not in self.reached and not self.recovering:
            self.reached[step] = ts
            if len(self.reached) > RECENT_STEPS:
                del self.reached[next(iter(self.reached))]
            if step - 1 in self.saved and step - 1 in self.reached:
                self.saved.discard(step - 1)
                cluster.storage_gap_s.append((ts - self.reached[step - 1]) / NS)
                del cluster.storage_gap_s[:-KEPT]

    def heard_from(self, rank: Any, ts: int) -> None:
        """A rank's report: when it was last heard from (a silence the engine finds starts there), and how often its
        agent reports."""
        if not isinstance(rank, int):
            return
        assert self.cluster is not None
        self.cluster.ranks_reported = True
        before = self.heard.get(rank)
        if before is not None and ts > before:
            self.cluster.report_gaps_s.append((ts - before) / NS)
            del self.cluster.report_gaps_s[:-KEPT]
        self.heard[rank] = ts

    def last_heard(self, node: str) -> int | None:
        assert self.cluster is not None
        if node not in self.placement:
            return None
        first = self.placement.index(node) * self.cluster.rpn
        heard = [self.heard[r] for r in range(first, first + self.cluster.rpn) if r in self.heard]
        return max(heard) if heard else None

    def compute(self, rank: Any, seconds: float, ts: int) -> None:
        """A rank's mean compute time per step over its report's period: the job's typical compute, and where the
        rank's current run of compute times began."""
        if not isinstance(rank, int):
            return
        cluster = self.cluster
        assert cluster is not None
        cluster.compute_s.append(seconds)
        del cluster.compute_s[:-KEPT]
        run = self.runs.get(rank)
        if run is None or abs(seconds - run[0]) > COMPUTE_JITTER * run[0]:
            self.runs[rank] = (seconds, self.computed.get(rank, cluster.start))
        self.computed[rank] = ts

    def storage_saved(self, step: int, ts: int) -> None:
        """A persistent checkpoint: how long after its step was reached it was saved, and (once the next step is
        reported) how long that step took with the checkpoint's stall."""
        cluster = self.cluster
        assert cluster is not None
        reached = self.reached.get(step)
        if reached is None or self.recovering:
            return
        cluster.storage_saved_s.append((ts - reached) / NS)
        del cluster.storage_saved_s[:-KEPT]
        after = self.reached.get(step + 1)
        if after is not None:
            cluster.storage_gap_s.append((after - reached) / NS)
            del cluster.storage_gap_s[:-KEPT]
        else:
            self.saved = {s for s in self.saved if s > step - RECENT_STEPS} | {step}

    def expire_losses(self, seq: int) -> None:
        while self.losses and seq - next(iter(self.losses)) > PENDING_RECORDS:
            del self.losses[next(iter(self.losses))]

    # -- what the recorded engine made of them --------------------------------------------------------
    def bad_step(self, kind: str, d: dict[str, Any], detail: dict[str, Any]) -> bool:
        """A decision that took a loss report as a bad step (`fault.confirmed` of class `bad_step`, or `fault.added`
        with the earlier bad step it rolls back before): the report is kept, the first as the fault (at its time, on
        its rank) and the further ones of the same incident with it, at their offsets. Whether it was kept."""
        cluster = self.cluster
        assert cluster is not None
        fault = detail.get("fault") if isinstance(detail.get("fault"), dict) else {}
        if not (fault.get("class") == "bad_step" or (kind == "fault.added" and "bad_step" in detail)):
            return False
        record = self.losses.pop(d["cause_seq"], None)
        if record is None:
            return False
        at, before, heard, source, entries = record
        ranks = [int(e["rank"]) for e in entries if isinstance(e.get("rank"), int)]
        if not ranks:
            return False
        draft = self.bad
        if draft is None:
            # a spike is judged against the losses the engine kept before it: those reported before this record
            since = self.heard_losses - heard
            history = list(self.finite)[:len(self.finite) - since][-LOSS_HISTORY:]
            spike = any(isinstance(e["loss"], int | float) for e in entries)
            draft = Draft(at, "bad_step", "job", f"{source} loss of rank {ranks[0]} (seq {d['cause_seq']})",
                          position=ranks[0] // cluster.rpn, device=ranks[0] % cluster.rpn, base_step=before,
                          recent_losses=tuple(history) if spike else ())
            cluster.drafts.append(draft)
            self.bad = draft
        for entry in entries:
            if not isinstance(entry.get("rank"), int) or not isinstance(entry.get("step"), int):
                continue
            folded = isinstance(entry.get("loss_step"), int)
            draft.losses.append(LossReport(
                int(entry["rank"]), at - draft.at, int(entry["step"]) - draft.base_step, entry["loss"],
                int(entry["loss_step"]) - draft.base_step if folded else None,
                tuple(str(s) for s in entry.get("skip") or [])))
        self.uncount("resimulated", source)
        self.count("kept", source)
        return True

    def straggler(self, d: dict[str, Any], detail: dict[str, Any], ts: int) -> bool:
        """A drain the recorded engine planned for a rank whose compute times stood out: kept as a straggler on that
        rank's device from when its run of such compute times began, with the factor the engine measured. Whether
        it was kept (a drain planned again for a straggler already kept is its own)."""
        cluster = self.cluster
        assert cluster is not None
        rank, node = detail.get("rank"), detail.get("node")
        compute, peers = detail.get("compute_s"), detail.get("peers_median_s")
        if (detail.get("code") != "straggler" or not isinstance(rank, int) or node not in self.placement
                or not isinstance(compute, int | float) or not isinstance(peers, int | float) or peers <= 0):
            return False
        if node in self.straggling:
            return True
        since = self.runs[rank][1] if rank in self.runs else cluster.start
        draft = Draft(max(cluster.start, since), "straggler", "node", f"straggler rank {rank} (seq {d['cause_seq']})",
                      position=self.placement.index(node), device=rank % cluster.rpn,
                      compute_slowdown=float(compute) / float(peers))
        cluster.drafts.append(draft)
        self.straggling[str(node)] = (draft, ts)
        self.count("kept", "straggler")
        return True

    def placed(self, nodes: list[str], ts: int) -> None:
        """The job's ranks were placed anew: a straggler's node that left the placement slows it no more."""
        self.placement = list(nodes)
        for node in [n for n in self.straggling if n not in nodes]:
            draft, _ = self.straggling.pop(node)
            self.stragglers.append((draft, ts))

    def paces(self) -> None:
        """How much each straggler slowed the job: its steps' median while the straggler was in the placement over
        the others'. The job's step time is then the others' median. Where the log has no steps of one kind, the
        measured step time is the job's pace with or without it (it slows the job by nothing more)."""
        cluster = self.cluster
        assert cluster is not None
        spans = self.stragglers + [(draft, cluster.end) for draft, _ in self.straggling.values()]
        slowed = [any(draft.at < ts <= until for draft, until in spans) for ts in cluster.step_ts]
        during = [gap for gap, slow in zip(cluster.step_times, slowed, strict=True) if slow]
        others = [gap for gap, slow in zip(cluster.step_times, slowed, strict=True) if not slow]
        pace, base = median(during), median(others)
        if pace is None or base is None or base <= 0:
            return
        for draft, _ in spans:
            draft.slowdown, draft.pace_measured = max(1.0, pace / base), True
        cluster.step_times = others

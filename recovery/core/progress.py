"""The engine's hot path: progress (heartbeats, steps and the folded reports of them) and the checks of a rank event,
the part of `recovery.core.engine.Engine` (which derives from `Progress`) that runs for nearly every record.

Progress from before the newest restart is stale for every rank: each rank rolls back to the resume point. A
heartbeat or a step opens no journal unless it may change more than its rank's counters (a report of several ranks,
the step that closes an incident, a correction): most records cost a few attribute writes.
"""

from __future__ import annotations

import math

from events import kinds
from events.names import DecisionKind
from policies.base import LOSS_HISTORY, NS, Fault, LossSample, Signal
from recovery.core.detection import Detection
from recovery.core.incidents import Incidents
from recovery.core.job import Job
from recovery.core.record import RecordEffects, Rejected
from recovery.core.sandbox import builtin, consult

COMPUTE_WINDOW = 256
"""a rank's compute-time tally is cut back to this many steps (its mean kept) whenever it passes twice as many: its
mean weighs the last 256 to 512 steps, so a rank that turns slow late in a long generation stands out within a few
hundred steps (integer arithmetic on logged values: replay gives the same tally)"""

STEP_LEAD = 1000
"""how far one rank's step may run ahead of every other rank's before it is taken as a corrupted counter: ranks of
a job train in lockstep, a few steps apart at most (asynchronous schemes such as local SGD, a few hundred)"""


class Progress:
    incidents: Incidents
    detection: Detection
    closing: bool = False
    """the progress record being applied may close its job's incident (`Incidents.may_close`, asked once per
    record): only then is each of its steps checked against the resume point"""

    def guard(self, job: Job | None) -> object:
        """Open the journal for this record (the engine's)."""
        raise NotImplementedError

    def _check_rank(self, job: Job, rank: int, attempt: int, progress: bool = True) -> bool:
        """Validate a rank event; True if it is stale, to be ignored.

        Progress from before the newest restart is stale for every rank: each rank rolls back to the resume
        point. A process event is stale only if the rank's process has been replaced since: a rank that was
        rolled back but not restarted is the same process, and its exit is a fault."""
        if rank >= job.world:
            raise Rejected("unknown_rank", f"rank {rank} is not in job {job.id} (world {job.world})")
        if attempt > job.generation:
            raise Rejected("unknown_attempt", f"attempt {attempt} is ahead of job {job.id}'s generation "
                                             f"{job.generation}")
        return attempt < (job.generation if progress else job.rank_gen[rank])

    def report_refused(self, job: Job, entries: list[kinds.RankProgress]) -> bool:
        """Would an entry of this progress report be refused, making the whole record refused? Checked before
        any entry is applied: the common report is then applied without a journal, whose memento of the job copies
        its placement (16,384 nodes: most of a report's cost). True sends the report the journaled way, where the
        refused entry undoes the ones before it. Mirrors the refusals of `_check_rank` and `_progress`."""
        seen: set[int] = set()
        for entry in entries:
            rank = entry.rank
            if rank >= job.world or entry.attempt > job.generation or rank in seen:
                return True  # unknown, ahead, or a rank twice (its second entry depends on its first)
            seen.add(rank)
            step = entry.step
            if (step is not None and entry.attempt == job.generation and step < job.steps[rank]
                    and not self._implausible_lead(job, rank, job.steps[rank])):
                return True
        return False

    def _progress(self, out: RecordEffects, job: Job,
                  data: kinds.Heartbeat | kinds.StepReported | kinds.RankProgress) -> None:
        rank = data.rank
        ts, step = out.ts, data.step
        if isinstance(data, kinds.SummarizedRank):  # the daemon's summary of a past moment: what is past is left out
            if rank >= job.world or data.attempt > job.generation:
                return  # a rank or a generation the job no longer has (a scale, a restart since it was heard)
            ts -= round(data.heard_s * NS)  # seen when the daemon heard it
            if ts <= job.last_seen[rank]:
                return  # the engine holds a newer word of the rank: a report its agent logged since
            if step is not None and step < job.steps[rank]:
                step = None  # a step the rank has passed (or rolled back from) since: no step backwards
        current = data.attempt == job.generation
        if (rank >= len(job.steps) or not current) and self._check_rank(job, rank, data.attempt, progress=False):
            return  # from a process that a restart has replaced since, still reporting on its way out
        # Not current but not stale: a process no recovery restarted, reporting the generation it last joined (its
        # agent has not told it the new one yet). It is alive, and its steps are its own: they count for this rank
        # (a watchdog must not call it silent or stuck) but not for the job's step, and a step below its last is
        # the roll-back to the resume point, not a step backwards.
        if step is not None:
            last = job.steps[rank]
            if step < last:
                if current and not self._implausible_lead(job, rank, last):
                    raise Rejected("step_backwards", f"rank {rank} reported step {step} after step {last}")
                self._correct_step(out, job, rank, step, last, current)
            elif step > last:
                if job.rank_log is not None:  # journaled (restoring): log what is overwritten
                    job.put(job.steps, rank, step)
                    job.put(job.last_progress, rank, ts)
                else:
                    job.steps[rank] = step
                    job.last_progress[rank] = ts
                if step > job.step and current:
                    # A summary's rank may have been heard before the record that set the job's step: no pace from
                    # a time that runs backwards.
                    if job.step_ts is not None and ts >= job.step_ts:
                        per_step = (ts - job.step_ts) // (step - job.step)
                        job.step_time = per_step if job.step_time is None else (7 * job.step_time + per_step) // 8
                    job.step = step
                    job.step_ts = ts if job.step_ts is None else max(ts, job.step_ts)
        compute = None if isinstance(data, kinds.Heartbeat) else data.compute_s
        if compute is not None and current:
            # Tallied as integer ns (a float sum would depend on the order of additions): a straggler's mean shows.
            count = data.compute_steps if isinstance(data, kinds.RankProgress) else 1
            if count:
                steps, total = job.compute_steps[rank] + count, job.compute_ns[rank] + round(compute * NS) * count
                if steps > 2 * COMPUTE_WINDOW:  # keep the mean, weigh the past as COMPUTE_WINDOW steps
                    steps, total = COMPUTE_WINDOW, total * COMPUTE_WINDOW // steps
                job.put(job.compute_steps, rank, steps)
                job.put(job.compute_ns, rank, total)
        if job.rank_log is not None:
            job.put(job.last_seen, rank, ts)
        else:
            job.last_seen[rank] = ts
        if not job.spoke[rank]:
            job.put(job.spoke, rank, 1)
        if not job.sdk and not job.counted:
            # The first report through the SDK: the script is not a stock one, and its ranks' silence means something.
            # (The step hook's counts make no script an SDK one.)
            self.guard(job)
            job.sdk = True
        if step is not None and self.closing:  # the record may close the incident (`Incidents.may_close`)
            self.incidents.check_restored(out, job, rank, step, current)

    def step_loss(self, out: RecordEffects, job: Job, data: kinds.StepReported) -> None:
        """The loss of one rank's step report (an agent that does not fold): judged, and kept if it passes."""
        if (data.loss is not None and data.rank < job.world and job.rank_gen[data.rank] <= data.attempt
                <= job.generation):
            self._loss(out, job, data.rank, data.step, data.loss, data.attempt, tuple(data.skip), float(data.loss))

    def report_losses(self, out: RecordEffects, job: Job, entries: list[kinds.RankProgress]) -> None:
        """The losses of a node's report, before its steps are applied (a bad step of a restored process fails its
        attempt rather than closing it): the detection policy judges the report's worst (the non-finite one of the
        earliest step, else the highest), and the median of its finite ones joins the job's recent losses if it
        passes. Once per report, not per rank: the engine's cost grows with nodes, not with ranks."""
        worst: kinds.RankProgress | None = None
        finite: list[float] = []
        for entry in entries:
            loss = entry.loss
            if (loss is None or entry.rank >= job.world or entry.attempt < job.rank_gen[entry.rank]
                    or entry.attempt > job.generation):
                continue  # none, or from a process a restart replaced (a refused rank is the report's to refuse)
            if isinstance(loss, str):  # of several, the earliest step's: the later ones are its consequence
                if worst is None or not isinstance(worst.loss, str) or _step_of(entry) < _step_of(worst):
                    worst = entry
            else:
                finite.append(loss)
                if worst is None or (not isinstance(worst.loss, str) and loss > worst.loss):  # type: ignore[operator]
                    worst = entry
        if worst is None or worst.loss is None:
            return
        finite.sort()
        keep = finite[len(finite) // 2] if finite else None
        step = _step_of(worst)
        if step >= 0:
            self._loss(out, job, worst.rank, step, worst.loss, worst.attempt, tuple(worst.skip), keep)

    def _loss(self, out: RecordEffects, job: Job, rank: int, step: int, loss: float | str, attempt: int,
              skip: tuple[str, ...], keep: float | None) -> None:
        """A loss a rank reported for `step`: the detection policy judges it against the job's recent ones. A bad step
        is a fault that rolls the job back; otherwise `keep` joins the recent ones. Nothing is decided for a loss that
        passes: one a step would be most of the log."""
        if job.state not in ("running", "recovering"):
            return
        signal = Signal("progress.loss", LossSample(rank, step, float(loss)), out.ts, None, (rank,),
                        step_time_ns=job.step_time, world=job.world, losses=job.losses)
        if not builtin(job.policies.detection):
            self.guard(job)  # a plugin's error is counted against it (a change the journal must be able to undo)
        verdict = consult(out, job, "detection", "classify", signal)
        if isinstance(verdict, Fault) and verdict.bad_step is not None:
            self.guard(job)
            self.detection.bad_step(out, job, verdict, attempt, skip)
        elif keep is not None and math.isfinite(keep):
            # Replaced whole (an immutable value): the journal's memento restores the old one.
            job.losses = (*job.losses[-(LOSS_HISTORY - 1):], keep)

    @staticmethod
    def _implausible_lead(job: Job, rank: int, step: int) -> bool:
        """Was `step` of `rank` implausible: more than STEP_LEAD ahead of every other rank? Ranks of one job train
        in lockstep (a collective per step), so one rank that far ahead reported a corrupted counter."""
        others = max((s for r, s in enumerate(job.steps) if r != rank), default=None)
        return others is not None and step > others + STEP_LEAD

    def _correct_step(self, out: RecordEffects, job: Job, rank: int, step: int, last: int, current: bool) -> None:
        """Take a lower step for `rank`: a survivor's roll-back to the resume point, or the correction of a counter
        that had jumped implausibly far ahead (which would otherwise make every true report a step backwards)."""
        self.guard(job)
        job.put(job.steps, rank, step)
        job.put(job.last_progress, rank, out.ts)
        if current and last >= job.step:
            job.step = max(job.steps)
            job.step_ts = out.ts
        if current:
            out.decide(job, DecisionKind.PROGRESS_CORRECTED,
                       f"rank {rank} reported step {step} after step {last}, which was more than {STEP_LEAD} steps "
                       f"ahead of every other rank: taken as a corrupted counter", detail={"rank": rank,
                                                                                           "step": step,
                                                                                           "implausible": last})


def implausible_checkpoint(job: Job, step: int, ts: int) -> str | None:
    """Why a checkpoint at `step` cannot be true, or None. No rank saves a step it has not trained: beyond the
    newest reported step, a checkpoint may be ahead by STEP_LEAD plus what the job could have trained since that
    report at four times its measured pace (reports may be sparse). Before a pace is known (a job may start from
    an older run's checkpoint at any step) every step is plausible. An implausible step kept would become the
    resume point, and the job would wait for progress past a step it never reaches."""
    if job.step_time is None:
        return None
    top = max(job.steps)
    since = job.step_ts if job.step_ts is not None else max(job.last_progress)
    allowance = STEP_LEAD + max(0, ts - since) * 4 // max(job.step_time, 1)
    if step <= top + allowance:
        return None
    return (f"checkpoint at step {step} is beyond what the job can have trained: newest reported step {top}, "
            f"at most {allowance} more by now ({STEP_LEAD} + four times its pace of "
            f"{job.step_time / NS:.3g} s per step)")


def _step_of(entry: kinds.RankProgress) -> int:
    """The step of an entry's loss (-1: none said)."""
    step = entry.loss_step if entry.loss_step is not None else entry.step
    return -1 if step is None else step

"""The engine's hot path: progress (heartbeats, steps and the folded reports of them) and the checks of a rank event,
the part of `recovery.core.engine.Engine` (which derives from `Progress`) that runs for nearly every record.

Progress from before the newest restart is stale for every rank: each rank rolls back to the resume point. A
heartbeat or a step opens no journal unless it may change more than its rank's counters (a report of several ranks,
the step that closes an incident, a correction): most records cost a few attribute writes.
"""

from __future__ import annotations

from events import kinds
from events.names import DecisionKind
from policies.base import NS
from recovery.core.incidents import Incidents
from recovery.core.job import Job
from recovery.core.record import RecordEffects, Rejected

STEP_LEAD = 1000
"""how far one rank's step may run ahead of every other rank's before it is taken as a corrupted counter: ranks of
a job train in lockstep, a few steps apart at most (asynchronous schemes such as local SGD, a few hundred)"""


class Progress:
    incidents: Incidents

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
        current = data.attempt == job.generation
        if (rank >= len(job.steps) or not current) and self._check_rank(job, rank, data.attempt, progress=False):
            return  # from a process that a restart has replaced since, still reporting on its way out
        # Not current but not stale: a process no recovery restarted, reporting the generation it last joined (its
        # agent has not told it the new one yet). It is alive, and its steps are its own: they count for this rank
        # (a watchdog must not call it silent or stuck) but not for the job's step, and a step below its last is
        # the roll-back to the resume point, not a step backwards.
        ts = out.ts
        step = data.step
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
                    if job.step_ts is not None:
                        per_step = (ts - job.step_ts) // (step - job.step)
                        job.step_time = per_step if job.step_time is None else (7 * job.step_time + per_step) // 8
                    job.step = step
                    job.step_ts = ts
        if job.rank_log is not None:
            job.put(job.last_seen, rank, ts)
        else:
            job.last_seen[rank] = ts
        if not job.sdk:
            # The first report through the SDK: the script is not a stock one, and its ranks' silence means something.
            self.guard(job)
            job.sdk = True
        if step is not None and job.incident is not None and job.incident.phase == "restoring":
            self.incidents.check_restored(out, job, rank, step, current)

    @staticmethod
    def _implausible_lead(job: Job, rank: int, step: int) -> bool:
        """Was `step` of `rank` implausible: more than STEP_LEAD ahead of every other rank? Ranks of one job train
        in lockstep (a collective per step), so one rank that far ahead reported a corrupted counter."""
        others = max((s for r, s in enumerate(job.steps) if r != rank), default=None)
        return others is not None and step > others + STEP_LEAD

    @staticmethod
    def _implausible_checkpoint(job: Job, step: int, ts: int) -> str | None:
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

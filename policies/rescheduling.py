"""Built-in rescheduling policy: a user-defined escalation ladder per fault class.

Each rung names a granularity, a budget (attempts of that rung for that fault class within one incident;
the job spec's `max_restarts` bounds restarts over the job's life) and a deadline (from the attempt's
start until the job makes progress past its resume point).
An attempt that fails or misses its deadline moves the incident one rung up. A rung that cannot help
(a step retry when a process is gone, an in-place restart on a dead node) is skipped; a rung that
needs nodes the cluster does not have scales the job in if it is elastic, or waits for nodes.

The ladder fails a job only for its script: a crash loop (the same step, again and again), no progress through its
recoveries (`no_progress_after`), a fault no rung can recover in a job that does not persist. A fault of the
infrastructure whose rungs are spent waits and restarts the whole job, or waits for nodes: every wait has a deadline
and a way on after it (`persist`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field

from events.values import MAX_SECONDS, Count, Factor, FaultClass, Flag, Granularity, Interval, PositiveCount, Seconds
from policies.base import (
    NS,
    Fail,
    Params,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicyBase,
    Settle,
    StartRung,
    Wait,
)
from policies.no_progress import INFRASTRUCTURE, no_progress
from policies.script_errors import deterministic_error, quoting_the_script

G = Granularity


class Rung(Params):
    granularity: Granularity
    budget: Count | None = Field(None, description="attempts within one incident; None: unlimited")
    deadline_s: Interval = Field(300.0, description="from the attempt's start to progress: 1 ms .. 30 days")
    tries: PositiveCount = Field(1, description="failed attempts in a row at this rung before the next rung")
    wait_s: Interval = Field(4 * 3600.0, description="the longest the job waits for the nodes this rung needs before "
                                                      "the ladder falls back: 1 ms .. 30 days")


def _ladder(*rungs: tuple[Granularity, int | None, float] | tuple[Granularity, int | None, float, int]
            ) -> list[Rung]:
    return [Rung(granularity=r[0], budget=r[1], deadline_s=r[2], tries=r[3] if len(r) > 3 else 1) for r in rungs]


# A pod-level move gets a second try: one executor error there must not cost a job-level restart, which takes
# minutes at scale and reloads the whole job.
DEFAULT_LADDERS: dict[FaultClass, list[Rung]] = {
    FaultClass.NETWORK: _ladder((G.RETRY, 3, 60), (G.IN_PLACE, 3, 180), (G.MIGRATE, None, 300, 2),
                                (G.RESTART_JOB, 3, 900)),
    FaultClass.PROCESS: _ladder((G.IN_PLACE, 3, 180), (G.MIGRATE, None, 300, 2), (G.RESTART_JOB, 3, 900)),
    FaultClass.HANG: _ladder((G.IN_PLACE, 3, 180), (G.MIGRATE, None, 300, 2), (G.RESTART_JOB, 3, 900)),
    FaultClass.DEVICE: _ladder((G.IN_PLACE, 3, 180), (G.MIGRATE, None, 300, 2), (G.RESTART_JOB, 3, 900)),
    FaultClass.NODE: _ladder((G.MIGRATE, None, 300, 2), (G.RESTART_JOB, 3, 900)),
    FaultClass.PREEMPTION: _ladder((G.MIGRATE, None, 300, 2), (G.RESTART_JOB, None, 900)),
    # A bad step poisons every replica: every rank restarts in place from the checkpoint before it (its fault names
    # them all), which needs no spare; a whole-job restart if that fails.
    FaultClass.BAD_STEP: _ladder((G.IN_PLACE, 2, 300), (G.RESTART_JOB, 2, 900)),
}


class LadderParams(Params):
    ladders: dict[FaultClass, list[Rung]] = Field(default_factory=lambda: dict(DEFAULT_LADDERS))
    elastic: Flag = True
    """when a rung needs nodes that are not there, scale in by data-parallel replicas if the job allows"""
    wait: Flag = True
    """otherwise wait for nodes (the job goes to `waiting`) instead of escalating"""
    deadline_steps: Factor = 3.0
    """a rung's deadline is at least this many of the job's step times: the attempt ends with progress past the
    resume point, and a job whose step takes minutes cannot show that within a deadline set for seconds (at most 30
    days, like every deadline)"""
    reset_after_s: Interval = Field(300.0, description="when the only thing keeping the ranks off their node is a "
                                                         "device a reset clears (XID 48), wait this long at most "
                                                         "for a spare, then reset it and restart in place: "
                                                         "1 ms .. 30 days")
    no_progress_after: PositiveCount | None = Field(5, description="recoveries in a row of a fault of the script "
                                                                   "(a crash, a hang, a bad step) after which the job "
                                                                   "got no step past the furthest it had reached "
                                                                   "before: at the next such fault the job fails and "
                                                                   "says so. Faults of the infrastructure neither "
                                                                   "count nor end the run. None: never")
    persist: Flag = Field(True, description="a fault of the infrastructure (device, node, network, preemption) never "
                                            "fails the job: when the ladder has no rung left for it (its budgets "
                                            "spent, no spare, a wait that ran out), the job waits retry_after_s "
                                            "and restarts whole, or waits again for nodes")
    retry_after_s: Interval = Field(300.0, description="with persist: the wait before a job-level restart once the "
                                                       "ladder has no rung left: 1 ms .. 30 days")
    loop_after: PositiveCount | None = Field(2, description="a crash loop: the job crashes again where it crashed "
                                                            "before, after this many recoveries in a row; the job "
                                                            "fails and says so. None: never")
    loop_steps: Count = Field(2, description="crashes this many steps apart or fewer are at the same step (a job "
                                             "whose faults strike as it goes gets further each time)")
    loop_time_ratio: Factor = Field(0.2, description="for a script that reports no steps: crashes whose run times "
                                                     "since the last recovery differ by this fraction or less (and by "
                                                     "5 s or less) recur at the same point; one more recovery in a "
                                                     "row is needed to call it a loop")
    running_grace_s: Interval = Field(30.0, description="for a script that reports no steps (no SDK): its restarted "
                                                        "processes have recovered the job once they have run this "
                                                        "long without exiting: 1 ms .. 30 days")
    settle_s: Seconds = Field(2.0, description="0 .. 30 days")
    """after an attempt is superseded by a fault outside it, collect further faults this long before the next
    attempt: a job-wide crash reports its thousands of exits one by one, and each would otherwise supersede the
    last attempt (0: no window)"""
    quick_widenings: Count = Field(2, description="for a crash or hang restarted in place: the first this many "
                                                  "faults that widen the incident restart their ranks at once, "
                                                  "without the settle window; later ones settle")
    """two ranks killed together are the common case, not a job-wide crash: the engine carries the restart already
    under way over into the next attempt, so each further fault adds only its own ranks, and waiting 2 s to gather
    them would cost more than it saves"""


class LadderRescheduling(ReschedulingPolicyBase):
    name: ClassVar[str] = "ladder"
    version: ClassVar[str] = "8"  # 2: a settle window after a superseded attempt; 3: tries per rung; 4: deadline_steps;
    # 5: every wait has a deadline and a fallback (a device reset in place, scale in, or fail with the reason);
    # 6: a stock script (no SDK) restarts whole; a restart budget over a window; crash loops fail the job;
    # 7: the first quick_widenings of a crash restarted in place do not settle; 8: no restart budget over a window but
    # a no-progress rule, a rung carried across ladders by granularity, and an infrastructure fault never fails the job
    # (the bad-step ladder is no new version: no log before it holds a bad step, so no decision of one changes)

    parameters = LadderParams
    params: LadderParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        # Its own model, not `self.parameters`: a subclass may take other parameters and pass these on.
        self.params = LadderParams.model_validate(dict(params or {}))
        # Classes the user left out keep their defaults, so a partial ladder is never a silent gap.
        self.ladders = {**DEFAULT_LADDERS, **self.params.ladders}

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        # A script that fails by itself the same way everywhere is no fault to climb a ladder for.
        answer = None if ctx.forced is not None else deterministic_error(ctx)
        answer = quoting_the_script(answer or self._decide(ctx), ctx)
        if isinstance(answer, StartRung):
            return replace(answer, grace_ns=int(self.params.running_grace_s * NS))
        return answer

    def _quick(self, ctx: RescheduleContext) -> bool:
        """Does a widened incident restart at once: a crash or hang whose attempts so far were all in place, and no
        more than `quick_widenings` of them superseded?"""
        if ctx.fault_class not in (FaultClass.PROCESS, FaultClass.HANG) or not ctx.reform:
            return False
        if any(a.granularity is not G.IN_PLACE for a in ctx.previous):
            return False
        return sum(1 for a in ctx.previous if a.outcome == "superseded") <= self.params.quick_widenings

    def _decide(self, ctx: RescheduleContext) -> Reschedule:
        if ctx.forced is not None:
            return StartRung(ctx.forced, f"operator forced {ctx.forced.value}", deadline_ns=900 * NS)
        if ctx.max_restarts is not None and ctx.restarts_used >= ctx.max_restarts:
            return Fail(f"restart budget max_restarts exhausted: {ctx.restarts_used} of {ctx.max_restarts} used")
        if not ctx.previous:  # a loop shows at an incident's first fault; its own failed attempts are the ladder's
            loop = self._loop(ctx) or self._no_progress(ctx)
            if loop is not None:
                return Fail(loop)
        if ctx.widened and self.params.settle_s > 0 and not self._quick(ctx):
            return Settle(f"a fault outside the last attempt widened the incident: collect faults for "
                          f"{self.params.settle_s:g} s before the next attempt", int(self.params.settle_s * NS))
        ladder = self.ladders[ctx.fault_class]
        start = 0
        if ctx.previous:
            last = ctx.previous[-1]
            # A superseded attempt did not fail: the widened incident starts again at the same rung. A failed one
            # moves up once its rung has had its tries in a row. The incident may have changed ladders since (a host
            # lost during a device fault's restart makes it a node fault, whose ladder is shorter): a superseded
            # rung is kept within the new ladder, a failed one is found there by its granularity.
            if last.outcome == "superseded":
                start = min(last.rung, len(ladder) - 1)
            else:
                at = _rung_in(ladder, last.rung, last.granularity)
                start = at if _failed_in_a_row(ctx) < ladder[at].tries else at + 1
        exhausted: list[str] = []
        blocked: list[str] = []  # rungs that cannot run on the job's nodes now, and why
        stock = False
        order = list(range(start, len(ladder)))
        if ctx.previous and ctx.previous[-1].outcome != "superseded" and start == len(ladder):
            # The top rung failed: try it again while its budget lasts rather than give up at once.
            order.append(len(ladder) - 1)
        for index in order:
            rung = ladder[index]
            g = rung.granularity
            deadline = _deadline(self, rung, ctx)
            key = f"{ctx.fault_class.value}/{g.value}"
            if g is G.FAIL:
                return Fail(f"ladder for {ctx.fault_class.value} ends in fail")
            if g is G.RETRY and (ctx.any_lost or ctx.needs_move):
                continue
            if not ctx.reform and g in (G.RETRY, G.IN_PLACE, G.MIGRATE):
                # Surviving processes that do not re-form in process (a stock script's, or a script's that only
                # reports its steps) cannot join restarted peers: only a job-level restart helps.
                stock = True
                continue
            if g is G.IN_PLACE and ctx.needs_move:
                blocked.append(f"{g.value}: {ctx.nodes_to_replace} node(s) cannot run processes now")
                continue
            if rung.budget is not None and ctx.used.get(key, 0) >= rung.budget:
                exhausted.append(f"{key} {ctx.used.get(key, 0)} of {rung.budget} used")
                continue
            need = ctx.nodes_to_migrate if g is G.MIGRATE else ctx.nodes_to_replace
            if g in (G.MIGRATE, G.RESTART_JOB) and need > ctx.spares_available:
                short = f"{need} node(s) to replace, {ctx.spares_available} spare(s)"
                if not ctx.needs_move:
                    continue  # the nodes still work: a bigger restart in place beats waiting for a spare
                if self.params.elastic and ctx.scale_in_dp is not None:
                    return StartRung(G.SCALE_IN, f"{short}: scale in to dp={ctx.scale_in_dp}", deadline, index)
                if self.params.wait:
                    return self._wait_or_fall_back(ctx, short, rung.wait_s, deadline, index)
                continue
            if g is G.SCALE_IN and ctx.scale_in_dp is None:
                continue
            return StartRung(g, f"{ctx.fault_class.value} fault, rung {index}: {g.value}", deadline, index)
        if blocked and self.params.wait:
            # The rungs left need nodes that cannot run processes now (a link down and being debounced, a node not
            # ready): a condition that often passes by itself. Wait for it, bounded, rather than fail at once.
            wait_s = max(ladder[i].wait_s for i in order)
            return self._wait_or_fall_back(ctx, "; ".join(blocked), wait_s, 0, max(order, default=0))
        if self._persists(ctx):
            why = ("restart budget exhausted: " + "; ".join(exhausted) if exhausted else
                   f"no rung of the {ctx.fault_class.value} ladder can recover this fault now")
            return self._restart_whole(ctx, why, ladder)
        if exhausted:
            # A fault of the script: every rung was tried as often as its budget allows, and none got the job a step
            # past where the fault struck it.
            return Fail(f"no progress: {len(ctx.previous)} attempt(s) of this incident ended without a step past "
                        f"{ctx.fault_step}; restart budget exhausted: " + "; ".join(exhausted))
        if stock:
            return Fail(f"no rung of the {ctx.fault_class.value} ladder can recover this fault: the script does not "
                        f"use the SDK, and only a job-level restart (restart_job) restarts every process")
        return Fail(f"no rung of the {ctx.fault_class.value} ladder can recover this fault")

    def _persists(self, ctx: RescheduleContext) -> bool:
        """Is this a fault the job must outlast rather than fail for: the infrastructure's, under `persist`?"""
        return self.params.persist and ctx.fault_class in INFRASTRUCTURE

    def _restart_whole(self, ctx: RescheduleContext, why: str, ladder: list[Rung]) -> Reschedule:
        """The ladder has no rung left for an infrastructure fault: restart the whole job once `retry_after_s` has
        passed (the failures that spent the rungs may pass too: a flapping switch, an executor's bad minute), or, if
        the nodes for that are missing, wait for them. Either way bounded, and never a failure of the job."""
        wait_s = self.params.retry_after_s
        if not ctx.wait_expired:
            return Wait(f"{why}: wait {wait_s:g} s, then restart the whole job", int(wait_s * NS))
        if ctx.nodes_to_replace > ctx.spares_available:
            if self.params.elastic and ctx.scale_in_dp is not None:
                return StartRung(G.SCALE_IN, f"{why}: scale in to dp={ctx.scale_in_dp}", _deadline(self, ladder[-1],
                                 ctx), len(ladder) - 1)
            longest = max(r.wait_s for r in ladder)
            return Wait(f"{why}: {ctx.nodes_to_replace} node(s) to replace, {ctx.spares_available} spare(s): wait "
                        f"for nodes, at most {longest:g} s", int(longest * NS))
        return StartRung(G.RESTART_JOB, f"{why}: waited {ctx.waited_ns / NS:.0f} s, restart the whole job from the "
                         f"newest complete checkpoint", _deadline(self, ladder[-1], ctx), len(ladder) - 1)

    def _no_progress(self, ctx: RescheduleContext) -> str | None:
        """Why the job makes no progress through its recoveries (`policies.no_progress`), or None."""
        return no_progress(ctx, self.params.no_progress_after)

    def _loop(self, ctx: RescheduleContext) -> str | None:
        """Why the open incident is a crash loop, or None: after each of the last `loop_after` recoveries the job
        crashed again at the same step (within `loop_steps`) with the same class of fault. A script that reports no
        steps is compared by how long it ran after each recovery (within `loop_time_ratio`), one recovery more."""
        p = self.params
        if p.loop_after is None:
            return None
        runs = list(ctx.recent)
        if not ctx.sdk:
            need = p.loop_after + 1
            if len(runs) < need or any(r.outcome != "recovered" for r in runs[-need:]):
                return None
            # The run time after each recovery: from that incident's close to the next incident's open.
            spans = [runs[i + 1].opened_ns - runs[i].closed_ns for i in range(len(runs) - need, len(runs) - 1)]
            spans.append(ctx.now_ns - runs[-1].closed_ns)
            low, high = min(spans), max(spans)
            if high - low > min(p.loop_time_ratio * high, 5 * NS) or any(
                    r.fault_class is not ctx.fault_class for r in runs[-need + 1:]):
                return None
            return (f"crash loop: the job crashed {high / NS:.0f} s or less after each of its last {need} recoveries "
                    f"({ctx.fault_class.value} fault, ranks {list(ctx.fault_ranks)}); the script reports no steps, "
                    f"so nothing tells the point apart: fix the script or its data, then submit it again")
        need = p.loop_after
        if len(runs) < need or ctx.fault_step == 0:
            return None
        steps = [run.fault_step for run in runs[-need:]] + [ctx.fault_step]
        if max(steps) - min(steps) > p.loop_steps:
            return None  # the job got further each time: faults that strike as it goes, not one that stops it
        for run in runs[-need:]:
            if run.outcome != "recovered" or run.fault_class is not ctx.fault_class:
                return None
            if run.resume_step is None or run.resume_step >= min(steps):
                return None  # it did not go back before the step: nothing was trained again and crashed again
        return (f"crash loop: the job crashed at step {ctx.fault_step} ({ctx.fault_class.value} fault, ranks "
                f"{list(ctx.fault_ranks)}) after each of its last {need} recoveries, at steps "
                f"{[r.fault_step for r in runs[-need:]]}: recovering again would crash there again")

    def _wait_or_fall_back(self, ctx: RescheduleContext, short: str, wait_s: float, deadline: int, rung: int
                           ) -> Reschedule:
        """The job cannot have the nodes it needs now: wait for them, bounded. Once the wait has run out: reset the
        devices a reset clears and restart those ranks where they are (moving only the ranks of the other nodes, if
        the spares cover them), else fail and say why."""
        # A reset and a restart of some ranks keeps the others running: a script without the SDK cannot rejoin them.
        in_place = ctx.reset_clears and ctx.reform
        partly = (ctx.reform and not in_place and ctx.nodes_after_reset < ctx.nodes_to_replace
                  and ctx.nodes_after_reset <= ctx.spares_available)
        if ctx.wait_expired:
            waited = f"waited {ctx.waited_ns / NS:.0f} s: "
            first = max(deadline, int(self.ladders[ctx.fault_class][0].deadline_s * NS))
            if in_place:
                return StartRung(G.IN_PLACE, f"{short}: {waited}reset the faulty device(s) and restart in place",
                                 first, rung, reset_devices=True)
            if partly:
                return StartRung(G.MIGRATE, f"{short}: {waited}reset the device(s) a reset clears, restart those "
                                            f"ranks in place and move the ranks of {ctx.nodes_after_reset} node(s)",
                                 max(deadline, first), rung, reset_devices=True)
            if self._persists(ctx):
                # The cluster has not the nodes now; repairs bring them back. A new stretch of waiting, with its own
                # deadline: the job is never failed for the hardware it lost.
                return Wait(f"{short}: {waited}the job is not elastic and no device reset clears the fault: wait for "
                            f"nodes again, at most {wait_s:g} s", int(wait_s * NS))
            return Fail(f"{short}: {waited}no fallback: the job is not elastic and no device reset clears the fault")
        wait = min(wait_s, self.params.reset_after_s) if in_place or partly else wait_s
        then = ("reset the device(s) and restart in place" if in_place else
                "reset what a reset clears and move the rest" if partly else
                "wait again" if self._persists(ctx) else "fail")
        return Wait(f"{short}: wait for nodes, at most {wait:g} s, then {then}", int(wait * NS))


def _deadline(policy: LadderRescheduling, rung: Rung, ctx: RescheduleContext) -> int:
    """A rung's deadline, at least `deadline_steps` of the job's steps, at most 30 days, in ns."""
    return min(max(int(rung.deadline_s * NS), int(policy.params.deadline_steps * (ctx.step_time_ns or 0))),
               int(MAX_SECONDS * NS))


def _rung_in(ladder: list[Rung], rung: int, granularity: Granularity) -> int:
    """The index in `ladder` of an attempt made at `rung` with `granularity` (maybe on another class's ladder): the
    same index when it has that granularity there, else the first rung at least as large, else the top."""
    if rung < len(ladder) and ladder[rung].granularity is granularity:
        return rung
    size = _SIZES.get(granularity, len(_SIZES))
    for index, candidate in enumerate(ladder):
        if _SIZES.get(candidate.granularity, len(_SIZES)) >= size:
            return index
    return len(ladder) - 1


_SIZES = {g: i for i, g in enumerate((G.RETRY, G.IN_PLACE, G.MIGRATE, G.SCALE_IN, G.RESTART_JOB))}
"""how much of the job each recovering granularity restarts, smallest first"""


def _failed_in_a_row(ctx: RescheduleContext) -> int:
    """Failed or timed-out attempts at the last attempt's rung, counted back to the first other rung or superseded
    attempt."""
    rung = ctx.previous[-1].rung
    count = 0
    for summary in reversed(ctx.previous):
        if summary.rung != rung or summary.outcome == "superseded":
            break
        count += 1
    return count

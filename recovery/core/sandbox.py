"""Policies are third-party code: the engine consults them through here, and survives what they do.

A policy's answer is checked before the engine acts on it: its type is one of the family's answers, every
duration is a nanosecond count between 1 ms and 30 days (a value below 1 ms is a unit mistake, seconds given for
nanoseconds), every reason says something, every rank it names is the job's. A policy that raises, or answers what
fails these checks, does not fail the record (the event that asked it is valid, and must not be lost): the built-in
policy of its family answers instead, and a `policy.failed` decision names the plugin and its error. After
`POLICY_STRIKES` such errors in one job, the plugin is replaced for that job by the built-in (`replaced` in the
decision), so that a job always keeps an exit. The built-in policies themselves are ours: an error of theirs is a
bug, and fails the record as before (`policy_error`).

Loops are answers that are each valid but together never end: `recovery.core.incidents` counts a rescheduling
policy's settle windows and re-waits in a row, and how often it is asked within a short stretch of log time, and
hands a policy that loops to `fail_over` like one that errs.

A plugin's call that never returns is the host's to abandon (`recovery.core.overruns`: the engine reads no clock), and
the built-in answers it like a call that raised. Answers that are each valid and together keep a job that gets no
further recovering for ever (a restart at every fault of a script that crashes before its next checkpoint) meet the
built-in ladder's no-progress rule (`policies.no_progress`), which the engine keeps around every plugin.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from events.kinds import PolicyOverran as OverranFact
from events.names import DecisionKind
from events.values import MAX_SECONDS, Granularity
from policies.base import (
    NS,
    AwaitDying,
    Clear,
    Drain,
    Fail,
    Fault,
    Ignore,
    Reschedule,
    RescheduleContext,
    Resume,
    SaveDying,
    Settle,
    StartRung,
    Suspect,
    Wait,
    label,
)
from policies.checkpoint import NewestCompleteCheckpoint
from policies.detection import DefaultDetection
from policies.no_progress import no_progress
from policies.rescheduling import LadderRescheduling
from recovery.core.job import Job
from recovery.core.overruns import Abandoned, PolicyCalls, PolicyOverran, PolicyRaised, raised_problem
from recovery.core.record import RecordEffects, Rejected

POLICY_STRIKES = 3
"""errors (or loops) of one family's plugin in one job before the built-in replaces it for that job"""
PLUGIN_NO_PROGRESS_AFTER = 5
"""recoveries in a row from faults of the script with no step past the furthest before, after which the engine fails
a job whose rescheduling plugin would restart it again: the built-in ladder's `no_progress_after` default"""
MIN_DURATION_NS = NS // 1000
"""the shortest duration a policy may answer: anything shorter is taken for seconds given as nanoseconds"""
MAX_DURATION_NS = int(MAX_SECONDS * NS)
BUILTIN: dict[str, Any] = {"detection": DefaultDetection(), "rescheduling": LadderRescheduling(),
                           "checkpoint": NewestCompleteCheckpoint()}
"""the policy that answers for a plugin that failed, with its default parameters: pure, so one instance serves all"""
_PARTIAL = (Granularity.RETRY, Granularity.IN_PLACE, Granularity.MIGRATE)


def builtin(policy: Any) -> bool:
    """Is this one of the policies shipped in `policies` (an error of theirs is a bug of ours)?"""
    return type(policy).__module__.split(".")[0] == "policies"


def knows_deadlines(policy: Any) -> bool:
    """Can the detection policy say when its check could next find something (`next_check`)? Only one of ours, and
    only where the class that wrote its `check` wrote its `next_check` too: a subclass with a check of its own would
    inherit deadlines that are not its check's."""
    if not builtin(policy):
        return False
    mro = type(policy).__mro__
    wrote_next = next((cls for cls in mro if "next_check" in vars(cls)), None)
    wrote_check = next((cls for cls in mro if "check" in vars(cls)), None)
    return wrote_next is not None and wrote_check is not None and issubclass(wrote_next, wrote_check)


def consult(out: RecordEffects, job: Job, family: str, method: str, argument: Any) -> Any:
    """Ask the job's `family` policy; an exception or an answer that fails its checks is handed to `fail_over`.

    A third-party policy is asked where the host runs it (`policy_calls`), within a budget; a call the log says was
    abandoned (`recovery.core.overruns`) is not made again, and one the host abandons now undoes the record
    (`PolicyOverran`) for the driver to write the fact and apply it again."""
    policy = getattr(job.policies, family)
    if builtin(policy):  # ours: in-process, the fast path, and an error of theirs is a bug (`fail_over`)
        return _checked(out, job, family, method, argument, policy, None)
    engine = out.engine
    call = out.call_index(job.id, family, method)
    name = job.policies.labels.get(family, "?")
    known = engine.overruns.get((out.seq, job.id, family, method, call))
    if known is not None and known.policy == name:
        return fail_over(out, job, family, method, argument,
                         f"did not answer within {known.budget_s:g} s: the call was abandoned")
    try:
        answer = _checked(out, job, family, method, argument, policy, engine.policy_calls)
    except Abandoned as exc:
        raise PolicyOverran(job.id, OverranFact(seq=out.seq, family=family, method=method, call=call, policy=name,
                                                budget_s=exc.budget_s)) from None
    if family == "rescheduling" and isinstance(answer, StartRung):
        return _progress_rule(answer, argument, name)
    return answer


def _checked(out: RecordEffects, job: Job, family: str, method: str, argument: Any, policy: Any,
             calls: PolicyCalls | None) -> Any:
    try:
        answer = getattr(policy, method)(argument) if calls is None else calls.call(policy, method, argument)
        problem = answer_problem(family, method, answer, argument)
    except (Abandoned, PolicyOverran):
        raise
    except PolicyRaised as exc:  # raised in its worker: named there as it would be here
        answer, problem = None, exc.problem
    except Exception as exc:  # third-party code: anything it raises is its error, never the engine's
        answer, problem = None, raised_problem(exc)
    if problem is None:
        return answer
    return fail_over(out, job, family, method, argument, problem)


def _progress_rule(answer: StartRung, ctx: RescheduleContext, name: str) -> Reschedule:
    """The no-progress rule the built-in ladder keeps, kept by the engine around a plugin: a plugin that restarts the
    job at every fault must not keep a job that never gets further recovering for ever (at an incident's first
    decision only, as the ladder does: its own attempts are the plugin's business)."""
    if ctx.previous or ctx.forced is not None:
        return answer
    stuck = no_progress(ctx, PLUGIN_NO_PROGRESS_AFTER)
    if stuck is None:
        return answer
    return Fail(f"{stuck} (the engine's rule around rescheduling policy {name}, which chose "
                f"{answer.granularity.value})")


def fail_over(out: RecordEffects, job: Job, family: str, method: str, argument: Any, problem: str) -> Any:
    """The job's `family` policy erred (`problem`): the built-in answers this call; after POLICY_STRIKES errors it
    replaces the plugin for this job. Returns the built-in's answer."""
    policy = getattr(job.policies, family)
    name = job.policies.labels.get(family, "?")
    if builtin(policy):
        raise Rejected("policy_error", f"{family} policy {name} {problem}")
    fallback = BUILTIN[family]
    answer = getattr(fallback, method)(argument)
    errors = job.policy_errors.get(family, 0) + 1
    job.policy_errors = {**job.policy_errors, family: errors}
    replaced = errors >= POLICY_STRIKES
    by = label(fallback)
    if replaced:
        job.policies = replace(job.policies, **{family: fallback}, labels={**job.policies.labels, family: by})
    then = (f"; replaced by {by} for this job after {errors} errors" if replaced else
            f" ({errors} of {POLICY_STRIKES} errors before it is replaced for this job)")
    out.decide(job, DecisionKind.POLICY_FAILED, f"{family} policy {name} {problem}: {by} answers instead{then}",
               policy=name, detail={"family": family, "method": method, "policy": name, "errors": errors,
                                    "replaced": replaced, "by": by})
    return answer


def _duration(name: str, value: Any, optional: bool = False, zero: bool = False) -> str | None:
    """What is wrong with a duration a policy answered (`optional`: None allowed; `zero`: 0, meaning none)."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return f"answered {name}={value!r}: a duration is an int of nanoseconds (policies.NS per second)"
    if value == 0 and zero:
        return None
    if value < 0:
        return f"answered {name}={value} ns: a duration is not negative"
    if value < MIN_DURATION_NS:
        return (f"answered {name}={value} ns: shorter than 1 ms, taken for a unit mistake (durations are "
                f"nanoseconds: {value} s is {value} * NS)")
    if value > MAX_DURATION_NS:
        return f"answered {name}={value} ns: longer than {MAX_SECONDS:g} s"
    return None


def _reason(answer: Any) -> str | None:
    reason = getattr(answer, "reason", None)
    if not isinstance(reason, str) or not reason.strip():
        return f"answered {type(answer).__name__} with no reason: every decision says why"
    return None


def answer_problem(family: str, method: str, answer: Any, argument: Any) -> str | None:
    """What is wrong with a policy's answer to `method(argument)`, or None (the policy kit checks the same)."""
    if family == "rescheduling":
        return _check_reschedule(answer, argument)
    if family == "checkpoint":
        if not isinstance(answer, Resume | SaveDying | AwaitDying):
            return f"answered {answer!r}, not one of Resume, SaveDying, AwaitDying"
        return _duration("wait_ns", answer.wait_ns) if isinstance(answer, AwaitDying) and answer.wait_ns else None
    if method == "check":
        if not isinstance(answer, list | tuple):
            return f"answered {answer!r} from check, not a list of verdicts"
        for verdict in answer:
            problem = _check_verdict(verdict, argument.world)
            if problem is not None:
                return problem
        return None
    return _check_verdict(answer, argument.world)


def _check_reschedule(answer: Any, ctx: Any) -> str | None:
    if not isinstance(answer, StartRung | Wait | Settle | Fail):
        return f"answered {answer!r}, not one of StartRung, Wait, Settle, Fail"
    problem = _reason(answer)
    if problem is not None:
        return problem
    if isinstance(answer, StartRung):
        if not isinstance(answer.granularity, Granularity):
            return f"answered StartRung of {answer.granularity!r}, not a Granularity"
        if not isinstance(answer.rung, int) or isinstance(answer.rung, bool) or answer.rung < 0:
            return f"answered StartRung with rung={answer.rung!r}: a count from 0"
        if not ctx.reform and ctx.forced is None and answer.granularity in _PARTIAL:
            return (f"answered {answer.granularity.value} for a script whose ranks do not re-form in process: its "
                    f"surviving processes cannot join restarted peers, only a job-level restart recovers it")
        return _duration("deadline_ns", answer.deadline_ns) or _duration("grace_ns", answer.grace_ns)
    if isinstance(answer, Wait):
        return _duration("deadline_ns", answer.deadline_ns, optional=True)
    if isinstance(answer, Settle):
        return _duration("settle_ns", answer.settle_ns)
    return None


def _check_verdict(verdict: Any, world: int) -> str | None:
    if not isinstance(verdict, Ignore | Suspect | Clear | Fault | Drain):
        return f"answered {verdict!r}, not one of Ignore, Suspect, Clear, Fault, Drain"
    problem = _reason(verdict)
    if problem is not None:
        return problem
    fault = verdict.fault if isinstance(verdict, Suspect) else verdict
    if isinstance(verdict, Suspect):
        problem = _duration("confirm_after_ns", verdict.confirm_after_ns, zero=True)
        if problem is not None:
            return problem
    if isinstance(fault, Fault):
        outside = [r for r in fault.ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world]
        if outside:
            return f"answered a fault of ranks {outside[:8]}, not ranks of the job (world {world})"
        bad = fault.bad_step
        if bad is not None and (not isinstance(bad, int) or isinstance(bad, bool) or bad < 0):
            return f"answered a fault whose bad_step is {bad!r}, not a step (an integer, 0 or more)"
        return _duration("isolate_for_ns", fault.isolate_for_ns, optional=True)
    return None


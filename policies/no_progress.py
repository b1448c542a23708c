"""The no-progress rule: a job that gets no further through its recoveries from faults of its script is failed.

One rule, two users: the built-in ladder applies it with its `no_progress_after`, and the engine applies it around
every third-party rescheduling policy (`recovery.core.sandbox`), so that a plugin which restarts the job at every
fault cannot keep a job that never gets further running for ever.
"""

from __future__ import annotations

from events.values import FaultClass
from policies.base import RescheduleContext

INFRASTRUCTURE = frozenset((FaultClass.DEVICE, FaultClass.NODE, FaultClass.NETWORK, FaultClass.PREEMPTION))
"""fault classes of the cluster, not of the script: they say nothing of whether the script gets further"""


def no_progress(ctx: RescheduleContext, need: int | None) -> str | None:
    """Why the job makes no progress through its recoveries, or None: at a fault of its script, its last `need`
    recoveries from faults of its script each ended with the job no further than the furthest step it had reached
    before (recoveries from faults of the infrastructure are passed over: they say nothing of the script)."""
    if need is None or not ctx.sdk or ctx.fault_class in INFRASTRUCTURE or ctx.fault_step == 0:
        return None
    runs = list(ctx.recent)
    # The furthest step reached before each recovery, and the step the job got to after it (where it was at the
    # next incident's fault: the one after it, or the open one).
    after = [run.fault_step for run in runs[1:]] + [ctx.fault_step] if runs else []
    furthest = 0
    stalled: list[int] = []
    for run, reached in zip(runs, after, strict=True):
        furthest = max(furthest, run.fault_step)
        if run.outcome != "recovered" or reached > furthest:
            stalled = []
        elif run.fault_class not in INFRASTRUCTURE:
            stalled.append(reached)
    if len(stalled) < need:
        return None
    return (f"no progress: the job got no further than step {furthest} through its last {len(stalled)} recoveries "
            f"from faults of its script (it reached steps {stalled} after them; no_progress_after {need}): "
            f"recovering again would not get it further; fix the script or its data, then submit it again")

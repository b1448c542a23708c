"""The rescheduling policy's rule for a script that fails by itself: a deterministic error, and the script's own
words in the reason a job fails with.

Every rank failing the same way before the job's first step, in one generation and again in the next, is no fault a
restart cures: a typo in a flag or an override, a script or a file that does not exist, an exception at import. The
job fails after that one retry, with the ranks' error quoted, instead of retrying until a budget is gone (torchrun
retries `--max-restarts` times). One retry, because the first time may be the infrastructure's (a file system that
answered late). Only an error the script said (its `@record` error file, or its output) counts: an exit code alone
says nothing of where the failure came from, and logs from before exits carried errors replay as they did.

The first rank to fail brings about the restart that stops the others: when it fails the way the whole generation
before it did, the policy waits `window_ns` for the other ranks' exits (a settle window) before it judges.
"""

from __future__ import annotations

from policies.base import NS, Fail, FailedExits, Reschedule, RescheduleContext, Settle

WINDOW_NS = 5 * NS
"""how long the other ranks' exits are waited for: ranks that fail at import start within seconds of each other"""


def deterministic_error(ctx: RescheduleContext, window_ns: int = WINDOW_NS) -> Fail | Settle | None:
    """Fail the job if every rank failed the same way, before its first step, in the last two generations that
    failed; settle while the last one may still get there; None: not this rule's case."""
    generations = sorted({e.generation for e in ctx.exits})
    if len(generations) < 2 or ctx.world <= 0:
        return None
    before, last = _one_way(ctx.exits, generations[-2]), _one_way(ctx.exits, generations[-1])
    if before is None or last is None or before.error != last.error:
        return None
    if last.ranks >= ctx.world:
        return Fail(f"deterministic error: every rank failed the same way before its first step, in generation "
                    f"{before.generation} and again in generation {last.generation}: {last.error}; fix the "
                    f"script, its flags or its data, then submit it again")
    waited = ctx.now_ns - last.first_ns
    if waited < window_ns:
        return Settle(f"{last.ranks} of {ctx.world} rank(s) of generation {last.generation} failed as generation "
                      f"{before.generation} did ({last.error}): wait for the others' exits before restarting",
                      window_ns - waited)
    return None


def _one_way(exits: tuple[FailedExits, ...], generation: int) -> FailedExits | None:
    """The one way every failure of `generation` took, if there is one, the script said it, and it came before the
    job's first step."""
    ways = [e for e in exits if e.generation == generation]
    if len(ways) != 1 or not ways[0].said or not ways[0].early:
        return None
    return ways[0]


def script_error(ctx: RescheduleContext) -> str | None:
    """The script's own error behind the open incident: the first one a rank said in the last generation that
    failed (a rank that died after it of SIGABRT, a peer's reset connection, says nothing of the cause)."""
    said = [e for e in ctx.exits if e.said]
    if not said:
        return None
    newest = max(e.generation for e in said)
    return min((e for e in said if e.generation == newest), key=lambda e: e.first_ns).error


def quoting_the_script(answer: Reschedule, ctx: RescheduleContext) -> Reschedule:
    """`answer`, a failure of the job naming the script's own error when one is known (a crash loop, a budget used
    up by a script that keeps raising)."""
    if not isinstance(answer, Fail):
        return answer
    error = script_error(ctx)
    if error is None or error in answer.reason:
        return answer
    return Fail(f"{answer.reason}; the script's error: {error}")

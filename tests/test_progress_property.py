"""A job whose ranks all keep reporting progress is never declared hung, whatever its pace, shape or reporting
jitter, including right after it starts (before its step time is known) and after a partial restart whose
untouched ranks keep reporting their own generation."""

from __future__ import annotations

import heapq
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.outputs import Decision
from policies.base import NS
from recovery.testing.scenario import Scenario


@st.composite
def healthy_runs(draw: st.DrawFn) -> dict[str, object]:
    step_s = draw(st.sampled_from([0.05, 0.5, 2.0, 9.0, 45.0, 200.0]))
    return {
        "nodes": draw(st.integers(1, 3)), "rpn": draw(st.integers(1, 4)), "step_s": step_s,
        "heartbeat_s": draw(st.sampled_from([0.5, 1.0, 3.0, 5.0])),
        "jitter": draw(st.floats(0.0, 0.45)), "seed": draw(st.integers(0, 2**16)),
        # Slow steps are few: 40 steps of 200 s under 0.5 s heartbeats would be 16,000 beats a rank, and what a slow
        # step tests (many beats and watchdog ticks between two steps) shows in a handful.
        "steps": draw(st.integers(3, 40 if step_s <= 2.0 else 12 if step_s <= 45.0 else 5)),
        "crash": draw(st.booleans()),
        "watchdog_s": draw(st.sampled_from([0.5, 2.0, 7.0])),
    }


def play(s: Scenario, job: str, run: dict[str, object], start_step: int, steps: int, rng: random.Random) -> None:
    """Every rank heartbeats every `heartbeat_s` and reports each step when it completes (a little early or late),
    in its own process's generation, in time order across ranks."""
    state = s.engine.jobs[job]
    world = state.world
    step_ns = int(float(run["step_s"]) * NS)  # type: ignore[arg-type]
    beat_ns = int(float(run["heartbeat_s"]) * NS)  # type: ignore[arg-type]
    jitter = float(run["jitter"])  # type: ignore[arg-type]
    t0 = s.now
    events: list[tuple[int, int, int, int | None]] = []  # (time, order, rank, step or None for a heartbeat)
    order = 0
    end = t0 + steps * step_ns
    for rank in range(world):
        for k in range(1, steps + 1):
            due = t0 + k * step_ns + int(rng.uniform(-jitter, jitter) * step_ns)
            events.append((max(due, t0 + 1), order, rank, start_step + k))
            order += 1
        beat = t0 + int(rng.uniform(0, 1) * beat_ns)
        while beat < end:
            events.append((beat, order, rank, None))
            order += 1
            beat += beat_ns
    heapq.heapify(events)
    reported = [start_step] * world
    while events:
        when, _, rank, step = heapq.heappop(events)
        s.run_until(when)
        if step is not None:
            step = max(step, reported[rank])  # a rank's own reports are in order
            reported[rank] = step
        s.job_event(job, "process.heartbeat", rank=rank, step=step if step is not None else reported[rank],
                    attempt=state.rank_gen[rank])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(healthy_runs())
def test_ranks_that_keep_reporting_progress_are_never_declared_hung(run: dict[str, object]) -> None:
    rng = random.Random(int(run["seed"]))  # type: ignore[arg-type]
    # A plain scenario: the check that a refused input changes nothing (`CheckedScenario`) costs a copy of the state
    # per input, and here no input may be refused at all (the last assertion).
    s = Scenario()
    nodes = [f"n{i}" for i in range(int(run["nodes"]))]  # type: ignore[arg-type]
    rpn = int(run["rpn"])  # type: ignore[arg-type]
    s.submit("j", nodes, ranks_per_node=rpn, dp=len(nodes) * rpn,
             watchdog_interval_s=float(run["watchdog_s"]))  # type: ignore[arg-type]
    steps = int(run["steps"])  # type: ignore[arg-type]
    play(s, "j", run, 0, steps, rng)
    faults = [d for d in s.decisions if d.kind == "fault.confirmed"]
    assert not faults, faults[0].reason
    if run["crash"] and len(nodes) * rpn > 1:
        # One rank crashes and is restarted in place; the others, untouched, keep their generation 0.
        s.checkpoint("j", steps, "storage", "storage")
        s.job_event("j", "process.exited", rank=0, exit_code=1)
        s.ack_all()
        play(s, "j", run, steps, steps, rng)
        confirmed: list[Decision] = [d for d in s.decisions if d.kind == "fault.confirmed"]
        assert len(confirmed) == 1, confirmed[-1].reason
        assert s.state("j") == "running"
    assert not s.rejections, s.rejections[0]

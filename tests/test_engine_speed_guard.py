"""A guard on the engine's speed: a change that slows `Engine.apply` by more than 10% is seen before it lands.

Speed is measured in benchmarks (`python tools/bench.py engine`), not in timed tests, and this is no timed test: it
never compares a time with a number. It measures the engine against the bench's own baseline (a plain loop doing
two dict updates per record) in the same process, over the same records, alternating the two in small chunks by
this process's CPU time, and compares that RATIO with a committed reference, `tools/engine_speed.json`: a loaded
host slows both alike, or nearly. The bench's workload, small (about a second a try), in a few passes: for each
chunk the least time of the engine and of the baseline over the passes (a busy neighbour only ever adds time),
summed. A try more than 10% below the reference is tried again, and only a change that fails every try fails the
test: a true regression of 10% fails every try, a noisy neighbour does not. (A host loaded for minutes still moves
the ratio by up to 15%, the engine's larger working set suffering more: the reference is measured under the test
suite's own load, two workers, so that this guard catches a gross slowdown on any host rather than a 5% one.)

To move the reference deliberately (the engine became faster, or a change is worth its cost), measure it on an
idle-ish host and write it, with the commit that explains why:

    python -m tests.test_engine_speed_guard            # prints the median ratio of several tries
    python -m tests.test_engine_speed_guard --write    # ... and writes it to tools/engine_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:  # the bench's harness, beside tools/bench.py, as the benches import it
    sys.path.append(str(TOOLS))

from bench_harness_workload import Workload, apply_all, chunk_times, generate  # noqa: E402

from recovery.core.engine import Engine  # noqa: E402

REFERENCE = TOOLS / "engine_speed.json"
TOLERANCE = 0.10
"""how far below the reference a try may fall"""
TRIES = 3
PASSES = 5
"""passes over the steady records per try: their median ratio is the try's"""
CHUNK = 500
"""records per turn of the alternation: small, so that the engine and the baseline see the same load"""


def reference() -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads(REFERENCE.read_bytes())
    return loaded


def workload(ref: dict[str, Any]) -> Workload:
    return generate(ref["jobs"], ref["rounds"], ref["seed"])


def ratio(work: Workload, passes: int = PASSES) -> float:
    """The engine's rate over the dict baseline's on the steady records, over `passes` passes (each a fresh engine
    after the setup records, so that chunk i is the same work in every pass): each chunk's least time of the engine
    and of the baseline (a neighbour only ever adds time), summed."""
    setup, steady = work.setup, work.steady
    best: list[tuple[float, float]] | None = None
    for _ in range(passes):
        engine = Engine()
        apply_all(engine, setup)
        times, _ = chunk_times(engine, steady, CHUNK)
        if best is not None:
            times = [(min(b, tb), min(e, te)) for (b, e), (tb, te) in zip(best, times, strict=True)]
        best = times
    assert best is not None
    return sum(b for b, _ in best) / sum(e for _, e in best)


def test_the_engine_keeps_its_speed_against_the_dict_baseline() -> None:
    ref = reference()
    floor = ref["ratio_to_baseline"] * (1 - TOLERANCE)
    work = workload(ref)
    tries = []
    for _ in range(TRIES):
        tries.append(ratio(work))
        if tries[-1] >= floor:
            return
    raise AssertionError(
        f"the engine ran at {', '.join(f'{r:.3f}' for r in tries)}x the dict baseline in {TRIES} tries, more than "
        f"{TOLERANCE:.0%} below the reference {ref['ratio_to_baseline']}x ({REFERENCE.name}): a change slowed "
        f"Engine.apply (profile it: python tools/bench.py engine --profile), or, if the cost is deliberate, measure "
        f"and write a new reference (python -m tests.test_engine_speed_guard --write) and say why in the commit")


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the guard's ratio; --write makes it the reference.")
    parser.add_argument("--tries", type=int, default=7)
    parser.add_argument("--write", action="store_true", help=f"write the median to {REFERENCE}")
    args = parser.parse_args()
    ref = reference()
    work = workload(ref)
    tries = [ratio(work) for _ in range(args.tries)]
    median = round(statistics.median(tries), 3)
    print(f"tries: {[round(r, 3) for r in tries]}; median {median}x (reference {ref['ratio_to_baseline']}x)")
    if args.write:
        REFERENCE.write_bytes(orjson.dumps({**ref, "ratio_to_baseline": median}, option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":
    main()

"""What loss checks cost the engine: the same progress reports (a node's 8 ranks each) applied with and without a
loss per rank, on the engine alone (decoding the record included, publishing excluded).

    python tools/bench_loss.py                  # 3000 reports of 8 ranks, 3 rounds, medians
    python tools/bench_loss.py --reports 500 --rounds 1

The engine judges one loss per report (its worst) and keeps one (the median of its finite ones): the cost grows
with nodes, not ranks. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from events import subjects
from events.codec import encode_envelope
from events.envelope import RawRecord, make_envelope
from recovery.testing.scenario import Scenario

RANKS_PER_NODE = 8


def per_report_us(reports: int, with_loss: bool) -> float:
    """Microseconds per applied report of a 32-rank job (4 nodes of 8), its steps advancing, all losses ordinary."""
    s = Scenario()
    s.submit("j", [f"n{i}" for i in range(4)], ranks_per_node=RANKS_PER_NODE, dp=4 * RANKS_PER_NODE)
    subject = subjects.job_event("j", "progress.report")
    records = []
    for k in range(1, reports + 1):
        ranks = [{"rank": r, "step": k, "attempt": 0,
                  **({"loss": 1.0 + r / 100, "loss_step": k} if with_loss else {})} for r in range(RANKS_PER_NODE)]
        envelope = make_envelope("progress.report", {"ranks": ranks}, id=f"r{k}", job="j", source="bench")
        records.append(RawRecord(seq=s.engine.last_seq + k, ts=s.now + k * 10**9, subject=subject,
                                 data=encode_envelope(envelope)))
    engine = s.engine
    started = time.perf_counter()
    for record in records:
        engine.apply(record)
    return (time.perf_counter() - started) / reports * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reports", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    without, with_ = [], []
    for _ in range(args.rounds):  # interleaved: a busy host slows both alike
        without.append(per_report_us(args.reports, False))
        with_.append(per_report_us(args.reports, True))
    a, b = statistics.median(without), statistics.median(with_)
    print(json.dumps({"bench": "loss", "ranks_per_report": RANKS_PER_NODE, "reports": args.reports,
                      "without_loss_us": round(a, 1), "with_loss_us": round(b, 1), "added_us": round(b - a, 1)}))


if __name__ == "__main__":
    main()

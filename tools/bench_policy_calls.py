"""The cost of running a third-party policy where its host can abandon it: one call through its worker process
(`recovery.plugins.PolicyWorkers`) against the same call in-process, per family's typical argument.

    python tools/bench.py policy-calls [--repeat 5] [--calls 2000]

The plugin is the built-in's logic under another module (`ThirdParty*` below: the engine sends only third-party
policies to workers), so both sides compute the same answer; the difference is the pickling, the two pipe transfers
and the worker's wake-up. Rates are medians of `--repeat` runs, each run interleaving the two sides over the same
arguments; `ratio` is the median of the per-run ratios (worker time per call / in-process time per call).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from policies.detection import DefaultDetection
from policies.rescheduling import LadderRescheduling
from recovery.plugins import PolicyWorkers
from recovery.testing.policy_contexts import make_reschedule_context, make_signal, make_watchdog_view


class ThirdPartyLadder(LadderRescheduling):
    """The ladder, as a plugin would ship it."""


class ThirdPartyDetection(DefaultDetection):
    """The default detection, as a plugin would ship it."""


def _cases() -> list[tuple[str, Any, str, Any]]:
    big = [f"n{i}" for i in range(16_384)]  # 131,072 ranks on 8-GPU nodes: the watchdog's largest view
    return [
        ("rescheduling.decide", ThirdPartyLadder(), "decide", make_reschedule_context()),
        ("detection.classify", ThirdPartyDetection(), "classify", make_signal("process.exited")),
        ("detection.check_64", ThirdPartyDetection(), "check", make_watchdog_view()),
        ("detection.check_131072", ThirdPartyDetection(), "check", make_watchdog_view(nodes=big, ranks_per_node=8)),
    ]


def _per_call(call: Callable[[], Any], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def run(args: argparse.Namespace, emit: Callable[[str, str, float, str], None]) -> None:
    workers = PolicyWorkers(budget_s=60.0)
    try:
        for name, policy, method, argument in _cases():
            calls = max(args.calls // (200 if name.endswith("131072") else 1), 5)
            direct = getattr(policy, method)
            workers.call(policy, method, argument)  # the worker started and warm before timing
            inline_s, worker_s, ratios = [], [], []
            for _ in range(args.repeat):
                a = _per_call(lambda d=direct, x=argument: d(x), calls)
                b = _per_call(lambda p=policy, m=method, x=argument: workers.call(p, m, x), calls)
                inline_s.append(a)
                worker_s.append(b)
                ratios.append(b / a)
            emit(f"policy-calls.{name}", "in_process_us", round(statistics.median(inline_s) * 1e6, 2), "us")
            emit(f"policy-calls.{name}", "worker_us", round(statistics.median(worker_s) * 1e6, 2), "us")
            emit(f"policy-calls.{name}", "ratio", round(statistics.median(ratios), 2), "x")
    finally:
        workers.close()

"""`python -m recovery.sim`: run one simulation, or import a Titan failure trace.

    python -m recovery.sim run --gpus 1024 --days 54 --profile torchelastic-like --seed 3 --log run.jsonl
    python -m recovery.sim run --gpus 16384 --json > result.json
    python -m recovery.sim titan gc_full.csv --gpus 16384 --start "2015-01-01 00:00:00" --days 54 --out trace.csv
    python -m recovery.sim run --trace trace.csv --gpus 16384 --days 54
    python -m recovery.sim run --gpus 1024 --policy rescheduling=my-ladder:max_migrations=2   # a plugin, same faults

`recovery-replay verify run.jsonl` and `recovery-replay timeline run.jsonl --job llm` read the log of a run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson

from events.values import PolicyRef, PolicySelection
from policies.registry import load_set
from recovery.sim.config import PROFILES, Cluster, Costs, Profile, SimConfig, Training
from recovery.sim.faults import write_trace
from recovery.sim.sim import simulate
from recovery.sim.titan import import_titan, summarize

FAMILIES = ("detection", "rescheduling", "checkpoint")
MAX_GPUS = 131_072
"""the largest job the engine is measured at (tests/test_engine_at_scale.py); beyond it memory is not bounded"""
MAX_DAYS = 3_650.0


def _number(kind: type[int] | type[float], low: float, high: float, what: str) -> Any:
    """An argparse type: a number of `kind` in [low, high], or an error that says which range (argparse names the
    flag in its message)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if not low <= value <= high or value != value:  # NaN compares false everywhere
            raise argparse.ArgumentTypeError(f"{text} is outside {what}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording, when it uses it
    return parse


def _positive(kind: type[int] | type[float], high: float) -> Any:
    return _number(kind, 1 if kind is int else 1e-9, high, f"1 .. {high:,g}" if kind is int else f"(0, {high:,g}]")


def parse_policy(text: str) -> tuple[str, PolicyRef]:
    """`FAMILY=NAME[:key=value,...]`: a policy of one family, by its entry-point name, with parameters. A value is
    read as JSON when it is JSON (`3`, `2.5`, `true`, `["storage"]`), as a string otherwise."""
    family, sep, rest = text.partition("=")
    if not sep or family not in FAMILIES or not rest:
        raise ValueError(f"--policy {text!r}: expected FAMILY=NAME[:key=value,...] with FAMILY one of "
                         f"{', '.join(FAMILIES)}")
    name, _, params_text = rest.partition(":")
    params: dict[str, Any] = {}
    for item in _split_params(params_text):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy {text!r}: parameter {item!r} is not key=value")
        try:
            params[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            params[key] = value
    return family, PolicyRef(name=name, params=params)


def _split_params(text: str) -> list[str]:
    """Split on the commas that are not inside a JSON list or object."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if text[start:]:
        items.append(text[start:])
    return items


def chosen_profile(base: str, overrides: Sequence[str]) -> Profile:
    """The profile `base` with the families named in `overrides` replaced; each policy loaded once here, so that a
    missing plugin or a bad parameter is an error before the simulation starts."""
    chosen = PROFILES[base]
    if not overrides:
        return chosen
    refs = {family: getattr(chosen.selection, family) for family in FAMILIES}
    for text in overrides:
        family, ref = parse_policy(text)
        refs[family] = ref
    selection = PolicySelection(**refs)
    load_set(selection)  # raises PolicyError naming the policy, its family and what is wrong
    name = "+".join([base, *(f"{f}={r.name}" for f, r in refs.items() if r != getattr(chosen.selection, f))])
    return replace(chosen, name=name, selection=selection)


def _config(args: argparse.Namespace) -> SimConfig:
    if args.gpus % (args.tp * args.pp) or args.gpus % Cluster.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of {Cluster.gpus_per_node}-GPU nodes and of "
                         f"--tp x --pp = {args.tp * args.pp}-GPU model replicas")
    cluster = Cluster(gpus=args.gpus, tp=args.tp, pp=args.pp, spare_nodes=args.spares)
    costs = replace(Costs(), fail_probability=args.fail_p, timeout_probability=args.timeout_p)
    training = replace(Training(), storage_every_s=args.storage_every_s, memory_every_steps=args.memory_every)
    return SimConfig(cluster=cluster, training=training, costs=costs, profile=chosen_profile(args.profile, args.policy),
                     days=args.days, seed=args.seed, mix_path=args.mix, trace_path=args.trace,
                     rate_per_gpu_hour=args.rate, watch_s=args.watch_s)


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args)  # a bad --policy raises PolicyError (a ValueError): main reports it and exits 2
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)  # stdout holds the result (--json): progress never goes there

    result = simulate(config, log_path=args.log, progress=progress if args.progress_s > 0 else None,
                      progress_every_s=args.progress_s)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
                                + b"\n")
    else:
        result.render()
    return 0


def cmd_titan(args: argparse.Namespace) -> int:
    faults = import_titan(args.csv, gpus=args.gpus, gpus_per_node=args.gpus_per_node, start=args.start,
                          days=args.days, fold=args.fold)
    count = write_trace(args.out, faults)
    print(f"{count} faults written to {args.out}: {summarize(faults)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recovery.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one job and print where its time went",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("--gpus", type=_positive(int, MAX_GPUS), default=16_384,
                     help=f"the job's GPUs, one rank each: whole 8-GPU nodes and tp*pp replicas, at most {MAX_GPUS:,}")
    run.add_argument("--tp", type=_positive(int, 1024), default=8, help="tensor-parallel degree")
    run.add_argument("--pp", type=_positive(int, 1024), default=16, help="pipeline-parallel degree")
    run.add_argument("--spares", type=_number(int, 0, MAX_GPUS, f"0 .. {MAX_GPUS:,}"), default=None,
                     help="spare nodes (%(default)s: 1/64 of the job's, at least 4)")
    run.add_argument("--days", type=_positive(float, MAX_DAYS), default=54.0, help="simulated time")
    run.add_argument("--seed", type=_number(int, 0, 2**63 - 1, "0 .. 2**63-1"), default=0)
    run.add_argument("--profile", choices=sorted(PROFILES), default="default",
                     help="the policies to run (and whether the job writes in-memory checkpoints)")
    run.add_argument("--policy", action="append", default=[], metavar="FAMILY=NAME[:key=value,...]",
                     help="replace one family of the profile by any installed policy, plugins included, for example "
                          "rescheduling=ladder:settle_s=5 or checkpoint=newest-complete:dying_wait_s=10 (repeatable)")
    run.add_argument("--mix", help="fault mix CSV (default: the Llama 3 405B mix)")
    run.add_argument("--rate", type=_positive(float, 1.0), help="faults per GPU-hour (default: the mix's own)")
    run.add_argument("--trace", help="fault trace CSV instead of the mix (see `titan`)")
    run.add_argument("--watch-s", type=_positive(float, MAX_DAYS * 86_400),
                     help="the job's watchdog period, each tick after every rank's report of its step and compute "
                          "time: what a mix with stragglers needs detected (default: none)")
    run.add_argument("--storage-every-s", type=_positive(float, MAX_DAYS * 86_400),
                     default=Training().storage_every_s, help="seconds between checkpoints to storage")
    run.add_argument("--memory-every", type=_positive(int, 10**9), default=Training().memory_every_steps,
                     help="steps between in-memory checkpoints")
    probability = _number(float, 0.0, 1.0, "0 .. 1")
    run.add_argument("--fail-p", type=probability, default=Costs().fail_probability,
                     help="executor failure probability")
    run.add_argument("--timeout-p", type=probability, default=Costs().timeout_probability,
                     help="probability that an executor never answers")
    run.add_argument("--log", help="write the run's log here (JSONL replay format)")
    run.add_argument("--json", action="store_true", help="the result as JSON")
    run.add_argument("--progress-s", type=_number(float, 0, 86_400, "0 .. 86400"), default=10.0,
                     help="a line on stderr every this many seconds of the run (simulated day, ETTR so far, "
                          "faults, restarts); 0: none")
    run.set_defaults(func=cmd_run)
    titan = sub.add_parser("titan", help="convert Titan's gc_full.csv into a fault trace")
    titan.add_argument("csv")
    titan.add_argument("--out", required=True)
    titan.add_argument("--gpus", type=int, default=16_384)
    titan.add_argument("--gpus-per-node", type=int, default=8)
    titan.add_argument("--start", help="time 0, '%%Y-%%m-%%d %%H:%%M:%%S' (default: the earliest insert)")
    titan.add_argument("--days", type=float)
    titan.add_argument("--fold", action="store_true", help="map every Titan GPU onto the cluster (modulo)")
    titan.set_defaults(func=cmd_titan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"python -m recovery.sim: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

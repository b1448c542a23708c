"""What a policy is handed, made for tests: factories for one context with sensible defaults, and hypothesis
strategies for contexts the engine could hand over (ranks within the job, nodes from its placement, steps and times
that are not negative, catalog shards within the layout).

    signal = make_signal("device.fault", code="79", device=2)        # an XID 79 on device 2 of n0
    view = make_watchdog_view(last_seen={5: NOW - 30 * NS})           # rank 5 silent for 30 s
    ctx = make_reschedule_context(previous=[(Granularity.IN_PLACE, "failed", 0)])
    plan = make_checkpoint_context(alive=[True, False, True, True])

Every factory takes any field of the context as a keyword (and a signal's payload fields as keywords too); what is
left out is derived the way the engine derives it. Needs hypothesis (the `testing` extra).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, get_args

from hypothesis import strategies as st

from events import kinds
from events.values import STORAGE_HOLDER, FaultClass, Frozen, Granularity, Layout, Tier
from policies import (
    NS,
    AttemptOutcome,
    AttemptSummary,
    Catalog,
    CheckpointContext,
    LossSample,
    PastIncident,
    RankColumns,
    RescheduleContext,
    Scope,
    Signal,
    WatchdogView,
    codes,
)

NOW = 1_800_000_000 * NS
"""the log time contexts are made at unless told otherwise (early 2027, nanoseconds since the epoch)"""
NODES = ("n0", "n1")
RANKS_PER_NODE = 4

JOB_SIGNALS = ("process.exited", "process.hang", "network.collective_timeout")
"""job events the engine hands to `classify` (the others it handles itself)"""
NODE_SIGNALS = tuple(t for t in kinds.NODE_EVENTS if t not in ("node.heartbeat", "node.silent", "node.heard",
                                                                 "node.unreachable"))
"""node events: every one reaches the detection policy of the job on the node, but the agent's heartbeat and the
daemon's word on it, which the engine keeps for the watchdog (`WatchdogView.agents_heard`, `.unreachable`)"""
LOSS_SIGNAL = "progress.loss"
"""a loss a rank reported with its step (data a `LossSample`, the job's recent losses in `Signal.losses`)"""
SIGNAL_TYPES = JOB_SIGNALS + NODE_SIGNALS + (LOSS_SIGNAL,)

PAYLOADS: dict[str, dict[str, Any]] = {
    "process.exited": {"rank": 0, "exit_code": 139},
    "process.hang": {"rank": 0, "seconds_without_progress": 60.0},
    "network.collective_timeout": {"group": "dp0", "members": [0, 1], "reporters": [1], "timeout_s": 600.0},
    "device.fault": {"device": 0, "vendor": "nvidia", "code": "79"},
    "device.recovered": {"device": 0},
    "network.link_down": {"link": "mlx5_0"},
    "network.link_up": {"link": "mlx5_0"},
    "network.nic_errors": {"link": "mlx5_0", "errors": 500},
    "node.not_ready": {"reason": "kubelet stopped posting status"},
    "node.ready": {},
    "node.drained": {"reason": "maintenance"},
    "node.joined": {"spare": False, "devices": 8},
    "node.checked": {"when": "fault", "results": [{"check": "gpu-compute", "ok": False, "saw": "device 3: result off",
                                                   "took_s": 4.2}]},
}
"""the payload of each signal type when a test names no field of it"""

_SIGNAL_FIELDS = frozenset({"ts", "node", "ranks", "device_fault_times", "node_fault_times", "step_time_ns",
                            "world", "node_ranks", "losses"})
_MODELS: dict[str, type[Frozen]] = {**kinds.JOB_EVENTS, **kinds.NODE_EVENTS}


# --- factories ------------------------------------------------------------------------------------------------------
def make_signal(type_: str = "process.exited", /, *, nodes: Sequence[str] = NODES,
                ranks_per_node: int = RANKS_PER_NODE, data: Frozen | Mapping[str, Any] | None = None,
                **fields: Any) -> Signal:
    """A signal of `type_` from a job placed on `nodes`, `ranks_per_node` each. Keywords naming a `Signal` field
    (`ts`, `node`, `ranks`, `step_time_ns`, ...) set it; the others are payload fields, over `PAYLOADS[type_]`
    (or give the payload whole as `data`). A node event comes from the first node unless `node` says otherwise;
    `ranks` and `node_ranks` are the job's ranks there (on the device, for a device event), and a device fault's
    history holds this fault alone, as the engine derives them."""
    if type_ == LOSS_SIGNAL:
        return _loss_signal(nodes, ranks_per_node, data, fields)
    if type_ not in _MODELS:
        raise ValueError(f"{type_!r} is not an event type (one of {', '.join(SIGNAL_TYPES)})")
    own = {key: value for key, value in fields.items() if key in _SIGNAL_FIELDS}
    payload = {key: value for key, value in fields.items() if key not in _SIGNAL_FIELDS}
    if data is None:
        data = _MODELS[type_].model_validate({**PAYLOADS.get(type_, {}), **payload})
    elif payload:
        raise TypeError(f"payload fields {sorted(payload)} given beside `data`")
    elif not isinstance(data, Frozen):
        data = _MODELS[type_].model_validate(dict(data))
    ts = own.get("ts", NOW)
    world = own.get("world", len(nodes) * ranks_per_node)
    if type_ in kinds.NODE_EVENTS:
        node = own.get("node", nodes[0] if nodes else None)
        on_node: tuple[int, ...] = ()
        if node in nodes:
            start = list(nodes).index(node) * ranks_per_node
            on_node = tuple(range(start, start + ranks_per_node))
        device = getattr(data, "device", None)
        ranks = on_node if device is None else (on_node[device],) if on_node and device < ranks_per_node else ()
        faults = (ts,) if type_ == "device.fault" else ()
        return Signal(type_, data, ts, node, own.get("ranks", ranks), own.get("device_fault_times", faults),
                      own.get("node_fault_times", faults), own.get("step_time_ns"), world,
                      own.get("node_ranks", on_node))
    rank = getattr(data, "rank", None)
    return Signal(type_, data, ts, own.get("node"), own.get("ranks", () if rank is None else (rank,)),
                  own.get("device_fault_times", ()), own.get("node_fault_times", ()), own.get("step_time_ns"), world,
                  own.get("node_ranks", ()))


def _loss_signal(nodes: Sequence[str], ranks_per_node: int, data: Any, fields: Mapping[str, Any]) -> Signal:
    """A `progress.loss` signal: `rank`, `step` and `loss` (default rank 0 at step 10, a NaN) or a `LossSample` as
    `data`; `losses` the job's recent ones (default: 16 around 1.0)."""
    own = {key: value for key, value in fields.items() if key in _SIGNAL_FIELDS}
    payload = {key: value for key, value in fields.items() if key not in _SIGNAL_FIELDS}
    sample = data if isinstance(data, LossSample) else LossSample(
        int(payload.get("rank", 0)), int(payload.get("step", 10)), float(payload.get("loss", math.nan)))
    losses = tuple(own.get("losses", tuple(1.0 + (i % 4) / 10 for i in range(16))))
    return Signal(LOSS_SIGNAL, sample, own.get("ts", NOW), None, own.get("ranks", (sample.rank,)), (), (),
                  own.get("step_time_ns"), own.get("world", len(nodes) * ranks_per_node), (), losses=losses)


def _per_rank(value: int | Sequence[int] | Mapping[int, int], world: int, default: int) -> list[int]:
    """One value per rank from a scalar, a sequence, or {rank: value} over `default`."""
    if isinstance(value, Mapping):
        out = [default] * world
        for rank, item in value.items():
            out[rank] = item
        return out
    if isinstance(value, int):
        return [value] * world
    if len(value) != world:
        raise ValueError(f"{len(value)} values for {world} ranks")
    return list(value)


def make_watchdog_view(*, now: int = NOW, nodes: Sequence[str] = NODES, ranks_per_node: int = RANKS_PER_NODE,
                       step_time_ns: int | None = NS, last_seen: int | Sequence[int] | Mapping[int, int] | None = None,
                       last_progress: int | Sequence[int] | Mapping[int, int] | None = None,
                       steps: int | Sequence[int] | Mapping[int, int] = 100,
                       agents_heard: Sequence[int | None] = (), sdk: bool = True,
                       compute_steps: int | Sequence[int] | Mapping[int, int] = 0,
                       compute_ns: int | Sequence[int] | Mapping[int, int] = 0,
                       unreachable: Iterable[int] = (), unspoken: Iterable[int] = ()) -> WatchdogView:
    """What the watchdog sees of a job on `nodes` at `now`. Per-rank values are one number for every rank, one per
    rank, or {rank: value} over the default: every rank seen and progressing at `now`, at step 100, with no compute
    time reported (`compute_steps` steps measured in all `compute_ns`). `agents_heard` is per node the last heartbeat
    of its agent (None: it sends none; empty: unknown); `unreachable`, the indices of the nodes the daemon found
    unreachable (`node.unreachable`); `unspoken`, the ranks whose process has not spoken yet (still importing)."""
    world = len(nodes) * ranks_per_node
    seen = _per_rank(now if last_seen is None else last_seen, world, now)
    progress = _per_rank(now if last_progress is None else last_progress, world, now)
    at = _per_rank(steps, world, 100)
    measured, spent = _per_rank(compute_steps, world, 0), _per_rank(compute_ns, world, 0)
    quiet = set(unspoken)
    spoke = bytes(0 if r in quiet else 1 for r in range(world)) if quiet else None
    return WatchdogView(now, step_time_ns, (), tuple(nodes), ranks_per_node, tuple(agents_heard), sdk,
                        columns=RankColumns(tuple(seen), tuple(progress), tuple(at), tuple(measured), tuple(spent),
                                            spoke),
                        unreachable=frozenset(unreachable))


def incident_usage(fault_class: FaultClass, previous: Iterable[AttemptSummary]) -> dict[str, int]:
    """What the engine counts as used in an incident with these attempts: every attempt that was not superseded, by
    '<fault class>/<granularity>' and by granularity."""
    used: dict[str, int] = {}
    for attempt in previous:
        if attempt.outcome != AttemptOutcome.SUPERSEDED:
            for key in (f"{fault_class.value}/{attempt.granularity.value}", attempt.granularity.value):
                used[key] = used.get(key, 0) + 1
    return used


_RESTARTS = frozenset({Granularity.IN_PLACE, Granularity.MIGRATE, Granularity.RESTART_JOB, Granularity.SCALE_IN,
                       Granularity.SCALE_OUT})


def make_reschedule_context(*, previous: Iterable[AttemptSummary | tuple[Granularity, str, int]] = (),
                            **fields: Any) -> RescheduleContext:
    """A process fault on a job of dp=2 whose ranks all live, with one spare and nothing tried yet; keywords set any
    field. `previous` takes `AttemptSummary`s or (granularity, outcome, rung); `used` and `restarts_used` follow
    from it unless given, and `needs_move` follows from `nodes_to_replace`."""
    attempts = tuple(a if isinstance(a, AttemptSummary) else AttemptSummary(a[0], AttemptOutcome(a[1]), a[2])
                     for a in previous)
    fault_class = fields.get("fault_class", FaultClass.PROCESS)
    replace_count = fields.get("nodes_to_replace", 0)
    ctx = RescheduleContext(
        fault_class=fault_class, scope="job", needs_move=replace_count > 0, any_lost=True, previous=attempts,
        used=incident_usage(fault_class, attempts),
        restarts_used=sum(1 for a in attempts if a.outcome != AttemptOutcome.SUPERSEDED and a.granularity in _RESTARTS),
        max_restarts=None, nodes_to_replace=replace_count, nodes_to_migrate=max(1, replace_count),
        spares_available=1, dp=2, scale_in_dp=None)
    return replace(ctx, **fields)


def freeze_catalog(catalog: Mapping[int, Mapping[Tier | str, Mapping[int, Iterable[str]]]]) -> Catalog:
    """A catalog as the engine hands it over: steps newest first, tiers and shards sorted, holders sorted tuples."""
    return {step: {Tier(tier): {shard: tuple(sorted(holders)) for shard, holders in sorted(shards.items())}
                   for tier, shards in sorted(by_tier.items())}
            for step, by_tier in sorted(catalog.items(), reverse=True)}


def make_checkpoint_context(*, layout: Layout | None = None, ranks_per_node: int = 2,
                            nodes: Sequence[str] | None = None,
                            catalog: Mapping[int, Mapping[Tier | str, Mapping[int, Iterable[str]]]] | None = None,
                            alive: bool | Sequence[bool] = True, steps: int | Sequence[int] = 12,
                            **fields: Any) -> CheckpointContext:
    """A job of dp=2 tp=2 (four ranks, two shards) on two nodes, every rank alive at step 12, with a complete
    checkpoint of step 10 on storage; keywords set any field. The placement follows from `nodes` and
    `ranks_per_node` unless given; `alive` and `steps` take one value for every rank or one per rank."""
    layout = layout or Layout(dp=2, tp=2)
    world = layout.world
    if world % ranks_per_node:
        raise ValueError(f"{world} ranks do not fill nodes of {ranks_per_node}")
    names = list(nodes) if nodes is not None else [f"n{i}" for i in range(world // ranks_per_node)]
    if len(names) * ranks_per_node != world:
        raise ValueError(f"{len(names)} nodes of {ranks_per_node} ranks for {world} ranks")
    if catalog is None:
        catalog = {10: {Tier.STORAGE: {shard: (STORAGE_HOLDER,) for shard in range(layout.shards)}}}
    lives = (alive,) * world if isinstance(alive, bool) else tuple(alive)
    at = (steps,) * world if isinstance(steps, int) else tuple(steps)
    if len(lives) != world or len(at) != world:
        raise ValueError(f"alive and steps need {world} values, one per rank")
    ctx = CheckpointContext(layout=layout, catalog=freeze_catalog(catalog),
                            placement=tuple(names[r // ranks_per_node] for r in range(world)),
                            unreachable=frozenset(), alive=lives, steps=at, dying_allowed=True)
    return replace(ctx, **fields)


# --- strategies -----------------------------------------------------------------------------------------------------
_TIMES = st.integers(min_value=NOW - 86_400 * NS, max_value=NOW)
_STEP_TIMES = st.none() | st.integers(min_value=NS // 100, max_value=600 * NS)
_AGO = st.integers(min_value=0, max_value=2 * 86_400 * NS)
_EXIT_CODES = st.none() | st.sampled_from([0, 1, 2, 6, 9, 11, 15, 126, 127, 130, 134, 137, 139, 143, -6, -9, -11, -15])
_SIGNAL_NUMBERS = st.none() | st.sampled_from([1, 2, 6, 9, 11, 15, 64])
_XIDS = st.sampled_from(sorted(codes.NVIDIA_XID)).map(str) | st.integers(min_value=0, max_value=200).map(str)
_ASCEND = (st.sampled_from(sorted(codes.ASCEND_CODES)).map(lambda c: f"0x{c:08X}")
           | st.sampled_from(sorted(codes.ASCEND_LEVELS)) | st.integers(0, 2**32 - 1).map(lambda c: f"{c:x}"))
_LINKS = st.sampled_from(["mlx5_0", "mlx5_1", "hccs3", "eth0"])
_NODES = ("node-0", "node-1", "node-2")
"""the nodes past incidents struck: few, so that a node struck twice comes often"""


@st.composite
def placements(draw: st.DrawFn, max_nodes: int = 6, max_ranks_per_node: int = 8) -> tuple[tuple[str, ...], int]:
    """A job's placement: distinct node names, and ranks per node."""
    count = draw(st.integers(min_value=1, max_value=max_nodes))
    return tuple(f"n{i}" for i in range(count)), draw(st.integers(min_value=1, max_value=max_ranks_per_node))


@st.composite
def _payload(draw: st.DrawFn, type_: str, world: int, ranks_per_node: int) -> dict[str, Any]:
    rank = st.integers(min_value=0, max_value=world - 1)
    if type_ == "process.exited":
        return {"rank": draw(rank), "exit_code": draw(_EXIT_CODES), "signal": draw(_SIGNAL_NUMBERS),
                "attempt": draw(st.integers(0, 3))}
    if type_ == "process.hang":
        return {"rank": draw(rank), "seconds_without_progress": draw(st.floats(0, 3600.0))}
    if type_ == "network.collective_timeout":
        members = draw(st.lists(rank, min_size=1, max_size=min(world, 16), unique=True))
        reporters = draw(st.lists(st.sampled_from(members), min_size=1, unique=True))
        return {"group": draw(st.sampled_from(["dp0", "tp1", "pp0", "world"])), "members": sorted(members),
                "reporters": sorted(reporters), "operation": draw(st.sampled_from(["allreduce", "allgather"])),
                "timeout_s": draw(st.sampled_from([0.0, 600.0, 1800.0]))}
    device = st.integers(min_value=0, max_value=ranks_per_node + 1)  # past the job's ranks: a device none uses
    if type_ == "device.fault":
        vendor = draw(st.sampled_from(["nvidia", "ascend", "other"]))
        code = draw(_XIDS if vendor == "nvidia" else _ASCEND if vendor == "ascend" else st.just("ECC"))
        return {"device": draw(device), "vendor": vendor, "code": code, "ecc_sbe": draw(st.integers(0, 10)),
                "ecc_dbe": draw(st.integers(0, 2))}
    if type_ == "device.recovered":
        return {"device": draw(device)}
    if type_ in ("network.link_down", "network.link_up"):
        return {"link": draw(_LINKS)}
    if type_ == "network.nic_errors":
        return {"link": draw(_LINKS), "errors": draw(st.integers(min_value=1, max_value=10**6))}
    if type_ == "node.joined":
        return {"spare": draw(st.booleans()), "devices": ranks_per_node, "checks": draw(st.booleans())}
    if type_ == "node.checked":
        results = [{"check": name, "ok": draw(st.booleans()), "saw": "", "took_s": draw(st.floats(0, 30.0))}
                   for name in draw(st.lists(st.sampled_from(["memory", "disk:/ckpt", "gpu-state", "gpu-compute"]),
                                             min_size=1, unique=True))]
        return {"when": draw(st.sampled_from(["join", "start", "spare", "fault"])), "results": results}
    return dict(PAYLOADS[type_])


@st.composite
def signals(draw: st.DrawFn, types: Sequence[str] = SIGNAL_TYPES) -> Signal:
    """A signal the engine could hand to `classify`: a rank within the job, a node of its placement, the device's and
    node's fault history no later than the signal and holding it; now and then a device fault on a node no job runs
    on (no ranks, a world of 0), which the engine has the built-in detection judge."""
    nodes, rpn = draw(placements())
    type_ = draw(st.sampled_from(list(types)))
    if type_ == LOSS_SIGNAL:
        finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
        loss = draw(finite | st.sampled_from([math.nan, math.inf, -math.inf]))
        sample = LossSample(draw(st.integers(0, len(nodes) * rpn - 1)), draw(st.integers(0, 10**9)), loss)
        return make_signal(type_, nodes=nodes, ranks_per_node=rpn, data=sample, ts=draw(_TIMES),
                           step_time_ns=draw(_STEP_TIMES), losses=tuple(draw(st.lists(finite, max_size=40))))
    data = _MODELS[type_].model_validate(draw(_payload(type_, len(nodes) * rpn, rpn)))
    ts = draw(_TIMES)
    fields: dict[str, Any] = {"ts": ts, "step_time_ns": draw(_STEP_TIMES)}
    if type_ in kinds.NODE_EVENTS:
        fields["node"] = draw(st.sampled_from(nodes))
    if type_ == "device.fault" and draw(st.integers(0, 9)) == 0:
        nodes, fields["node"], fields["step_time_ns"] = (), "idle0", None
    if type_ == "device.fault":
        earlier = draw(st.lists(st.integers(min_value=ts - 86_400 * NS, max_value=ts - 1), max_size=5))
        device_times = (*sorted(earlier), ts)
        others = draw(st.lists(st.integers(min_value=ts - 86_400 * NS, max_value=ts), max_size=5))
        fields["device_fault_times"] = device_times
        fields["node_fault_times"] = tuple(sorted((*device_times, *others)))
    return make_signal(type_, nodes=nodes, ranks_per_node=rpn, data=data, **fields)


@st.composite
def watchdog_views(draw: st.DrawFn) -> WatchdogView:
    """What the watchdog could see: each rank last seen no later than now, last progressing no later than last
    seen, at a step that is not negative; now and then a whole node silent; now and then compute times."""
    nodes, rpn = draw(placements())
    world = len(nodes) * rpn
    now = draw(_TIMES)
    ago = st.integers(min_value=0, max_value=3600 * NS)
    seen = [now - draw(st.integers(0, 2 * NS) | ago) for _ in range(world)]
    if draw(st.booleans()):
        silent = draw(st.integers(0, len(nodes) - 1))
        for rank in range(silent * rpn, (silent + 1) * rpn):
            seen[rank] = now - draw(ago)
    progress = [s - draw(st.integers(0, 2 * NS) | ago) for s in seen]
    base = draw(st.integers(0, 10**6))
    steps = [base + draw(st.integers(-3, 0)) if base >= 3 else base for _ in range(world)]
    # Agents that send heartbeats (heard no later than now), that send none, or a placement whose agents are unknown.
    agents: list[int | None] = [draw(st.none() | st.integers(0, 2 * NS).map(lambda d: now - d) | ago.map(
        lambda d: now - d)) for _ in nodes] if draw(st.booleans()) else []
    # Compute times as the engine tallies them (up to 512 steps), each rank its own mean: some stand out.
    measured = [draw(st.integers(0, 512)) for _ in range(world)] if draw(st.booleans()) else [0] * world
    spent = [n * draw(st.integers(0, 10 * NS)) for n in measured]
    # Now and then a node the daemon found unreachable (nothing listened for its agent).
    unreachable = draw(st.sets(st.integers(0, len(nodes) - 1), max_size=2)) if draw(st.integers(0, 3)) == 0 else ()
    # Now and then ranks whose process has not spoken yet (a job starting, a rank restarted).
    unspoken = draw(st.sets(st.integers(0, world - 1), max_size=world)) if draw(st.integers(0, 3)) == 0 else ()
    return make_watchdog_view(now=now, nodes=nodes, ranks_per_node=rpn, step_time_ns=draw(_STEP_TIMES),
                              last_seen=seen, last_progress=progress, steps=steps, agents_heard=agents,
                              sdk=draw(st.integers(0, 4)) > 0, compute_steps=measured, compute_ns=spent,
                              unreachable=unreachable, unspoken=unspoken)


_LADDER = [Granularity.RETRY, Granularity.IN_PLACE, Granularity.MIGRATE, Granularity.RESTART_JOB,
           Granularity.SCALE_IN, Granularity.DUMP]
_ENDED = [AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT, AttemptOutcome.SUPERSEDED]


@st.composite
def reschedule_contexts(draw: st.DrawFn) -> RescheduleContext:
    """An incident the engine could ask about: the attempts so far and the budgets they used agree, the nodes to
    replace are the ones a move must vacate, a smaller data-parallel size is below the current one, and `widened`
    follows a superseded attempt."""
    fault_class = draw(st.sampled_from(list(FaultClass)))
    sdk = draw(st.integers(0, 4)) > 0
    previous = tuple(AttemptSummary(draw(st.sampled_from(_LADDER)), draw(st.sampled_from(_ENDED)),
                                    draw(st.integers(0, 4)))
                     for _ in range(draw(st.integers(0, 5))))
    used = incident_usage(fault_class, previous)
    restarts = sum(1 for a in previous if a.outcome != AttemptOutcome.SUPERSEDED and a.granularity in _RESTARTS)
    restarts_used = restarts + draw(st.integers(0, 5))  # the budget covers the job's life: earlier incidents too
    to_replace = draw(st.integers(0, 4))
    dp = draw(st.integers(1, 64))
    now = draw(_TIMES)
    fault_step = draw(st.integers(0, 10**6))
    recent: list[PastIncident] = []
    closed = now
    for _ in range(draw(st.integers(0, 8))):  # closed incidents, newest drawn first, each before the next
        opened = closed - draw(st.integers(1, 3600 * NS))
        step = max(0, fault_step - draw(st.integers(0, 20)))
        recent.insert(0, PastIncident(draw(st.sampled_from(list(FaultClass))), step,
                                      draw(st.none() | st.integers(0, step)), opened, closed,
                                      draw(st.sampled_from(["recovered", "failed"])), (0,),
                                      tuple(sorted(draw(st.sets(st.sampled_from(_NODES), max_size=2))))))
        closed = opened - draw(st.integers(1, 3600 * NS))
    return RescheduleContext(
        fault_class=fault_class, scope=draw(st.sampled_from(get_args(Scope))), needs_move=to_replace > 0,
        any_lost=draw(st.booleans()), previous=previous, used=used, restarts_used=restarts_used,
        max_restarts=draw(st.none() | st.integers(0, 20)), nodes_to_replace=to_replace,
        nodes_to_migrate=to_replace if to_replace else draw(st.integers(0, 4)),
        spares_available=draw(st.integers(0, 8)), dp=dp,
        scale_in_dp=draw(st.none() | st.integers(1, dp - 1)) if dp > 1 else None,
        forced=draw(st.sampled_from(list(Granularity))) if draw(st.integers(0, 4)) == 0 else None,  # operators
        step_time_ns=draw(_STEP_TIMES),
        widened=bool(previous) and previous[-1].outcome == AttemptOutcome.SUPERSEDED and draw(st.booleans()),
        sdk=sdk, reform=sdk and draw(st.integers(0, 3)) > 0,  # re-formed in process: through the SDK
        now_ns=now, fault_step=fault_step,
        recent=recent, restart_times=tuple(sorted(now - draw(_AGO) for _ in range(draw(st.integers(0, 60))))),
    )


@st.composite
def checkpoint_contexts(draw: st.DrawFn) -> CheckpointContext:
    """A restart the engine could plan: a layout and a placement that fill whole nodes, a catalog of shards within
    the layout held on storage or on nodes the job ran on, checkpoints no newer than the ranks' steps, unreachable
    nodes among the holders, and the restarting, exiting and ended ranks within the job."""
    layout = Layout(dp=draw(st.integers(1, 4)), tp=draw(st.sampled_from([1, 2, 4])), pp=draw(st.integers(1, 2)))
    world = layout.world
    rpn = draw(st.sampled_from([n for n in (1, 2, 4, 8) if world % n == 0]))
    names = [f"n{i}" for i in range(world // rpn)]
    holders = [*names, "old0"]  # a node the job left may still hold a copy
    top = draw(st.integers(0, 500))
    steps = tuple(max(0, top - draw(st.integers(0, 2))) for _ in range(world))
    catalog: dict[int, dict[Tier, dict[int, tuple[str, ...]]]] = {}
    for step in draw(st.lists(st.integers(0, top), max_size=4, unique=True)):
        by_tier: dict[Tier, dict[int, tuple[str, ...]]] = {}
        for tier in draw(st.lists(st.sampled_from([Tier.MEMORY, Tier.LOCAL, Tier.DYING, Tier.STORAGE]),
                                  min_size=1, max_size=3, unique=True)):
            every = list(range(layout.shards))
            shards = every if draw(st.booleans()) else draw(st.lists(st.sampled_from(every), min_size=1, unique=True))
            if tier is Tier.STORAGE:
                by_tier[tier] = {shard: (STORAGE_HOLDER,) for shard in shards}
            else:
                by_tier[tier] = {shard: tuple(draw(st.lists(st.sampled_from(holders), min_size=1, max_size=2,
                                                            unique=True))) for shard in shards}
        catalog[step] = by_tier
    ranks = st.integers(0, world - 1)
    return make_checkpoint_context(
        layout=layout, ranks_per_node=rpn, nodes=names, catalog=catalog,
        alive=[draw(st.booleans()) for _ in range(world)], steps=steps,
        unreachable=frozenset(draw(st.lists(st.sampled_from(holders), max_size=2))),
        dying_allowed=draw(st.booleans()), peer_allowed=draw(st.booleans()),
        restarting=frozenset(draw(st.lists(ranks, max_size=world))),
        exiting=frozenset(draw(st.lists(ranks, max_size=world)) if draw(st.booleans()) else ()),
        ended=frozenset(draw(st.lists(ranks, max_size=world))))


__all__ = ["JOB_SIGNALS", "NODES", "NODE_SIGNALS", "NOW", "PAYLOADS", "RANKS_PER_NODE", "SIGNAL_TYPES",
           "checkpoint_contexts", "freeze_catalog", "incident_usage", "make_checkpoint_context",
           "make_reschedule_context", "make_signal", "make_watchdog_view", "placements", "reschedule_contexts",
           "signals", "watchdog_views"]

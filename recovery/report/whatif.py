"""What other policies would have done with the faults of a recorded log.

A recorded log cannot simply be replayed under other policies: many of its inputs exist only because of the
recorded decisions (command acks, processes restarted and their progress, dying checkpoints, timers). So the
what-if keeps what the cluster did on its own (the job's shape and its policies from `job.submitted`, the nodes and
spares, and the faults: device faults, links going down and up, hosts going away, and the process exits and hangs
the recorded engine took as fault signals) and lets the simulator (`recovery.sim`: its world's executors, training
and checkpoints, and its cost model) play every answer of the cluster. It runs the simulator twice on these
faults, under the recorded policies and under the what-if's, so that the comparison is between two runs of the
same model; the decisions that differ come from `recovery.report.diff` over the two simulated logs. It says which
inputs it kept and which it left for the simulator to re-create.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import statistics
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from events.subjects import partition_of
from events.values import PolicyRef, PolicySelection
from policies.registry import load_set
from recovery.log import FileLog
from recovery.report.diff import diff_logs
from recovery.report.fold import build_report
from recovery.report.source import RawDict, iter_file
from recovery.sim.__main__ import parse_policy
from recovery.sim.accounting import Result
from recovery.sim.config import DAY_S, NS, Agents, Cluster, Costs, Profile, SimConfig, Training
from recovery.sim.faults import FOLLOW_UPS, Fault
from recovery.sim.sim import Simulator

WHATIF_VERSION = 1
SIGNAL_DECISIONS = frozenset({"fault.confirmed", "faults.confirmed_together", "fault.added", "fault.suspected",
                              "fault.absorbed"})
"""decisions that say the engine took their cause as a fault signal (not as the echo of its own command)"""
PENDING_RECORDS = 256
"""how far after a process event the decision that takes it as a signal may come (it follows its cause at once)"""
TAIL_S = 3600.0
"""simulated time after the log's end (no new faults): recoveries under way then finish under either policy"""
CAUSED_BY_DEVICE_S = 5.0
"""a process exit this soon after a fault of its own device is that fault's crash, which the simulator re-creates"""


@dataclass
class Draft:
    """A fault being read: its repair or outage is known only when the log says the hardware came back."""

    at: int
    signal: str
    scope: str
    source: str
    position: int | None = None
    node: str | None = None
    device: int = 0
    code: str | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    back: int | None = None


@dataclass
class RecordedCluster:
    """What the recorded log says about the cluster, the job and its faults."""

    job: str
    spec: dict[str, Any]
    nodes: list[str]
    spares: list[str]
    start: int
    end: int
    step_times: list[float] = field(default_factory=list)
    storage_steps: list[int] = field(default_factory=list)
    memory_steps: list[int] = field(default_factory=list)
    drafts: list[Draft] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)
    resimulated: dict[str, int] = field(default_factory=dict)
    other_jobs: set[str] = field(default_factory=set)
    """jobs of the log the what-if leaves out: the simulator runs one job (their nodes are not in its cluster)"""

    @property
    def rpn(self) -> int:
        return int(self.spec["ranks_per_node"])


class _Reader:
    """One pass over the recorded log, keeping the job's shape and its faults."""

    def __init__(self, job: str | None, agents: Agents) -> None:
        self.job = job
        self.agents = agents
        self.joined: dict[str, bool] = {}
        """node -> joined as a spare, in the order they joined (before the job: the simulator's cluster)"""
        self.cluster: RecordedCluster | None = None
        self.placement: list[str] = []
        self.pending: dict[int, tuple[Draft, str]] = {}
        self.open: dict[str, list[Draft]] = {}
        """node -> faults waiting for the node (or its device or link) to come back"""
        self.device_faults: dict[tuple[str, int], int] = {}
        self.last_step: tuple[int, int] | None = None
        self.last_ts = 0
        self.others: set[str] = set()
        self.started = False
        self.recovering = False

    def count(self, table: str, kind: str) -> None:
        assert self.cluster is not None
        counts = self.cluster.kept if table == "kept" else self.cluster.resimulated
        counts[kind] = counts.get(kind, 0) + 1

    def read(self, records: Iterable[RawDict]) -> RecordedCluster:
        for record in records:
            self.last_ts = record["ts"]
            if record["subject"].startswith("recovery.dlq."):
                continue
            if record["subject"].startswith("recovery.dec."):
                if record["envelope"].get("type") == "decision":
                    self.decision(record, record["envelope"]["data"])
                continue
            self.input(record)
        if self.cluster is None:
            raise ValueError("the log holds no job.submitted" + (f" of job {self.job}" if self.job else ""))
        for _, kind in self.pending.values():
            self.count("resimulated", kind)
        self.cluster.end = self.last_ts
        self.cluster.other_jobs = set(self.others)
        return self.cluster

    def input(self, record: RawDict) -> None:
        env = record["envelope"]
        kind: str = env.get("type", "?")
        ts: int = record["ts"]
        job, node = env.get("job"), env.get("node")
        data: dict[str, Any] = env.get("data") or {}
        cluster = self.cluster
        if cluster is None:
            if kind == "node.joined" and node is not None:
                self.joined.setdefault(node, bool(data.get("spare")))
            elif kind == "job.submitted" and (self.job is None or job == self.job):
                spec = data["spec"]
                self.placement = list(spec["nodes"])
                spares = [n for n, spare in self.joined.items() if spare and n not in self.placement]
                self.cluster = RecordedCluster(job=job, spec=spec, nodes=list(self.placement), spares=spares,
                                               start=ts, end=ts)
                self.job = job
            return
        if job is not None and job != cluster.job:
            self.others.add(job)
            return
        self.expire(record["seq"])
        if kind == "job.started":
            if not self.started:  # the simulated run starts where the recorded job first started
                self.started, cluster.start = True, ts
            self.count("resimulated", kind)
        elif kind == "progress.step":
            step = int(data["step"])
            # the pace of training only: a gap that spans a recovery is not a step time
            if self.last_step is not None and step > self.last_step[1] and not self.recovering:
                cluster.step_times.append((ts - self.last_step[0]) / NS / (step - self.last_step[1]))
                del cluster.step_times[:-1000]
            if self.last_step is None or step > self.last_step[1]:
                self.last_step = (ts, step)
            self.count("resimulated", kind)
        elif kind == "checkpoint.saved":
            tier = data.get("tier")
            if tier in ("storage", "memory"):
                steps = cluster.storage_steps if tier == "storage" else cluster.memory_steps
                if not steps or steps[-1] != data["step"]:
                    steps.append(int(data["step"]))
                    del steps[:-1000]
            self.count("resimulated", kind)
        elif kind == "device.fault" and node is not None:
            self.device_fault(node, data, ts, record["seq"])
        elif kind == "device.recovered" and node is not None:
            self.back(node, ts, "device")
            self.count("resimulated", kind)
        elif kind == "network.link_down" and node is not None:
            self.fault(Draft(ts, "network", "node", f"network.link_down (seq {record['seq']})"), node, kind)
        elif kind == "network.link_up" and node is not None:
            self.back(node, ts, "network")
            self.count("resimulated", kind)
        elif kind == "node.not_ready" and node is not None:
            if any(d.signal == "network" for d in self.open.get(node, [])):
                self.count("resimulated", kind)  # the platform's health check after a link went down: simulated
            else:  # the host went away; the platform noticed after its grace period
                at = max(cluster.start, ts - int(self.agents.node_not_ready_s * NS))
                self.fault(Draft(at, "node", "node", f"node.not_ready (seq {record['seq']})"), node, kind)
        elif kind in ("node.ready", "node.joined") and node is not None:
            self.back(node, ts, None)
            self.count("resimulated", kind)
        elif kind in ("process.exited", "process.hang", "network.collective_timeout") and job is not None:
            self.process_signal(record["seq"], kind, data, ts)
        else:
            self.count("resimulated", kind)

    def device_fault(self, node: str, data: dict[str, Any], ts: int, seq: int) -> None:
        device, code = int(data.get("device", 0)), str(data.get("code", ""))
        earlier = self.device_faults.get((node, device))
        follow_up = any(code == after for after in FOLLOW_UPS.values())
        self.device_faults[(node, device)] = ts
        if follow_up and earlier is not None and ts - earlier <= CAUSED_BY_DEVICE_S * NS:
            self.count("resimulated", "device.fault")  # the simulator sends the follow-up XID itself
            return
        draft = Draft(ts, "device", "device", f"device.fault XID {code} (seq {seq})", device=device, code=code or None)
        self.fault(draft, node, "device.fault")

    def fault(self, draft: Draft, node: str, kind: str) -> None:
        if node in self.placement:
            draft.position = self.placement.index(node)
        elif node in self.joined:
            draft.node = node
        else:
            self.count("resimulated", kind)  # a node the simulated cluster does not have
            return
        assert self.cluster is not None
        self.cluster.drafts.append(draft)
        self.open.setdefault(node, []).append(draft)
        self.count("kept", kind)

    def back(self, node: str, ts: int, signal: str | None) -> None:
        waiting = self.open.get(node, [])
        for draft in waiting:
            if draft.back is None and (signal is None or draft.signal == signal):
                draft.back = ts
        self.open[node] = [d for d in waiting if d.back is None]

    def process_signal(self, seq: int, kind: str, data: dict[str, Any], ts: int) -> None:
        assert self.cluster is not None
        rank = data.get("rank")
        if kind == "network.collective_timeout":
            draft = Draft(max(self.cluster.start, ts - int(self.agents.hang_detect_s * NS)), "hang", "rank",
                          f"{kind} (seq {seq})")
            self.pending[seq] = (draft, kind)
            return
        if not isinstance(rank, int):
            self.count("resimulated", kind)
            return
        node_index = rank // self.cluster.rpn
        device = rank % self.cluster.rpn
        node = self.placement[node_index] if node_index < len(self.placement) else None
        crashed = self.device_faults.get((node, device)) if node is not None else None
        if kind == "process.exited" and crashed is not None and ts - crashed <= CAUSED_BY_DEVICE_S * NS:
            self.count("resimulated", kind)  # the crash of a faulty device's process: the simulator makes it
            return
        if kind == "process.hang":
            draft = Draft(max(self.cluster.start, ts - int(self.agents.hang_detect_s * NS)), "hang", "rank",
                          f"{kind} rank {rank} (seq {seq})", position=node_index, device=device)
        else:
            draft = Draft(ts, "process", "rank", f"{kind} rank {rank} (seq {seq})", position=node_index,
                          device=device, exit_code=data.get("exit_code"), exit_signal=data.get("signal"))
        self.pending[seq] = (draft, kind)

    def expire(self, seq: int) -> None:
        while self.pending:
            first = next(iter(self.pending))
            if seq - first <= PENDING_RECORDS:
                return
            _, kind = self.pending.pop(first)
            self.count("resimulated", kind)

    def decision(self, record: RawDict, d: dict[str, Any]) -> None:
        cluster = self.cluster
        if cluster is None or d["job"] != cluster.job:
            return
        kind = d["kind"]
        detail = d.get("detail") or {}
        phase = d.get("phase")
        if phase is not None and not self.recovering:
            self.recovering = True
        elif phase is None and self.recovering:
            self.recovering = False
            self.last_step = None  # the next report after a recovery starts a new stretch of training
        if kind == "ranks.rescheduling" and detail.get("nodes"):
            self.placement = list(detail["nodes"])
        pending = self.pending.pop(d["cause_seq"], None)
        if pending is not None:
            draft, input_kind = pending
            if kind in SIGNAL_DECISIONS:
                fault = detail.get("fault")
                if draft.signal == "hang" and draft.position is None and isinstance(fault, dict) and fault.get("ranks"):
                    rank = int(fault["ranks"][0])
                    draft.position, draft.device = rank // cluster.rpn, rank % cluster.rpn
                if draft.position is not None:
                    cluster.drafts.append(draft)
                    self.count("kept", input_kind)
                    return
            self.count("resimulated", input_kind)


def read_recorded(records: Iterable[RawDict], job: str | None = None, agents: Agents | None = None
                  ) -> RecordedCluster:
    return _Reader(job, agents or Agents()).read(records)


def _faults(cluster: RecordedCluster, durations: Any) -> list[Fault]:
    spares = {name: len(cluster.nodes) + i for i, name in enumerate(cluster.spares)}
    faults = []
    for draft in sorted(cluster.drafts, key=lambda d: d.at):
        repair = (draft.back - draft.at) if draft.back is not None else {
            "device": durations.device_repair_mean_s, "network": durations.nic_repair_mean_s,
            "node": durations.node_repair_mean_s}.get(draft.signal, durations.node_repair_mean_s) * NS
        outage = (draft.back - draft.at) if draft.signal == "network" and draft.back is not None else 0
        node = f"n{spares[draft.node]:05d}" if draft.node in spares else None
        faults.append(Fault(index=len(faults), at_ns=max(0, draft.at - cluster.start), component=draft.source,
                            signal=draft.signal, scope=draft.scope, position=draft.position or 0, device=draft.device,
                            code=draft.code, exit_code=draft.exit_code, exit_signal=draft.exit_signal,
                            outage_ns=int(outage), repair_ns=int(max(repair, NS)), node=node))
    return faults


DEVICE_MEMORY_BYTES = 80e9
"""one accelerator's memory (an H100's or an Ascend 910B's 64-80 GB, the larger)"""
TRAINING_BYTES_PER_PARAM = 16.0
"""what training holds per parameter: bf16 weights and gradients (4), fp32 master weights and Adam's m and v (12)"""


def layout_params(layout: dict[str, int]) -> float:
    """The model size a recorded job is taken to train when the log does not say: the largest one replica of its
    layout holds (tp x pp devices of `DEVICE_MEMORY_BYTES`, `TRAINING_BYTES_PER_PARAM` each), never more than the
    simulator's Llama 3 405B. The cost of moving state follows the job's own scale instead of a 405B model's: an
    8-GPU job at dp 4 x tp 2 is a 10B-parameter job, not one that reloads 5.7 TB."""
    replica = layout.get("tp", 1) * layout.get("pp", 1)
    return min(Training().params, replica * DEVICE_MEMORY_BYTES / TRAINING_BYTES_PER_PARAM)


def config_for(cluster: RecordedCluster, selection: PolicySelection, model_params: float | None = None,
               executor_failures: bool = False, tail_s: float = 0.0) -> SimConfig:
    """The simulator's configuration for the recorded job: its shape, its measured pace and checkpoint cadence, the
    cost model's defaults for everything the log does not say; executors that never fail unless asked, so that a
    difference comes from the policies rather than the executors' luck."""
    spec = cluster.spec
    layout = spec["layout"]
    gpus = len(cluster.nodes) * cluster.rpn
    if gpus != layout["dp"] * layout["tp"] * layout["pp"]:
        raise ValueError(f"job {cluster.job}: {gpus} ranks on its nodes is not dp x tp x pp of its layout {layout}")
    step_s = statistics.median(cluster.step_times) if cluster.step_times else Training().step_time_s
    storage = _every(cluster.storage_steps)
    memory = _every(cluster.memory_steps)
    training = replace(Training(), step_time_s=step_s, storage_every_s=storage * step_s if storage else None,
                       memory_every_steps=memory,
                       params=model_params or layout_params(layout))
    costs = Costs() if executor_failures else replace(Costs(), fail_probability=0.0, timeout_probability=0.0)
    return SimConfig(cluster=Cluster(gpus=gpus, gpus_per_node=cluster.rpn, tp=layout["tp"], pp=layout["pp"],
                                     spare_nodes=len(cluster.spares)),
                     training=training, costs=costs,
                     profile=Profile("recorded", selection, memory_tier=memory is not None),
                     days=(max(cluster.end - cluster.start, NS) / NS + tail_s) / DAY_S, job=cluster.job)


def _every(steps: list[int]) -> int | None:
    gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
    if gaps:
        return int(statistics.median(gaps))
    return steps[0] if steps and steps[0] > 0 else None


def selection_with(spec: dict[str, Any], overrides: Sequence[str]) -> PolicySelection:
    refs = {family: PolicyRef(**ref) for family, ref in (spec.get("policies") or {}).items()}
    base = PolicySelection(**refs)
    if not overrides:
        return base
    for text in overrides:
        family, ref = parse_policy(text)
        refs[family] = ref
    chosen = PolicySelection(**{**base.model_dump(), **{f: r.model_dump() for f, r in refs.items()}})
    load_set(chosen)  # a policy that is not installed, or a bad parameter: an error before anything runs
    return chosen


def _simulate(config: SimConfig, faults: list[Fault], path: Path) -> Result:
    log = FileLog(path)
    try:
        return Simulator(config, log=log, faults=faults).run()
    finally:
        log.close_sync()


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _figures(result: Result) -> dict[str, Any]:
    mttr = result.mttr()
    return {"ettr": round(result.ettr, 6), "lost_gpu_hours": round(result.lost_gpu_hours, 3),
            "lost_gpu_hours_by_cause": {k: round(result.gpu_hours(v), 3) for k, v in result.lost_s.items() if v},
            "mttr_by_fault_class": {k: {"faults": int(v["faults"]), "recovered": int(v["recovered"]),
                                        "p50_s": _number(v["p50_s"]), "p95_s": _number(v["p95_s"])}
                                    for k, v in mttr.items()},
            "restarts": result.restarts, "policies": result.policies, "decisions": result.decisions}


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    classes = sorted(set(a["mttr_by_fault_class"]) | set(b["mttr_by_fault_class"]))

    def p50(side: dict[str, Any], cls: str) -> float | None:
        value = side["mttr_by_fault_class"].get(cls, {}).get("p50_s")
        return None if value is None else float(value)

    mttr = {}
    for cls in classes:
        x, y = p50(a, cls), p50(b, cls)
        mttr[cls] = None if x is None or y is None else round(y - x, 3)
    return {"ettr": round(b["ettr"] - a["ettr"], 6),
            "lost_gpu_hours": round(b["lost_gpu_hours"] - a["lost_gpu_hours"], 3), "mttr_p50_s": mttr}


def whatif(path: str | os.PathLike[str], overrides: Sequence[str], job: str | None = None,
           model_params: float | None = None, executor_failures: bool = False,
           keep_logs: str | os.PathLike[str] | None = None, tail_s: float = TAIL_S,
           partitions: int | None = None) -> dict[str, Any]:
    """The what-if of a recorded log (a JSONL export) under `overrides` (`FAMILY=NAME[:k=v,...]`). Both simulated
    runs last the log's span plus `tail_s`, so that a recovery under way when the log ends can finish. A log of
    `partitions` P > 1 gave the job only its partition's spares (`recovery.core.partition`): so does the what-if."""
    agents = Agents()
    cluster = read_recorded(iter_file(path), job, agents)
    partition = None
    if partitions is not None and partitions > 1:
        partition = partition_of(cluster.job, partitions)
        others = {node for node in cluster.spares if partition_of(node, partitions) != partition}
        cluster.spares = [node for node in cluster.spares if node not in others]
        # a fault on another partition's spare never reached this job: the simulated cluster has no such node
        for draft in [d for d in cluster.drafts if d.node in others]:
            cluster.drafts.remove(draft)
            kind = draft.source.split(" ", 1)[0]
            cluster.kept[kind] = cluster.kept.get(kind, 1) - 1
            if cluster.kept[kind] <= 0:
                del cluster.kept[kind]
            cluster.resimulated[kind] = cluster.resimulated.get(kind, 0) + 1
    base_selection = selection_with(cluster.spec, [])
    chosen = selection_with(cluster.spec, overrides)
    faults = _faults(cluster, SimConfig().durations)
    base_config = config_for(cluster, base_selection, model_params, executor_failures, tail_s)
    what_config = replace(base_config, profile=Profile("what-if", chosen, memory_tier=base_config.profile.memory_tier))
    recorded = build_report(iter_file(path), job=cluster.job)["summary"]
    with tempfile.TemporaryDirectory(prefix="recovery-whatif-") as tmp:
        where = Path(keep_logs) if keep_logs is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        base_log, what_log = where / "recorded-policies.jsonl", where / "whatif.jsonl"
        base = _figures(_simulate(base_config, faults, base_log))
        what = _figures(_simulate(what_config, faults, what_log))
        diff = diff_logs(iter_file(base_log), iter_file(what_log), job=cluster.job,
                         labels=("recorded policies", "what-if"))
    names = {f"n{i:05d}": n for i, n in enumerate(cluster.nodes + cluster.spares)}
    return _renamed({
        "whatif": WHATIF_VERSION, "log": str(path), "job": cluster.job,
        "policies": {"recorded": base_selection.model_dump(), "what-if": chosen.model_dump()},
        "cluster": {"nodes": len(cluster.nodes), "spares": len(cluster.spares), "ranks_per_node": cluster.rpn,
                    "partition": None if partition is None else {"index": partition, "count": partitions},
                    "layout": cluster.spec["layout"], "step_time_s": round(base_config.training.step_time_s, 3),
                    "storage_every_s": base_config.training.storage_every_s,
                    "memory_every_steps": base_config.training.memory_every_steps,
                    "model_params": base_config.training.params,
                    "model_params_from": "--model-params" if model_params else "layout",
                    "days": round(base_config.days, 6),
                    "executor_failures": executor_failures, "tail_s": tail_s},
        "other_jobs": sorted(cluster.other_jobs),
        "inputs": {"faults": len(faults), "kept": dict(sorted(cluster.kept.items())),
                   "resimulated": dict(sorted(cluster.resimulated.items())),
                   "fault_list": [{"at_s": round(f.at_ns / NS, 3), "signal": f.signal, "from": f.component}
                                  for f in faults[:200]]},
        "recorded": {"ettr": recorded["ettr"], "lost_gpu_hours": recorded["lost_gpu_hours"],
                     "mttr_by_fault_class": {k: {"p50_s": v["p50_s"], "p95_s": v["p95_s"]}
                                             for k, v in recorded["mttr_by_fault_class"].items()}},
        "simulated": {"recorded policies": base, "what-if": what},
        "delta": _delta(base, what),
        "diff": diff,
        "logs": None if keep_logs is None else [str(base_log), str(what_log)],
    }, names)


_SIM_NODE = re.compile(r"\bn\d{5}\b")


def _renamed(obj: Any, names: dict[str, str]) -> Any:
    """The simulator's node names (n00000...) as the recorded log's (the same position in the job, or spare)."""
    if isinstance(obj, str):
        return _SIM_NODE.sub(lambda m: names.get(m.group(0), m.group(0)), obj)
    if isinstance(obj, list):
        return [_renamed(x, names) for x in obj]
    if isinstance(obj, dict):
        return {k: _renamed(v, names) for k, v in obj.items()}
    return obj

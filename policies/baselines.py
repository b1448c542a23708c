"""Baseline policies for benchmarks: what two well-known systems do, expressed in our policy contract.

`torchelastic-like` (PyTorch's torchrun/torchelastic with the NCCL watchdog): a worker process that fails makes
the agents restart every worker of the job; a hang or a network fault is only seen when a collective times out
(NCCL's default is 10 minutes) and the watchdog aborts the processes; the job resumes from its last persistent
checkpoint (torchelastic keeps no in-memory state). Hardware health comes from the platform (the Kubernetes
device plugin or a Slurm health check takes a broken GPU or node out of scheduling), so the restarted job lands
on good nodes.

`mindcluster-like` (Huawei MindCluster with MindIO TTP/ACP): watchdog detection (device, process, link and
node probes, and a hang watchdog), one fixed strategy order for every fault, `retry < recover-in-place <
recover < elastic-training < dump < exit`, with MindCluster's job-level rescheduling as the fallback when
process- and pod-level recovery fail (before `dump`, up to 3 times: Volcano's default `maxRetry`), each tried once
per incident and escalated on failure; and
a dying checkpoint from a healthy replica (MindIO TTP) or the newest in-memory one (MindIO ACP).

They register under the `recovery.policies` entry points like any plugin:
`torchelastic-like-detection`, `torchelastic-like-rescheduling`, `torchelastic-like-checkpoint` and the same
three for `mindcluster-like`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from events import kinds
from events.values import MAX_SECONDS, Count, FaultClass, Flag, Granularity, Interval, Tier
from policies.base import (
    NS,
    DetectionPolicyBase,
    Fail,
    Fault,
    Ignore,
    Params,
    Reschedule,
    RescheduleContext,
    ReschedulingPolicyBase,
    Signal,
    StartRung,
    Verdict,
    Wait,
    WatchdogView,
)
from policies.checkpoint import NewestCompleteCheckpoint
from policies.codes import Action as CodeAction
from policies.codes import exit_status, nvidia_xid
from policies.detection import DefaultDetection
from policies.rescheduling import LadderRescheduling, Rung

G = Granularity


# --- torchelastic-like -----------------------------------------------------------------------------------
class TorchElasticDetectionParams(Params):
    platform_device_health: Flag = True
    """a device the vendor says must be reset or isolated is taken out by the platform's health check, so the
    job-level restart avoids it"""


class TorchElasticLikeDetection(DetectionPolicyBase):
    """Sees what torchelastic's agents see: their own workers exiting, and the NCCL watchdog's collective
    timeout. Hang reports, link probes and node conditions go unnoticed."""

    name: ClassVar[str] = "torchelastic-like-detection"
    version: ClassVar[str] = "1"
    parameters = TorchElasticDetectionParams
    params: TorchElasticDetectionParams

    def classify(self, signal: Signal) -> Verdict:
        data = signal.data
        if isinstance(data, kinds.ProcessExited):
            meaning = exit_status(data.exit_code, data.signal)
            if meaning.fault_class is None:
                return Ignore(f"rank {data.rank}: {meaning.description}")
            return Fault(f"rank {data.rank}: {meaning.description}: the agents restart every worker",
                         meaning.fault_class, "job", signal.ranks, code=f"exit={data.exit_code},sig={data.signal}")
        if isinstance(data, kinds.CollectiveTimeout):
            waited = tuple(r for r in sorted(set(data.members)) if r not in set(data.reporters))
            cls = FaultClass.HANG if waited else FaultClass.NETWORK
            return Fault(f"NCCL watchdog: {data.operation} on {data.group} timed out after "
                         f"{data.timeout_s:.0f}s: every worker aborts", cls, "job",
                           tuple(sorted(set(data.members))))
        if isinstance(data, kinds.DeviceFault) and self.params.platform_device_health and data.vendor == "nvidia":
            meaning = nvidia_xid(data.code)
            if meaning.action in (CodeAction.RESET_DEVICE, CodeAction.ISOLATE_DEVICE, CodeAction.ISOLATE_NODE):
                if not signal.ranks:
                    return Ignore(f"XID {data.code} on {signal.node}: no rank of this job on it")
                return Fault(f"XID {data.code} on {signal.node} device {data.device}: the platform marks "
                             f"the GPU unhealthy; the job restarts elsewhere",
                               meaning.fault_class, "job", signal.ranks, signal.node, data.device, needs_move=True,
                               code=f"XID {data.code}")
        return Ignore(f"{signal.type}: torchelastic does not watch it")

    def check(self, view: WatchdogView) -> list[Verdict]:
        return []


class TorchElasticReschedulingParams(Params):
    max_restarts: Count | None = Field(None, description="torchrun --max-restarts; None: unlimited")
    deadline_s: Interval = Field(1800.0, description="a restart that has not made progress by then is redone "
                                                     "(1 ms .. 30 days)")


class TorchElasticLikeRescheduling(ReschedulingPolicyBase):
    """Every failure restarts every rank (a job-level restart), as many times as `max_restarts` allows; nodes the
    platform took out are replaced from the spare pool, or the job waits for them."""

    name: ClassVar[str] = "torchelastic-like-rescheduling"
    version: ClassVar[str] = "1"
    parameters = TorchElasticReschedulingParams
    params: TorchElasticReschedulingParams

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        p = self.params
        deadline = int(p.deadline_s * NS)
        if ctx.forced is not None:
            return StartRung(ctx.forced, f"operator forced {ctx.forced.value}", deadline_ns=deadline)
        used = ctx.used.get(G.RESTART_JOB.value, 0)
        if p.max_restarts is not None and used >= p.max_restarts:
            return Fail(f"max_restarts {p.max_restarts} used")
        if ctx.nodes_to_replace > ctx.spares_available:
            return Wait(f"{ctx.nodes_to_replace} node(s) to replace, {ctx.spares_available} spare(s): wait for nodes")
        return StartRung(G.RESTART_JOB, f"{ctx.fault_class.value} fault: restart every worker", deadline)


class TorchElasticCheckpointParams(Params):
    tiers: tuple[Tier, ...] = (Tier.STORAGE,)


class TorchElasticLikeCheckpoint(NewestCompleteCheckpoint):
    """The newest persistent checkpoint; no dying checkpoint, no in-memory tier."""

    name: ClassVar[str] = "torchelastic-like-checkpoint"
    version: ClassVar[str] = "2"  # 2: newest-complete@6's resharded steps
    parameters = TorchElasticCheckpointParams  # what a job may set; the policy runs newest-complete's with them

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        own = TorchElasticCheckpointParams.model_validate(dict(params or {}))
        super().__init__({"dying": False, "tiers": list(own.tiers)})


# --- mindcluster-like ------------------------------------------------------------------------------------
class MindClusterLikeDetection(DefaultDetection):
    """MindCluster's fault detection: device fault codes, process exits, link and node probes, and a hang
    watchdog, with the same code tables and debouncing as our default detection."""

    name: ClassVar[str] = "mindcluster-like-detection"
    version: ClassVar[str] = "5"  # 2: sub-health drains at the next checkpoint; 3: unused devices (default@4);
    # 4: lemons isolated only when replaceable, for isolation_s (default@6); 5: a stock script is never silent

    def _stragglers(self, view: WatchdogView) -> list[Verdict]:
        # MindCluster acts on faults and sub-health codes; a slow node with neither is not one it drains (default@8
        # does), so the baseline stays what it was measured as.
        return []


STRATEGY_ORDER: tuple[tuple[Granularity, float], ...] = (
    (G.RETRY, 60.0), (G.IN_PLACE, 180.0), (G.MIGRATE, 300.0), (G.SCALE_IN, 900.0), (G.RESTART_JOB, 900.0),
    (G.DUMP, 300.0), (G.FAIL, 60.0))
"""MindCluster's recover strategies in their fixed priority: retry < recover-in-place < recover (the faulty
processes move to healthy nodes) < elastic-training (scale in) < job-level rescheduling < dump < exit, with a
deadline each. Job-level rescheduling is tried `job_level_tries` times (Volcano's default `maxRetry` is 3)."""


class MindClusterReschedulingParams(Params):
    deadlines_s: dict[Granularity, Interval] = Field(default_factory=lambda: dict(STRATEGY_ORDER))
    job_level_tries: int = Field(3, ge=1, le=100, strict=True,
                                 description="job-level reschedulings per incident before dump (each is a rung)")


class MindClusterLikeRescheduling(LadderRescheduling):
    """One ladder for every fault class: the fixed strategy order, no budgets, each rung tried once per incident
    and escalated when it fails or misses its deadline; a rung that cannot apply is skipped (a step retry when a
    process is gone, an in-place restart when the node must be left, elastic training for a fixed-size job)."""

    name: ClassVar[str] = "mindcluster-like-rescheduling"
    version: ClassVar[str] = "5"  # 2: the ladder's settle window (ClusterD gathers a job's faults first); 3: ladder@4;
    # 4: ladder@5, its waits left as long as the ladder allows (a job without resources stays pending); 5: ladder@6,
    # a stock script restarted whole, without the ladder's restart budget over time or its crash-loop check (ladder@7
    # changes nothing here: its quick widenings are off)
    parameters = MindClusterReschedulingParams  # what a job may set; the policy runs the ladder's built from them

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        own = MindClusterReschedulingParams.model_validate(dict(params or {}))
        # A job MindCluster cannot place stays pending until resources return: no deadline, no reset fallback of
        # ours (the longest wait the ladder takes, 30 days, is past any run).
        ladder = [Rung(granularity=g, budget=None, deadline_s=own.deadlines_s.get(g, d), wait_s=MAX_SECONDS)
                  for g, d in STRATEGY_ORDER for _ in range(own.job_level_tries if g is G.RESTART_JOB else 1)]
        super().__init__({"ladders": {fc: ladder for fc in FaultClass}, "elastic": True, "wait": True,
                          "reset_after_s": MAX_SECONDS, "loop_after": None, "no_progress_after": None, "persist": False,
                          "quick_widenings": 0})


class MindClusterLikeCheckpoint(NewestCompleteCheckpoint):
    """MindIO TTP's dying checkpoint from a healthy replica, else the newest complete checkpoint, the
    in-memory one (MindIO ACP) first."""

    name: ClassVar[str] = "mindcluster-like-checkpoint"
    version: ClassVar[str] = "3"  # 2: newest-complete@4's memory-first pass, which passes over a superseded dying one;
    # 3: newest-complete@6's resharded steps

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        # MindIO TTP saves the healthy replica's state and the restarted processes load it: no transfer from
        # the live replicas themselves, and no dying checkpoint of sharded state without a replica.
        super().__init__({**(params or {}), "peer": False, "shard_savers": False})


__all__ = [
    "MindClusterLikeCheckpoint", "MindClusterLikeDetection", "MindClusterLikeRescheduling",
    "TorchElasticLikeCheckpoint", "TorchElasticLikeDetection", "TorchElasticLikeRescheduling",
]

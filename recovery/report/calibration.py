"""The simulator set to a recorded night: the figures the log holds, measured; the others assumed, and said so.

A what-if compares two simulated runs, so the cost model need not match the recorded cluster for the difference
to mean something; but the run under the recorded policies must reproduce the recorded night before its figures
stand beside the log's. The executors' durations, the restores' and the agents' detection delays are what decide
when each recovery decision comes and how long each incident lasts: where the log shows them they are taken from it
(medians), and everything else is the cost model's default, listed as assumed with the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from recovery.report.recorded import RecordedCluster, median
from recovery.sim.config import Agents, Costs, Training

INSTANT_BPS = 1e18
"""bandwidth of a tier whose restore was measured: the measured time is the whole load, whatever the model size"""
COMMAND_COSTS: dict[str, tuple[str, ...]] = {
    "stop_ranks:kill": ("stop_kill_s",),
    "stop_ranks:graceful": ("stop_graceful_s",),
    "retry_step": ("retry_step_s",),
    "restart_ranks": ("restart_in_place_s",),
    "migrate_ranks": ("migrate_s",),
    "restart_job": ("restart_job_small_s", "restart_job_large_s"),
    "scale_job": ("restart_job_small_s", "restart_job_large_s"),
    "isolate_node": ("isolate_s",),
    "isolate_device": ("isolate_s",),
    "fail_job": ("fail_job_s",),
}
"""command kind -> the cost model's fields its measured duration sets (a job-level restart: at any size)"""
TIER_FIELDS = {"memory": ("memory_latency_s", ("memory_rank_Bps",)),
               "peer": ("peer_latency_s", ("peer_rank_Bps",)),
               "local": ("local_latency_s", ("local_rank_Bps",)),
               "storage": ("storage_latency_s", ("storage_rank_Bps", "storage_read_Bps"))}


@dataclass(frozen=True)
class Calibration:
    """The simulator's figures for a recorded night, and where each came from."""

    training: Training
    costs: Costs
    agents: Agents
    figures: dict[str, dict[str, Any]]
    """name -> {value, from: measured | assumed | given, how}"""

    @property
    def assumed(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.figures.items() if v["from"] == "assumed"}


def _figure(value: Any, source: str, how: str) -> dict[str, Any]:
    return {"value": value, "from": source, "how": how}


def calibrate(cluster: RecordedCluster, training: Training, costs: Costs, step_time_s: float | None,
              model_params_from: str, node_not_ready_s: float | None = None) -> Calibration:
    """`training` and `costs` (the cost model's, or as configured) with what the log measured put in; `step_time_s`
    is the one given with `--step-time-s`, used when the job reported no steps."""
    night = cluster.night
    figures: dict[str, dict[str, Any]] = {}
    measured_step = median(cluster.step_times)
    if measured_step is not None:
        step = measured_step
        figures["step_time_s"] = _figure(round(step, 3), "measured", f"median of {len(cluster.step_times)} steps")
    elif step_time_s is not None:
        step = step_time_s
        figures["step_time_s"] = _figure(step, "given", "--step-time-s (the job reported no steps)")
    else:
        step = training.step_time_s
        figures["step_time_s"] = _figure(step, "assumed", "the job reported no steps: the cost model's; set it with "
                                                          "--step-time-s")
    if not cluster.ranks_reported:  # a stock script: the simulated one says nothing either
        training = replace(training, reports_steps=False)
        figures["reports"] = _figure("none", "measured", "the ranks reported nothing (a stock script, without the "
                                                         "SDK): neither do the simulated ones")
    compute = median(cluster.compute_s)
    if compute is not None:
        training = replace(training, compute_s=compute)
        figures["compute_s"] = _figure(round(compute, 6), "measured", f"median of {len(cluster.compute_s)} compute "
                                                                      f"times the ranks reported")
    stragglers = [d for d in cluster.drafts if d.signal == "straggler"]
    if stragglers:
        paced = all(d.pace_measured for d in stragglers)
        figures["straggler_slowdown"] = _figure(
            [round(d.slowdown, 3) for d in stragglers], "measured" if paced else "assumed",
            "the job's steps while the straggler was in the placement over the others'" if paced else
            "1: the log has the job's steps only with the straggler in the placement or only without it (the "
            "measured step time is its pace)")
    figures["model_params"] = _figure(training.params, "given" if model_params_from == "--model-params" else
                                      "assumed", "--model-params" if model_params_from == "--model-params" else
                                      "the most one replica of the layout holds; set it with --model-params")
    changes: dict[str, float] = {}
    ack = median(night.ack_s)
    if ack is not None:
        changes["ack_latency_s"] = ack
    figures["ack_latency_s"] = _figure(round(changes.get("ack_latency_s", costs.ack_latency_s), 3),
                                       "measured" if ack is not None else "assumed",
                                       f"median of {len(night.ack_s)} accepted acks" if ack is not None
                                       else "the cost model's")
    latency = changes.get("ack_latency_s", costs.ack_latency_s)
    for kind, fields in COMMAND_COSTS.items():
        seconds = median(night.command_s.get(kind, []))
        if seconds is None:
            continue
        for name in fields:
            changes[name] = max(0.0, seconds - latency)
        figures[f"{kind}_s"] = _figure(round(changes[fields[0]], 3), "measured",
                                       f"median of {len(night.command_s[kind])}, decision to done ack")
    reset = median(night.command_s.get("restart_ranks:reset", []))
    if reset is not None and "restart_in_place_s" in changes:
        changes["device_reset_s"] = max(0.0, reset - latency - changes["restart_in_place_s"])
        figures["device_reset_s"] = _figure(round(changes["device_reset_s"], 3), "measured",
                                            "restart with a device reset, less the restart in place")
    elif reset is not None:
        # No restart without a reset to split it by: the whole measured time is the restart's, and the cost model's
        # restart in place is not added to it (a reset measured shorter than that came out as 0 s, and the
        # simulated restart took the model's time instead of the log's).
        changes["restart_in_place_s"], changes["device_reset_s"] = max(0.0, reset - latency), 0.0
        figures["restart_ranks_s"] = _figure(round(changes["restart_in_place_s"], 3), "measured",
                                             "restart with a device reset, decision to done ack (reset included)")
    save = median(night.command_s.get("save_checkpoint", []))
    if save is not None:  # the dying checkpoint's save, whatever its size: the whole of it was measured
        changes["dying_save_s"] = max(0.0, save - latency)
        figures["save_checkpoint_s"] = _figure(round(changes["dying_save_s"], 3), "measured",
                                               f"median of {len(night.command_s['save_checkpoint'])}, decision to "
                                               f"done ack")
    saved = median(cluster.storage_saved_s)
    if saved is not None:  # a persistent checkpoint's stall and upload, whatever its size: the whole was measured
        changes["storage_saved_s"] = saved
    figures["storage_saved_s"] = _figure(round(saved, 3) if saved is not None else None,
                                         "measured" if saved is not None else "assumed",
                                         f"median of {len(cluster.storage_saved_s)} persistent checkpoints, their "
                                         f"step's first report to checkpoint.saved" if saved is not None
                                         else "the cost model's stall and storage write at the model size")
    gap = median(cluster.storage_gap_s)
    if gap is not None:
        changes["storage_save_stall_s"] = max(0.0, gap - step)
        how = f"median of {len(cluster.storage_gap_s)} steps after a persistent checkpoint, less a step"
    elif saved is not None and saved < costs.storage_save_stall_s:
        # no step after a checkpoint was reported, but the checkpoint was saved this soon: its stall was no longer
        changes["storage_save_stall_s"] = saved
        how = "the cost model's, at most the measured save (no step after a checkpoint was reported)"
    else:
        how = "the cost model's"
    figures["storage_save_stall_s"] = _figure(round(changes.get("storage_save_stall_s", costs.storage_save_stall_s),
                                                    3), "measured" if gap is not None else "assumed", how)
    missing = sorted(kind for kind in COMMAND_COSTS if f"{kind}_s" not in figures)
    figures["other_commands"] = _figure(missing, "assumed", "the cost model's durations (recovery/sim/README.md)")
    for tier, seconds_list in sorted(night.restore_s.items()):
        if tier not in TIER_FIELDS:
            continue
        # the restore is the load and one step (the step that closes the incident)
        load = max(0.0, (median(seconds_list) or 0.0) - step)
        latency_field, bandwidths = TIER_FIELDS[tier]
        changes[latency_field] = load
        for bandwidth in bandwidths:
            changes[bandwidth] = INSTANT_BPS
        figures[f"load_{tier}_s"] = _figure(round(load, 3), "measured",
                                            f"median of {len(seconds_list)} restores, less a step")
    unmeasured = sorted(t for t in TIER_FIELDS if f"load_{t}_s" not in figures)
    figures["other_loads"] = _figure(unmeasured, "assumed", "the cost model's tiers at the model size")
    agents = Agents()
    hang = median(night.hang_detect_s)
    if hang is not None:
        agents = replace(agents, hang_detect_s=hang)
    figures["hang_detect_s"] = _figure(agents.hang_detect_s, "measured" if hang is not None else "assumed",
                                       "process.hang's seconds_without_progress" if hang is not None
                                       else "the cost model's agent watchdog")
    timeout = median(night.collective_timeout_s)
    if timeout is not None:
        agents = replace(agents, collective_timeout_s=timeout)
    figures["collective_timeout_s"] = _figure(agents.collective_timeout_s,
                                              "measured" if timeout is not None else "assumed",
                                              "network.collective_timeout's timeout_s" if timeout is not None
                                              else "NCCL's default")
    not_ready = node_not_ready_s if node_not_ready_s is not None else median(night.not_ready_s)
    if not_ready is not None:
        agents = replace(agents, node_not_ready_s=not_ready)
    figures["node_not_ready_s"] = _figure(
        round(agents.node_not_ready_s, 3), "given" if node_not_ready_s is not None else "assumed",
        "--node-not-ready-s" if node_not_ready_s is not None else
        "a host's death is not in the log: it died just after its ranks' last report (the log bounds it between that "
        "and node.not_ready), set with --node-not-ready-s" if not_ready is not None
        else "a host's death is not in the log: the platform's grace before not ready")
    silent = sum(1 for d in cluster.drafts if d.silent)
    if silent:  # the log shows when the rank last spoke, not when it hung
        figures["silent_hang_at"] = _figure("its last report", "assumed",
                                            f"{silent} rank(s) found by their silence hung just after their last "
                                            f"report (the log bounds it between that and the next one due)")
    return Calibration(training=replace(training, step_time_s=step), costs=replace(costs, **changes),
                       agents=agents, figures=figures)

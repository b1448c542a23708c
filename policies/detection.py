"""Built-in detection policy: fault-code tables, debouncing, frequency escalation and a watchdog.

A bad step is a loss the script reported that is NaN or infinite, or more than `loss_spike_factor` times the median
of the job's recent losses (`loss_window` of them, once `loss_min_samples` are known): the state is poisoned from
that step on, and the fault says so (`Fault.bad_step`), so that the job rolls back to a checkpoint before it.

Hangs are found from the job's own rhythm rather than the collective timeout (NCCL's 10 minutes,
HCCL's 30): a rank silent for `hang_silence_factor` step times (at least `hang_min_silence_s`), or a
job whose step has not advanced for `stall_factor` step times, is a fault within seconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field

from events import kinds
from events.health import NodeChecked
from events.values import Factor, FaultClass, Flag, Interval, PositiveCount, Seconds
from policies.base import (
    LOSS_HISTORY,
    NS,
    Clear,
    DetectionPolicyBase,
    Drain,
    Fault,
    Ignore,
    LossSample,
    Params,
    Signal,
    Suspect,
    Verdict,
    WatchdogView,
)
from policies.codes import Action, CodeMeaning, ascend_fault, exit_status, nvidia_xid


class DefaultDetectionParams(Params):
    frequency_window_s: Interval = Field(24 * 3600.0, description="window of the frequency counts: 1 ms .. 30 days")
    frequency_threshold: PositiveCount = Field(3, description="faults of one device in the window (any job's, from "
                                                              "the cluster's history) -> a lemon: isolate it")
    node_frequency_threshold: PositiveCount = Field(6, description="device faults on one node -> isolate node")
    isolation_s: Interval | None = Field(7 * 86_400.0, description="an isolation ends after this long unless a "
                                                                   "repair or a replacement ended it first (None: "
                                                                   "only those): 1 ms .. 30 days")
    link_debounce_s: Seconds = Field(10.0, description="a link down this long is a fault; up earlier: flap "
                                                       "(0 .. 30 days; 0: at once)")
    not_ready_grace_s: Seconds = Field(20.0, description="a node not ready this long is a fault (0 .. 30 days)")
    nic_error_threshold: PositiveCount = 100
    agent_silence_s: Interval = Field(5.0, description="a node whose agent sent heartbeats and then none for this "
                                                      "long is gone, with its ranks: 1 ms .. 30 days")
    unreachable_is_lost: Flag = Field(True, description="a node whose agent nothing listened for when the daemon "
                                                        "asked (`node.unreachable`: NATS said so three times) is "
                                                        "gone at once, as one silent past `agent_silence_s`")
    hang_min_silence_s: Interval = Field(10.0, description="a rank silent this long at least hangs (one whose process "
                                         "has not spoken yet, still importing, only past `first_steps_s` or the "
                                         "stall bound): 1 ms .. 30 days")
    hang_silence_factor: Factor = Field(5.0, description="... or this many step times if longer: (0, 1000]")
    stall_min_s: Interval = Field(60.0, description="no rank advancing this long at least is a stall: 1 ms .. 30 days")
    stall_factor: Factor = Field(10.0, description="... or this many step times if longer: (0, 1000]")
    first_steps_s: Interval = Field(900.0, description="until the job's step time is measured (two steps after a "
                                                       "start), no progress is a stall only after this long: a first "
                                                       "step may compile, load and warm up for minutes "
                                                       "(1 ms .. 30 days)")
    straggler_window_steps: PositiveCount = Field(20, le=256, description="a straggler is judged on at least this "
                                                                          "many steps of compute times of its own "
                                                                          "and of its peers' in the job's current "
                                                                          "generation (1 .. 256: the engine's tally "
                                                                          "weighs the last 256 to 512)")
    straggler_ratio: Factor = Field(1.5, description="a rank whose mean compute time per step is at least this many "
                                                     "times its peers' median is a straggler: its node is drained at "
                                                     "the next complete checkpoint when a spare is free: (0, 1000]")
    straggler_min_excess_s: Seconds = Field(0.05, description="... and at least this much slower per step, so that "
                                                              "the noise of steps of a few ms drains nothing "
                                                              "(0 .. 30 days)")
    loss_checks: Flag = Field(True, description="a reported loss that is NaN, infinite or a spike is a bad step: "
                                                 "roll the job back to the newest checkpoint before it")
    loss_spike_factor: Factor = Field(10.0, description="a loss above this many times the median of the recent "
                                                        "ones is a spike: (0, 1000]")
    loss_window: PositiveCount = Field(32, le=LOSS_HISTORY, description="the recent losses (one per report: the "
                                                                        "median of its ranks') whose median a "
                                                                        "spike is measured against: 1 .. 256")
    loss_min_samples: PositiveCount = Field(8, le=LOSS_HISTORY, description="no spike is judged before this many "
                                                                            "losses are known (only NaN and inf): "
                                                                            "1 .. 256")


def _in_window(times: tuple[int, ...], now: int, window: int) -> int:
    return sum(1 for t in times if now - t <= window)


class DefaultDetection(DetectionPolicyBase):
    name: ClassVar[str] = "default"
    version: ClassVar[str] = "11"  # 2: sub-health drains at the next checkpoint; 3: a silent node is a node fault;
    # 4: a fault of a device no rank uses marks it (and a node-level fix moves the node's ranks); 5: first_steps_s;
    # 6: a lemon is isolated only when a spare can replace it or the job can do without it, for isolation_s; a
    # fault a device reset clears says so; 7: a stock script (no SDK) is never silent nor stalled; 8: a straggler's
    # node is drained (a loss check is no new version: no log before it holds a loss, so no decision of one
    # changes); 9: a rank's collective timeout with every rank alive is a network fault of the job (a retry first);
    # 10: a node that joins again (rebooted, repaired) clears its pending not-ready suspicion, as a ready one does
    # (an unreachable node is gone at once: no new version either, no log before it holds a `node.unreachable`);
    # 11: a rank whose process has not spoken yet is silent only past the first steps' (or the stall) bound (a failed
    # health check moves the node's ranks: no new version, no log before it holds a `node.checked`)

    parameters = DefaultDetectionParams
    params: DefaultDetectionParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        # Its own model, not `self.parameters`: a subclass may take other parameters and pass these on.
        self.params = p = DefaultDetectionParams.model_validate(dict(params or {}))
        self._window = int(p.frequency_window_s * NS)
        self._debounce = int(p.link_debounce_s * NS)
        self._grace = int(p.not_ready_grace_s * NS)
        self._isolation = None if p.isolation_s is None else int(p.isolation_s * NS)

    # -- events ---------------------------------------------------------------------------------------
    def classify(self, signal: Signal) -> Verdict:
        data = signal.data
        if isinstance(data, kinds.DeviceFault):
            return self._device(signal, data)
        if isinstance(data, LossSample):
            return self._loss(signal, data)
        if isinstance(data, kinds.ProcessExited):
            meaning = exit_status(data.exit_code, data.signal)
            code = f"exit={data.exit_code},sig={data.signal}"
            if meaning.fault_class is FaultClass.PREEMPTION:
                # SIGTERM from outside is the platform stopping the job (ModelArts graceful exit): every
                # rank goes, each saving its dying checkpoint on the way out.
                return Fault(f"rank {data.rank}: {meaning.description}", FaultClass.PREEMPTION,
                             "job", tuple(range(signal.world)), code=code)
            verdict = self._from_meaning(meaning, signal, "rank", code=code)
            said = f": {data.error.summary()}" if data.error is not None else ""  # the script's own words
            if isinstance(verdict, Ignore):
                return Ignore(f"rank {data.rank}: {verdict.reason}{said}", code=code)
            return Fault(f"rank {data.rank}: {verdict.reason}{said}", verdict.fault_class, verdict.scope,
                         verdict.ranks, lost=verdict.lost, code=code)
        if isinstance(data, kinds.HangReport):
            if data.cause:  # a stock script's rank, seen from outside: say what was seen
                return Fault(f"rank {data.rank} hangs: {data.cause}", FaultClass.HANG, "rank", signal.ranks)
            return Fault(f"rank {data.rank} reports no progress for {data.seconds_without_progress:.0f}s",
                         FaultClass.HANG, "rank", signal.ranks)
        if isinstance(data, kinds.CollectiveTimeout):
            return self._collective(signal, data)
        if isinstance(data, kinds.CollectiveFailed):
            return self._collective_failed(signal, data)
        if isinstance(data, kinds.LinkDown):
            return Suspect(Fault(f"link {data.link} down on {signal.node}", FaultClass.NETWORK, "link",
                                 signal.ranks, signal.node, lost=False),
                           key=f"link:{signal.node}:{data.link}", confirm_after_ns=self._debounce)
        if isinstance(data, kinds.LinkUp):
            return Clear(f"link {data.link} up on {signal.node}", key=f"link:{signal.node}:{data.link}")
        if isinstance(data, kinds.NicErrors):
            if data.errors < self.params.nic_error_threshold:
                return Ignore(f"{data.errors} NIC errors, below {self.params.nic_error_threshold}")
            return Suspect(Fault(f"{data.errors} NIC errors on {data.link}", FaultClass.NETWORK, "link",
                                 signal.ranks, signal.node, lost=False),
                           key=f"link:{signal.node}:{data.link}", confirm_after_ns=self._debounce)
        if isinstance(data, kinds.NodeNotReady):
            return Suspect(Fault(f"node {signal.node} not ready: {data.reason}".rstrip(": "),
                                 FaultClass.NODE, "node", signal.ranks, signal.node, needs_move=True),
                           key=f"node:{signal.node}", confirm_after_ns=self._grace)
        if isinstance(data, kinds.NodeReady):
            return Clear(f"node {signal.node} ready", key=f"node:{signal.node}")
        if isinstance(data, kinds.NodeJoined):
            # The engine takes a joined node as ready (it has booted since): a not-ready suspicion of it must not be
            # confirmed after it came back.
            return Clear(f"node {signal.node} joined again", key=f"node:{signal.node}")
        if isinstance(data, kinds.NodeDrained):
            # The node is being taken away but its processes still run: they can save before leaving.
            return Fault(f"node {signal.node} drained: {data.reason}".rstrip(": "),
                         FaultClass.PREEMPTION, "node", signal.ranks, signal.node, lost=False,
                         needs_move=True)
        if isinstance(data, NodeChecked):
            if data.ok:
                return Ignore(f"node {signal.node} passed its health checks ({data.when})")
            # Its agent found it unable to train (`events.health`): the ranks it holds or was to start go elsewhere.
            return Fault(f"node {signal.node} failed its health checks: {data.summary()}", FaultClass.NODE, "node",
                         signal.ranks, signal.node, needs_move=True, code="health_check")
        return Ignore(f"{signal.type} needs no action")

    def _loss(self, signal: Signal, sample: LossSample) -> Verdict:
        p = self.params
        where = f"at step {sample.step} on rank {sample.rank}"
        if not p.loss_checks:
            return Ignore("loss checks are off")
        if not math.isfinite(sample.loss):
            what = "nan" if math.isnan(sample.loss) else "inf" if sample.loss > 0 else "-inf"
            return self._bad_step(f"loss {what} {where}", signal, sample)
        recent = signal.losses[-p.loss_window:]
        if len(recent) < p.loss_min_samples:
            return Ignore(f"loss {sample.loss:.6g} {where}: {len(recent)} of {p.loss_min_samples} losses known")
        median = statistics.median(recent)
        if median > 0 and sample.loss > p.loss_spike_factor * median:
            return self._bad_step(f"loss {sample.loss:.6g} {where}: a spike, {sample.loss / median:.3g} times the "
                                  f"median {median:.6g} of the last {len(recent)}", signal, sample)
        return Ignore(f"loss {sample.loss:.6g} {where}")

    @staticmethod
    def _bad_step(reason: str, signal: Signal, sample: LossSample) -> Fault:
        # The all-reduce spreads one rank's bad gradients to every replica: the whole job's state is poisoned.
        return Fault(reason, FaultClass.BAD_STEP, "job", tuple(range(signal.world)), lost=False,
                     bad_step=sample.step)

    def _device(self, signal: Signal, data: kinds.DeviceFault) -> Verdict:
        if data.vendor == "nvidia":
            meaning, code = nvidia_xid(data.code), f"XID {data.code}"
        elif data.vendor == "ascend":
            meaning, code = ascend_fault(data.code), f"Ascend {data.code}"
        elif data.ecc_dbe:
            meaning = CodeMeaning(FaultClass.DEVICE, Action.RESET_DEVICE, "uncorrectable ECC error")
            code = "ECC DBE"
        else:
            meaning = CodeMeaning(FaultClass.DEVICE, Action.RESTART_PROCESS, data.message or "device error")
            code = data.code
        if meaning.action is Action.IGNORE:
            return Ignore(f"{code}: {meaning.description}", code=code)
        p = self.params
        on_device = _in_window(signal.device_fault_times, signal.ts, self._window)
        on_node = _in_window(signal.node_fault_times, signal.ts, self._window)
        where = f"{signal.node} device {data.device}"
        lemon = None
        if on_node >= p.node_frequency_threshold:
            lemon = f"{on_node} device faults on the node within {p.frequency_window_s:.0f}s: a lemon node"
        elif on_device >= p.frequency_threshold:
            lemon = f"{on_device} faults of the device within {p.frequency_window_s:.0f}s: a lemon device"
        if lemon is not None:
            # Isolating a lemon takes it away for good (until a repair, a replacement or the expiry): worth it only
            # if the job loses nothing by it: a spare takes its place, the job can shrink, or no rank of it is there.
            scope: Any = "node" if on_node >= p.node_frequency_threshold else "device"
            unused = not (signal.node_ranks if scope == "node" else signal.ranks)
            replaceable = unused or signal.can_shrink or (
                signal.spares_available is None or signal.spares_available > 0)
            if replaceable:
                because = ("no rank of the job on it" if unused else
                           f"{signal.spares_available} spare(s) can replace it" if signal.spares_available else
                           "the job can shrink without it" if signal.can_shrink else "spares unknown")
                return Fault(f"{code} on {where}: {lemon}: isolate {scope} ({because})", FaultClass.DEVICE, scope,
                             signal.ranks, signal.node, data.device, needs_move=True, isolate=scope, code=code,
                             isolate_for_ns=self._isolation)
            note = f"; {lemon}, not isolated: no spare to replace it and the job cannot shrink"
        else:
            note = ""
        if meaning.action is Action.DRAIN and signal.ranks:
            return Drain(f"{code} on {where}: {meaning.description}: leave it at the next checkpoint{note}",
                         signal.node or "", data.device, code=code)
        if meaning.action is Action.WATCH or meaning.action is Action.DRAIN:
            return Ignore(f"{code} on {where}: {meaning.description} ({on_device} of "
                          f"{p.frequency_threshold} in window){note}", code=code)
        if not signal.ranks:
            if meaning.fault_class is FaultClass.NODE and signal.node_ranks:
                # The fix takes the whole node (a power cycle after a GPU fell off the bus): the job's ranks there
                # go with it, although none runs on the faulty device.
                return Fault(f"{code} on {where}: {meaning.description}: the job's ranks on the node must "
                             f"leave it", FaultClass.NODE, "node", signal.node_ranks, signal.node,
                               data.device, lost=True, needs_move=True, code=code)
            if meaning.action in (Action.RESET_DEVICE, Action.ISOLATE_DEVICE, Action.ISOLATE_NODE):
                # Nobody's rank is on it, but nobody's may be placed on it either until it recovers: a fault with no
                # ranks marks the hardware and opens no incident.
                isolate = "node" if meaning.action is Action.ISOLATE_NODE else None
                return Fault(f"{code} on {where}: {meaning.description}: out of service until it "
                             f"recovers", meaning.fault_class, "device", (), signal.node, data.device,
                               lost=False, needs_move=True, isolate=isolate, code=code)
            return Ignore(f"{code} on {where}: no rank of this job on it", code=code)
        verdict = self._from_meaning(meaning, signal, "device", code=code)
        if isinstance(verdict, Ignore):
            return Ignore(f"{code} on {where}: {meaning.description}", code=code)
        return replace(verdict, reason=f"{code} on {where}: {meaning.description}{note}", node=signal.node,
                       device=data.device, code=code)

    def _from_meaning(self, meaning: CodeMeaning, signal: Signal, scope: Any, code: str) -> Ignore | Fault:
        if meaning.action is Action.IGNORE or meaning.fault_class is None:
            return Ignore(meaning.description, code=code)
        fc = meaning.fault_class
        action = meaning.action
        if action is Action.RETRY:
            return Fault(meaning.description, fc, scope, signal.ranks, signal.node, lost=False, code=code)
        needs_move = action in (Action.RESET_DEVICE, Action.ISOLATE_DEVICE, Action.ISOLATE_NODE)
        isolate = {Action.ISOLATE_DEVICE: "device", Action.ISOLATE_NODE: "node"}.get(action)
        # A reset clears the device's own faults (XID 48, an NVLink error), not a GPU that left the bus (NODE).
        reset_clears = action is Action.RESET_DEVICE and fc in (FaultClass.DEVICE, FaultClass.NETWORK)
        return Fault(meaning.description, fc, "node" if isolate == "node" else scope, signal.ranks,
                     signal.node, lost=True, needs_move=needs_move, isolate=isolate, code=code,  # type: ignore[arg-type]
                     reset_clears=reset_clears, isolate_for_ns=self._isolation if isolate else None)

    def _collective(self, signal: Signal, data: kinds.CollectiveTimeout) -> Verdict:
        reporters = set(data.reporters)
        waited_for = tuple(r for r in sorted(set(data.members)) if r not in reporters)
        if waited_for:
            # The members that did not time out are the ones the others were waiting for.
            return Fault(f"{data.operation} on {data.group} timed out; ranks {list(waited_for)} "
                         f"never joined", FaultClass.HANG, "rank", waited_for)
        return Fault(f"{data.operation} on {data.group} timed out on every member: network",
                     FaultClass.NETWORK, "job", tuple(sorted(set(data.members))), lost=False)

    def _collective_failed(self, signal: Signal, data: kinds.CollectiveFailed) -> Verdict:
        where = f"rank {data.rank}: {data.operation} of step {data.step} in generation {data.attempt} timed out"
        if signal.dead:
            # A dead peer's exit is the fault, and its restart re-forms the group: the timeout is only its echo.
            return Ignore(f"{where}; ranks {list(signal.dead)} are gone, whose exit is the fault")
        # Every process lives: nothing says which peer is to blame (a transient network fault, a peer late past the
        # group's timeout). The group is formed again and the step done again, no process restarted: the network
        # ladder's first rung, `retry`; a retry that fails goes up the ladder.
        return Fault(f"{where}, every rank alive: the group failed, not a process", FaultClass.NETWORK, "job",
                     tuple(range(signal.world)), lost=False, code="collective_timeout")

    # -- watchdog -------------------------------------------------------------------------------------
    def check(self, view: WatchdogView) -> list[Verdict]:
        p = self.params
        step_time = view.step_time_ns or 0
        silence = max(int(p.hang_min_silence_s * NS), int(p.hang_silence_factor * step_time))
        stall = (max(int(p.stall_min_s * NS), int(p.stall_factor * step_time)) if view.step_time_ns
                 else int(p.first_steps_s * NS))
        lost = _silent_agents(view, int(p.agent_silence_s * NS))
        unreachable = sorted(view.unreachable.difference(lost)) if p.unreachable_is_lost else []
        if lost or unreachable:
            # Everything a node's ranks say goes through its agent: with the agent silent (or nothing listening for
            # it) they are as good as gone, whether the host died or only the agent did. Move them now.
            lost = sorted((*lost, *unreachable))
            names = [view.nodes[i] for i in lost]
            rpn = view.ranks_per_node
            ranks = tuple(r for i in lost for r in range(i * rpn, (i + 1) * rpn) if r < view.world)
            how = (f"silent for more than {p.agent_silence_s:g}s" if not unreachable else
                   "unreachable (nothing listens for it)" if len(unreachable) == len(lost) else
                   f"silent for more than {p.agent_silence_s:g}s or unreachable")
            return [Fault(f"agent of {', '.join(names)} {how}: the host or its agent is gone", FaultClass.NODE,
                          "node", ranks, names[0] if len(names) == 1 else None)]
        if not view.sdk or view.recovering:
            # A stock script sends no heartbeats and reports no steps: its silence is no sign of a hang. Its exits
            # and its agents' heartbeats are what tell of it. Nor is a recovering job's: its ranks are being
            # stopped and started.
            return []
        # Each test first asks the columns' min or max (C speed): a rank at a time only when one may be found.
        now, seen, progress, steps = view.now, view.last_seen, view.last_progress, view.steps
        silent: tuple[int, ...] = ()
        how = f"silent for more than {silence / NS:.1f}s"
        if seen and now - min(seen) > silence:
            silent = tuple(r for r, at in enumerate(seen) if now - at > silence)
            if silent and view.spoke is not None:
                # A process that has not spoken yet may still be importing its framework (seconds apart between
                # ranks on a loaded host, minutes on a cold shared filesystem): it hangs only past the bound the
                # job's first steps get, as the peers waiting for it in their first collective would.
                first, spoke = max(silence, stall), view.spoke
                silent = tuple(r for r in silent if spoke[r] or now - seen[r] > first)
                if silent and not any(spoke[r] for r in silent):
                    how = f"not heard since their processes started, more than {first / NS:.1f}s"
        if silent:
            gone = _silent_nodes(view, set(silent))
            if gone and all(r // view.ranks_per_node in gone for r in silent):
                # Every rank of a node fell silent at once: the host or its agent is gone, not one process. Move
                # the ranks now rather than restart them in place on a host that may not answer.
                names = [view.nodes[i] for i in sorted(gone)]
                return [Fault(f"all ranks on {', '.join(names)} {how}: the host or its agent is gone",
                              FaultClass.NODE, "node", silent, names[0] if len(names) == 1 else None)]
            return [Fault(f"ranks {list(silent)} {how}", FaultClass.HANG, "rank", silent)]
        newest = max(progress, default=now)
        if now - newest > stall:
            return [Fault(f"no rank advanced for {(now - newest) / NS:.1f}s",
                          FaultClass.HANG, "job", tuple(range(view.world)))]
        top = max(steps, default=0)
        behind: tuple[int, ...] = ()
        if steps and min(steps) < top and now - min(progress) > stall:
            behind = tuple(r for r, (step, at) in enumerate(zip(steps, progress, strict=True))
                           if step < top and now - at > stall)
        if behind:
            return [Fault(f"ranks {list(behind)} stuck behind step {top} for more than "
                          f"{stall / NS:.1f}s", FaultClass.HANG, "rank", behind)]
        return self._stragglers(view)

    def next_check(self, view: WatchdogView) -> int | None:
        """The earliest log time at which `check` could find what it does not find at `view.now` if nothing more is
        heard of the job (None: never by time alone). The engine's watchdog ticks then, not every interval, while the
        job's progress summaries come (`recovery.core.detection.Detection.watch`). `agents_heard` holds None for an
        agent watched off the log: its silence is a record of its own, never a deadline. Stragglers are judged on
        what the ranks report, never on time: a record, not a tick, brings them. Each bound mirrors one of `check`'s:
        `now - at > bound` first holds at `at + bound + 1`."""
        p = self.params
        deadlines: list[int] = []
        heard = [at for at in view.agents_heard if at is not None] if len(view.agents_heard) == len(view.nodes) else []
        if heard:
            deadlines.append(min(heard) + int(p.agent_silence_s * NS) + 1)
        if view.sdk and not view.recovering and view.last_seen:
            step_time = view.step_time_ns or 0
            silence = max(int(p.hang_min_silence_s * NS), int(p.hang_silence_factor * step_time))
            stall = (max(int(p.stall_min_s * NS), int(p.stall_factor * step_time)) if view.step_time_ns
                     else int(p.first_steps_s * NS))
            progress, steps = view.last_progress, view.steps
            spoke = view.spoke
            if spoke is None:
                deadlines.append(min(view.last_seen) + silence + 1)
            else:  # the ranks yet to speak by the first steps' bound, as `check` judges them
                first = max(silence, stall)
                deadlines.append(min(at + (silence if said else first)
                                     for at, said in zip(view.last_seen, spoke, strict=True)) + 1)
            deadlines.append(max(progress) + stall + 1)
            top = max(steps)
            if min(steps) < top:  # ranks behind: the stall of the one that advanced longest ago
                deadlines.append(min(at for step, at in zip(steps, progress, strict=True) if step < top) + stall + 1)
        return min(deadlines, default=None)

    def _stragglers(self, view: WatchdogView) -> list[Verdict]:
        """A drain of each node that holds a rank persistently slower than its peers. In synchronous data
        parallelism every rank waits for the slowest in the collective, so one slow GPU or throttled host slows the
        whole job without a fault: its compute time (before the collective) is what shows it. Judged on the engine's
        tally of the rank's recent steps (the last few hundred: `WatchdogView.compute_ns`), once the rank and at
        least one peer measured `straggler_window_steps`."""
        p = self.params
        world, window = view.world, p.straggler_window_steps
        if not view.nodes or len(view.nodes) * view.ranks_per_node != world:
            return []  # the placement is unknown: no node to drain
        counts, spent = view.compute_steps, view.compute_ns
        if world < 2 or max(counts) < window:
            return []  # no rank measured the window yet (most checks of a job that reports no compute time)
        means = [ns // steps for steps, ns in zip(counts, spent, strict=True) if steps >= window]
        if len(means) < 2:
            return []
        means.sort()
        # The ranks judged are the slowest, from the slowest down, until one is within the ratio of its peers'
        # median. Removing any rank above the middle lowers the median the most, so a rank below the ratio of the
        # median without the slowest rank is below it for every peer median: only ranks at or above it can be drains.
        top = len(means) - 1
        floor = p.straggler_ratio * _median_without(means, top)
        slow = sorted((ns // steps, rank, steps) for rank, (steps, ns) in enumerate(zip(counts, spent, strict=True))
                      if steps >= window and ns // steps >= floor)
        drains: dict[str, Drain] = {}
        for k in reversed(range(len(slow))):  # slowest first; the k-th of `slow` is the (top - ...)-th of all means
            mean, rank, steps = slow[k]
            median = _median_without(means, top - (len(slow) - 1 - k))
            if mean < p.straggler_ratio * median:
                break  # every rank from here on is faster still
            if mean - median < p.straggler_min_excess_s * NS:
                continue
            node = view.nodes[rank // view.ranks_per_node]
            if node in drains:
                continue  # one drain per node: its slowest rank speaks for it
            drains[node] = Drain(f"rank {rank} on {node} computes {mean / NS:.3f}s per step over {steps} steps, "
                                 f"{mean / max(median, 1):.1f}x its peers' median {median / NS:.3f}s (straggler "
                                 f"ratio {p.straggler_ratio:g}): leave it at the next checkpoint", node,
                                 code="straggler", evidence=(("rank", rank), ("compute_s", round(mean / NS, 6)),
                                                             ("peers_median_s", round(median / NS, 6)),
                                                             ("steps", steps)))
        return [drains[node] for node in sorted(drains, key=view.nodes.index)]


def _median_without(means: list[int], position: int) -> int:
    """The median of `means` (sorted) without its entry at `position`: the peers' median, in O(1)."""
    count = len(means) - 1

    def peer(k: int) -> int:  # the k-th smallest mean of the others
        return means[k if k < position else k + 1]

    half = count // 2
    return peer(half) if count % 2 else (peer(half - 1) + peer(half)) // 2


def _silent_agents(view: WatchdogView, silence: int) -> list[int]:
    """Indices of the nodes whose agent sent heartbeats and has been silent longer than `silence`."""
    if len(view.agents_heard) != len(view.nodes):
        return []
    return [i for i, heard in enumerate(view.agents_heard) if heard is not None and view.now - heard > silence]


def _silent_nodes(view: WatchdogView, silent: set[int]) -> set[int]:
    """Indices of the nodes all of whose ranks are silent (none when the placement is unknown)."""
    rpn = view.ranks_per_node
    if rpn < 2 or not view.nodes or rpn * len(view.nodes) != view.world:
        return set()  # with one rank per node a silent host and a silent process look the same
    return {i for i in range(len(view.nodes)) if all(r in silent for r in range(i * rpn, (i + 1) * rpn))}

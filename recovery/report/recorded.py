"""What a recorded log says about its cluster, its job, its faults and its night, for the what-if.

One pass over the log keeps what the cluster did on its own (the job's shape and policies from `job.submitted`, the
nodes and spares, the faults: device faults, links going down and up, hosts going away, and the process exits and
hangs the recorded engine took as fault signals; with a SIGTERM exit, the preemption's other exits and the dying
checkpoint its handlers saved unasked; with a collective timeout, who reported it and after how long) and measures
what its answers took (each command's time from the decision to its `done` ack, each restore's time from
`ranks.restoring` to the step that closed the incident, each persistent checkpoint's time from its step to
`checkpoint.saved`, the agents' detection delays that the events state). It also keeps the recorded sequence of
recovery decisions and what the simulator cannot re-create (executors that failed or never answered, operator
commands, fault signals no `Fault` stands for), which is why a what-if under the recorded policies may not
reproduce the night. What the ranks said of themselves (their steps, compute times and losses, and the straggler
or bad step the engine found in them) is read by its base, `recovery.report.rank_reports`; what the job's nodes said
before its submission (the cluster's history, which the engine counted) by `recovery.report.history`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from events.values import Layout
from recovery.report.history import ClusterPast
from recovery.report.night import Draft, Night, RecordedCluster, RecoveryDecision, faults_of, history_of, median
from recovery.report.rank_reports import PENDING_RECORDS, RankReports
from recovery.report.source import RawDict
from recovery.sim.answers import DONE, FAILED, SILENT, RecordedAnswer, answer_kind
from recovery.sim.config import NS, Agents
from recovery.sim.faults import FOLLOW_UPS, Collective, CollectiveFailure

__all__ = ["Draft", "Night", "RecordedCluster", "RecoveryDecision", "faults_of", "history_of", "median",
           "read_recorded"]

SIGNAL_DECISIONS = frozenset({"fault.confirmed", "faults.confirmed_together", "fault.added", "fault.suspected",
                              "fault.absorbed"})
"""decisions that say the engine took their cause as a fault signal (not as the echo of its own command)"""
OPENING_DECISIONS = frozenset({"fault.confirmed", "faults.confirmed_together", "fault.added", "node.drain_planned"})
"""decisions that open an incident or add a fault to it: a cause they name that no `Fault` stands for is a fault
the simulated night does not have"""
SIGTERM = 15
"""the signal a platform stops a job with (Linux's number, as the agents report it)"""
PREEMPTION_S = 5.0
"""SIGTERM exits and uncommanded dying checkpoints this close to a kept SIGTERM exit are the same preemption's: the
platform stops every rank at once and their handlers save on the way out"""
CAUSED_BY_DEVICE_S = 5.0
"""a process exit this soon after a fault of its own device is that fault's crash, which the simulator re-creates"""
RECOVERY_DECISIONS = frozenset({"attempt.started", "attempt.failed", "attempt.timed_out", "incident.closed",
                                "job.failed", "job.completed", "job.cancelled"})
"""the decisions a reproduction must repeat, in order: each attempt with its granularity, how attempts ended, and
the job's recoveries and end"""
TIER_OF_LOAD = {"memory": "memory", "peer": "peer", "local": "local", "dying": "storage", "storage": "storage"}
"""the simulator's cost of loading from each recorded tier (a dying checkpoint is read from shared storage)"""


class _Reader(RankReports):
    """One pass over the recorded log, keeping the job's shape, its faults and what its recoveries took."""

    def __init__(self, job: str | None, agents: Agents) -> None:
        super().__init__()
        self.job = job
        self.agents = agents
        self.joined: dict[str, bool] = {}
        """node -> joined as a spare, in the order they joined (before the job: the simulator's cluster)"""
        self.past = ClusterPast()
        """the node events before the job's submission: the cluster's history"""
        self.pending: dict[int, tuple[Draft, str]] = {}
        self.open: dict[str, list[Draft]] = {}
        """node -> faults waiting for the node (or its device or link) to come back"""
        self.device_faults: dict[tuple[str, int], int] = {}
        self.device_codes: dict[tuple[str, int], str] = {}
        """(node, device) -> the code of its last fault"""
        self.last_ts = 0
        self.others: set[str] = set()
        self.fault_seqs: set[int] = set()
        """records kept as faults, or as the echo of one the simulator re-creates (a crash after its XID)"""
        self.inputs: dict[int, str] = {}
        """recent input records by sequence: what an incident-opening decision's cause was"""
        self.commands: dict[str, tuple[str, int, int]] = {}
        """command id -> (kind, when decided, its order among the commands of its kind), while unanswered"""
        self.issued: dict[str, int] = {}
        self.accepted: dict[str, float] = {}
        """command id -> seconds from its decision to its accepted ack, until it is done"""
        self.tiers: list[str] = []
        """the current incident's checkpoint plan: the tiers its ranks load from"""
        self.restoring: int | None = None
        self.saving: dict[str, frozenset[int]] = {}
        """dying checkpoint saves the engine commanded that have not finished, and the shards their ranks hold: a
        dying checkpoint of those shards meanwhile is theirs (of others, a SIGTERM handler's)"""
        self.handler_saves: list[tuple[int, tuple[int, ...]]] = []
        """recent dying checkpoints nobody commanded (ts, shards): SIGTERM handlers', kept for the exit they go with"""
        self.death_given = False
        self.failing: Draft | None = None
        """the kept collective failure whose incident is open: the same group's further reports join it, and those
        of its step failing again after a retry"""
        self.failing_step: Any = None
        self.steps_of: dict[int, Any] = {}
        self.sigterm: Draft | None = None
        """the kept SIGTERM exit whose incident is open: its preemption's further exits and saves join it"""

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
        # spares that joined later are the simulated cluster's too: what they said before the job, the engine heard
        self.cluster.history = self.past.of(self.cluster.nodes + self.cluster.spares)
        self.paces()
        return self.cluster

    def input(self, record: RawDict) -> None:
        env = record["envelope"]
        kind: str = env.get("type", "?")
        ts: int = record["ts"]
        job, node = env.get("job"), env.get("node")
        data: dict[str, Any] = env.get("data") or {}
        cluster = self.cluster
        if cluster is None:
            if node is not None:
                self.past.heard(record, node, kind)
            if kind == "node.joined" and node is not None:
                self.joined.setdefault(node, bool(data.get("spare")))
            elif kind == "job.submitted" and (self.job is None or job == self.job):
                spec = data["spec"]
                self.placement = list(spec["nodes"])
                spares = [n for n, spare in self.joined.items() if spare and n not in self.placement]
                self.cluster = RecordedCluster(job=job, spec=spec, nodes=list(self.placement), spares=spares,
                                               start=ts, end=ts,
                                               history_left=self.past.left_on(self.placement + spares))
                self.job = job
            return
        if job is not None and job != cluster.job:
            self.others.add(job)
            return
        self.inputs[record["seq"]] = kind
        if len(self.inputs) > 2 * PENDING_RECORDS:
            del self.inputs[next(iter(self.inputs))]
        self.expire(record["seq"])
        self.expire_losses(record["seq"])
        if kind == "job.started":
            if not cluster.started:  # the simulated run starts where the recorded job first started
                cluster.started, cluster.start = True, ts
            self.count("resimulated", kind)
        elif kind == "progress.step":
            self.progress_step(record["seq"], data, ts)
        elif kind == "progress.report":
            self.progress_report(record["seq"], data, ts)
        elif kind == "process.heartbeat":
            self.heard_from(data.get("rank"), ts)
            self.count("resimulated", kind)
        elif kind == "checkpoint.saved":
            tier = data.get("tier")
            shards = tuple(data.get("shards") or [])
            commanded = any(set(shards) <= held for held in self.saving.values())
            if tier == "dying" and not commanded and self.handler_save(ts, shards):
                return  # kept with the SIGTERM exit it goes with
            if tier in ("storage", "memory") and not self.recovering:  # a save while it recovers is off its cadence
                steps = cluster.storage_steps if tier == "storage" else cluster.memory_steps
                if not steps or steps[-1] != data["step"]:
                    steps.append(int(data["step"]))
                    del steps[:-1000]
                    if tier == "storage":
                        self.storage_saved(int(data["step"]), ts)
            self.count("resimulated", kind)
        elif kind == "command.ack":
            self.ack(data, ts)
            self.count("resimulated", kind)
        elif kind == "device.fault" and node is not None:
            self.device_fault(node, data, ts, record["seq"])
        elif kind == "device.recovered" and node is not None:
            self.back(node, ts, "device")
            self.count("resimulated", kind)
        elif kind == "network.link_down" and node is not None:
            self.fault(Draft(ts, "network", "node", f"network.link_down (seq {record['seq']})"), node, kind,
                       record["seq"])
        elif kind == "network.link_up" and node is not None:
            self.back(node, ts, "network")
            self.count("resimulated", kind)
        elif kind == "node.not_ready" and node is not None:
            if any(d.signal == "network" for d in self.open.get(node, [])):
                self.fault_seqs.add(record["seq"])  # the platform's health check after a link went down: simulated
                self.count("resimulated", kind)
            else:  # the host went away: after its ranks' last report, and the platform noticed after its grace
                at = max(cluster.start, ts - int(self.agents.node_not_ready_s * NS))
                last = self.last_heard(node)
                if last is not None and at <= last <= ts and not self.death_given:
                    # it died just after its ranks' last report: the log bounds it no closer
                    at = last + 1
                    self.night.not_ready_s.append((ts - at) / NS)
                self.fault(Draft(at, "node", "node", f"node.not_ready (seq {record['seq']})"), node, kind,
                           record["seq"])
        elif kind == "node.joined" and node is not None and data.get("spare") and node not in self.joined \
                and node not in self.placement:  # a spare new to the cluster: the simulated one joins it then
            self.joined[node] = True
            cluster.spares.append(node)
            pool = data.get("pool")
            cluster.drafts.append(Draft(ts, "join", "node", f"{kind} (seq {record['seq']})", node=node,
                                        pool=None if pool is None else str(pool)))
            self.count("kept", kind)
        elif kind in ("node.ready", "node.joined") and node is not None:
            self.back(node, ts, None)
            self.count("resimulated", kind)
        elif kind in ("process.exited", "process.hang", "network.collective_timeout", "process.collective_failed") \
                and job is not None:
            self.process_signal(record["seq"], kind, data, ts)
        else:
            if kind.startswith("operator."):  # a person's command: sent to the simulated job at its time
                cluster.drafts.append(Draft(ts, "operator", "job", f"{kind} (seq {record['seq']})",
                                            command=(kind, tuple(sorted(data.items())))))
                self.count("kept", kind)
                return
            if kind in ("job.completed", "job.cancelled"):
                self.night.operator.append(f"{kind} (seq {record['seq']})")
            self.count("resimulated", kind)

    def silence(self, d: dict[str, Any], detail: dict[str, Any]) -> bool:
        """A fault the engine found on its watchdog's tick, by a silence: a hung rank's (its agent said nothing, so
        the simulated rank hangs unreported from just after its last report) or that of a host whose going away is
        kept already. Whether the silence is accounted for."""
        cluster = self.cluster
        assert cluster is not None
        fault = detail.get("fault") if isinstance(detail.get("fault"), dict) else {}
        ranks = [int(r) for r in fault.get("ranks") or [] if isinstance(r, int)]
        if fault.get("class") == "node" and any(d.signal == "node" for d in self.open.get(str(fault.get("node")), [])):
            cluster.night.silences += 1
            return True
        if fault.get("class") != "hang" or len(ranks) != 1 or ranks[0] not in self.heard:
            return False
        rank = ranks[0]
        draft = Draft(self.heard[rank] + 1, "hang", "rank", f"silence of rank {rank} (seq {d['cause_seq']})",
                      position=rank // cluster.rpn, device=rank % cluster.rpn, silent=True)
        cluster.drafts.append(draft)
        cluster.night.silences += 1
        self.count("kept", "silence")
        return True

    def ack(self, data: dict[str, Any], ts: int) -> None:
        issued = self.commands.get(str(data.get("command_id")))
        if issued is None:
            return
        kind, at, nth = issued
        status = data.get("status")
        if status in ("done", "failed"):
            self.saving.pop(str(data.get("command_id")), None)
            del self.commands[str(data.get("command_id"))]
        if status == "accepted":  # the executors' latency once the command is done: a failure replays its own
            self.accepted[str(data.get("command_id"))] = (ts - at) / NS
        elif status == "done":
            self.night.command_s.setdefault(kind, []).append((ts - at) / NS)
            if kind != "dump_stacks":  # simulated processes have no stacks: the simulator never sends one
                self.night.answers.append(RecordedAnswer(kind, nth, DONE, round((ts - at) / NS, 9)))
            if str(data.get("command_id")) in self.accepted:
                self.night.ack_s.append(self.accepted.pop(str(data.get("command_id"))))
        elif status == "failed":
            reason = str(data.get("reason") or "")
            self.night.failed_commands.append(f"{kind.split(':')[0]} failed" + (f": {reason}" if reason else ""))
            result = data.get("result") if isinstance(data.get("result"), dict) else {}
            self.night.answers.append(RecordedAnswer(kind, nth, FAILED, round((ts - at) / NS, 9), reason,
                                                     tuple(sorted(result.items()))))

    def device_fault(self, node: str, data: dict[str, Any], ts: int, seq: int) -> None:
        device, code = int(data.get("device", 0)), str(data.get("code", ""))
        earlier = self.device_faults.get((node, device))
        # only the code that follows the one before it (an XID 63 after a 48) is the simulator's to send: the same
        # code again is a fault of its own, which frequency escalation counts
        follow_up = earlier is not None and FOLLOW_UPS.get(self.device_codes.get((node, device), "")) == code
        self.device_faults[(node, device)] = ts
        self.device_codes[(node, device)] = code
        if follow_up and earlier is not None and ts - earlier <= CAUSED_BY_DEVICE_S * NS:
            self.fault_seqs.add(seq)
            self.count("resimulated", "device.fault")  # the simulator sends the follow-up XID itself
            return
        draft = Draft(ts, "device", "device", f"device.fault XID {code} (seq {seq})", device=device, code=code or None)
        self.fault(draft, node, "device.fault", seq)

    def fault(self, draft: Draft, node: str, kind: str, seq: int) -> None:
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
        self.fault_seqs.add(seq)
        self.count("kept", kind)

    def back(self, node: str, ts: int, signal: str | None) -> None:
        waiting = self.open.get(node, [])
        for draft in waiting:
            if draft.back is None and (signal is None or draft.signal == signal):
                draft.back = ts
        self.open[node] = [d for d in waiting if d.back is None]

    def handler_save(self, ts: int, shards: tuple[int, ...]) -> bool:
        """A dying checkpoint nobody commanded: a SIGTERM handler's, which goes with the kept SIGTERM exit of its
        preemption (or with the next one, if it was saved before the exit was reported). Whether it was kept."""
        sigterm = self.sigterm
        if sigterm is not None and ts >= sigterm.at - int(PREEMPTION_S * NS):
            sigterm.dying.append((ts - sigterm.at, tuple(int(s) for s in shards)))
            self.count("kept", "checkpoint.saved")
            return True
        self.handler_saves = [(t, s) for t, s in self.handler_saves if ts - t <= PREEMPTION_S * NS]
        self.handler_saves.append((ts, tuple(int(s) for s in shards)))
        return False

    def preempted(self, draft: Draft) -> None:
        """A SIGTERM exit was kept as a fault: the handlers' saves just before it are its preemption's."""
        self.sigterm = draft
        before = [(t - draft.at, s) for t, s in self.handler_saves if 0 <= draft.at - t <= PREEMPTION_S * NS]
        draft.dying[:0] = before
        self.handler_saves = []
        for _ in before:  # counted as re-simulated when they came; kept now that their exit is
            self.count("kept", "checkpoint.saved")
            self.uncount("resimulated", "checkpoint.saved")

    def process_signal(self, seq: int, kind: str, data: dict[str, Any], ts: int) -> None:
        assert self.cluster is not None
        night = self.cluster.night
        rank = data.get("rank")
        if kind == "network.collective_timeout":
            self.collective_timeout(seq, data, ts)
            return
        if kind == "process.collective_failed":
            self.collective_failed(seq, data, ts)
            return
        sigterm = self.sigterm
        if (kind == "process.exited" and data.get("signal") == SIGTERM and sigterm is not None
                and isinstance(rank, int) and abs(ts - sigterm.at) <= PREEMPTION_S * NS):
            sigterm.exits.append(rank)  # stopped by the same preemption: the simulator exits it with the first
            self.count("resimulated", kind)
            return
        if not isinstance(rank, int):
            self.count("resimulated", kind)
            return
        node_index = rank // self.cluster.rpn
        device = rank % self.cluster.rpn
        node = self.placement[node_index] if node_index < len(self.placement) else None
        crashed = self.device_faults.get((node, device)) if node is not None else None
        if kind == "process.exited" and crashed is not None and ts - crashed <= CAUSED_BY_DEVICE_S * NS:
            self.fault_seqs.add(seq)
            self.count("resimulated", kind)  # the crash of a faulty device's process: the simulator makes it
            return
        if kind == "process.hang":
            # the agent reports a hang once the rank made no progress for its watchdog's time: the hang began then
            silent = data.get("seconds_without_progress")
            delay = float(silent) if isinstance(silent, int | float) else self.agents.hang_detect_s
            if isinstance(silent, int | float):
                night.hang_detect_s.append(delay)
            draft = Draft(max(self.cluster.start, ts - int(delay * NS)), "hang", "rank",
                          f"{kind} rank {rank} (seq {seq})", position=node_index, device=device)
        else:
            draft = Draft(ts, "process", "rank", f"{kind} rank {rank} (seq {seq})", position=node_index,
                          device=device, exit_code=data.get("exit_code"), exit_signal=data.get("signal"))
        self.pending[seq] = (draft, kind)

    def collective_timeout(self, seq: int, data: dict[str, Any], ts: int) -> None:
        """The peers' report of a collective that timed out: the hang began `timeout_s` before it. With its group
        named, it is replayed as recorded (who reported, who never joined); else as a hang the peers found."""
        assert self.cluster is not None
        kind = "network.collective_timeout"
        timeout = data.get("timeout_s")
        if isinstance(timeout, int | float):
            self.cluster.night.collective_timeout_s.append(float(timeout))
        members, reporters = data.get("members"), data.get("reporters")
        collective = None
        if isinstance(timeout, int | float) and isinstance(members, list) and members and isinstance(reporters, list):
            collective = Collective(str(data.get("group", "")), tuple(int(r) for r in members),
                                    tuple(int(r) for r in reporters), str(data.get("operation", "")), float(timeout))
        since = int(float(timeout) * NS) if collective is not None else int(self.agents.hang_detect_s * NS)
        draft = Draft(max(self.cluster.start, ts - since), "hang", "rank", f"{kind} (seq {seq})",
                      collective=collective)
        self.pending[seq] = (draft, kind)

    def collective_failed(self, seq: int, data: dict[str, Any], ts: int) -> None:
        """A rank's report that its group's collective timed out while it lives. The first one the engine took as a
        fault is kept, from `timeout_s` before it (the collective began then); the other ranks' reports of the same
        group soon after go with it at their offsets (the engine takes them as old news), and so do the reports of
        the same step failing again in a retry's group (the retry did not get past it)."""
        assert self.cluster is not None
        kind, rank, attempt = "process.collective_failed", data.get("rank"), int(data.get("attempt") or 0)
        same = self.failing
        failure = same.failed_collective if same is not None else None
        if same is not None and failure is not None and same.generation is not None and isinstance(rank, int):
            since_first = ts - same.at - failure.reports[0][1]
            same_group = attempt == same.generation and 0 <= since_first <= PREEMPTION_S * NS
            again = attempt > same.generation and data.get("step") == self.failing_step  # a retry's group
            if same_group or again:
                report = (rank, ts - same.at, attempt - same.generation)
                same.failed_collective = replace(failure, reports=(*failure.reports, report))
                self.fault_seqs.add(seq)
                self.count("kept", kind)
                return
        if not isinstance(rank, int):
            self.count("resimulated", kind)
            return
        timeout = float(data["timeout_s"]) if isinstance(data.get("timeout_s"), int | float) else 0.0
        # the step's collective began `timeout_s` before the report: the job got no further from then
        at = max(self.cluster.start, ts - int(timeout * NS))
        failure = CollectiveFailure(((rank, ts - at, 0),), timeout, str(data.get("operation") or "allreduce"),
                                    str(data.get("error") or ""))
        draft = Draft(at, "collective", "rank", f"{kind} rank {rank} (seq {seq})", position=rank // self.cluster.rpn,
                      device=rank % self.cluster.rpn, failed_collective=failure, generation=attempt)
        self.pending[seq] = (draft, kind)
        self.steps_of[seq] = data.get("step")

    def expire(self, seq: int) -> None:
        while self.pending:
            first = next(iter(self.pending))
            if seq - first <= PENDING_RECORDS:
                return
            _, kind = self.pending.pop(first)
            self.count("resimulated", kind)

    def decision(self, record: RawDict, d: dict[str, Any]) -> None:
        cluster = self.cluster
        if cluster is None:  # another job's, before this one's submission
            self.past.decided(record, d)
            return
        if d["job"] != cluster.job:
            return
        kind = d["kind"]
        detail = d.get("detail") or {}
        phase = d.get("phase")
        ts: int = record["ts"]
        if phase is not None and not self.recovering:
            self.recovering = True
        elif phase is None and self.recovering:
            self.recovering = False
            self.last_step = None  # the next report after a recovery starts a new stretch of training
            self.reached, self.saved = {}, set()
        self.night_of(kind, d, detail, ts)
        if kind == "ranks.rescheduling" and detail.get("nodes"):
            self.placed(list(detail["nodes"]), ts)
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
                    if draft.signal == "process" and draft.exit_signal == SIGTERM:
                        self.preempted(draft)
                    elif draft.signal == "collective":
                        self.failing, self.failing_step = draft, self.steps_of.pop(d["cause_seq"], None)
                    self.fault_seqs.add(d["cause_seq"])
                    self.count("kept", input_kind)
                    return
            self.count("resimulated", input_kind)
        if kind in SIGNAL_DECISIONS and self.bad_step(kind, d, detail):
            self.fault_seqs.add(d["cause_seq"])
            return
        if kind == "node.drain_planned" and self.straggler(d, detail, ts):
            return
        if kind in OPENING_DECISIONS and d["cause_seq"] not in self.fault_seqs:
            cause = self.inputs.get(d["cause_seq"], "an earlier record")
            if cause == "timer.fired" and self.silence(d, detail):
                return
            if cause == "timer.fired":
                cause = "a timer (a watchdog's tick: a silence or a straggler; or a suspicion confirmed later)"
            elif cause in ("progress.report", "progress.summary", "progress.step"):
                cause = f"{cause} (the ranks' own reports)"
            self.night.unmatched_signals.append(f"{kind} on {cause} (seq {d['cause_seq']})")

    def night_of(self, kind: str, d: dict[str, Any], detail: dict[str, Any], ts: int) -> None:
        """What the decision tells of the recorded night: its commands (to time their acks), its restore, and the
        recovery decisions a reproduction must repeat."""
        cluster = self.cluster
        assert cluster is not None
        night = cluster.night
        for command in d.get("commands") or []:
            if isinstance(command, dict) and "id" in command:
                ckind = answer_kind(str(command.get("kind", "?")), command.get("mode"),
                                    bool(command.get("reset_devices")))
                self.issued[ckind] = self.issued.get(ckind, 0) + 1
                self.commands[str(command["id"])] = (ckind, ts, self.issued[ckind])
                if command.get("kind") == "save_checkpoint":
                    layout = Layout.model_validate(cluster.spec["layout"])
                    self.saving[str(command["id"])] = frozenset(layout.shard_of(int(r))
                                                                for r in command.get("ranks") or [])
        if kind == "checkpoint.plan" and isinstance(detail.get("tiers"), dict):
            self.tiers = [str(t) for t in detail["tiers"]]
        elif kind == "ranks.restoring":
            self.restoring = ts
        elif kind == "attempt.timed_out":
            night.failed_commands.append(f"attempt {detail.get('attempt', '?')} timed out: an executor never answered")
            # the commands still unanswered at the deadline are those the executors ignored
            night.answers += [RecordedAnswer(k, nth, SILENT) for k, _, nth in self.commands.values()
                              if k not in ("save_checkpoint", "dump_stacks")]  # neither is what an attempt awaits
            self.commands = {}
        if kind == "incident.closed" and self.restoring is not None:
            tiers = [TIER_OF_LOAD.get(t, "storage") for t in self.tiers] or ["none"]
            slowest = max(tiers, key=lambda t: list(TIER_OF_LOAD.values()).index(t) if t in TIER_OF_LOAD else -1)
            night.restore_s.setdefault(slowest, []).append((ts - self.restoring) / NS)
        if kind in ("incident.closed", "job.failed", "job.cancelled", "job.completed"):
            self.restoring, self.tiers, self.sigterm, self.failing, self.bad = None, [], None, None, None
        if kind in RECOVERY_DECISIONS:
            granularity = detail.get("granularity") if kind == "attempt.started" else None
            at = (ts - cluster.start) / NS if cluster.started else 0.0
            night.decisions.append(RecoveryDecision(kind, round(at, 3), None if granularity is None
                                                    else str(granularity)))


def read_recorded(records: Iterable[RawDict], job: str | None = None, agents: Agents | None = None,
                  death_given: bool = False) -> RecordedCluster:
    """The log read for the what-if. `death_given`: a host that went away died `agents.node_not_ready_s` before its
    node.not_ready, as given (else just after its ranks' last report, where the log has one in that grace)."""
    reader = _Reader(job, agents or Agents())
    reader.death_given = death_given
    return reader.read(records)

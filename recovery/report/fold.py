"""The postmortem report, folded from a log one record at a time.

The report reads what the log recorded (inputs and the engine's decisions); it re-derives nothing, so it reads logs
whose policies are not installed and runs at the speed of JSON decoding. Its state is per job and per incident,
never per record: a job's step line is thinned to at most `STEP_POINTS` points, and each decision's cause is looked
up among the last `RECENT_INPUTS` inputs (a decision follows its cause closely in the log). Memory therefore grows
with jobs and incidents, not with the length of the log.

Definitions (also in docs/on-call.md, "report"):

- an incident opens at its first decision with a phase (the fault's confirmation) and closes at `incident.closed`
  (or at the decision that ended the job). Its *first signal* is the earliest of the confirmed fault's own signal,
  any suspicion still open for the job and, for ranks found by their silence, when they were last heard from;
  *detection latency* is first signal to confirmation; *decision latency* is confirmation to the first command of
  the incident; *time to recovery* is first signal to close (the job's first step past its resume point: what
  `python -m recovery.sim` calls TTR).
- each phase lasts from the decision that entered it to the decision that left it; `detection` is the time before
  the confirmation. Lost GPU-hours of an incident: its time by phase times the job's GPUs (one rank per GPU; the
  whole job waits while part of it recovers), plus `recompute`: lost steps times the job's measured step time.
- ETTR of a job: 1 - lost time / its wall time (from `job.started` to its end, or to the last record read).
- a restart loop: an incident that opened before the job got past the step at which the incident before it
  struck (the recovery brought the job back, and it failed again without new progress).
- lemon candidates: nodes (and devices) implicated in faults of two or more incidents, across jobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from events.subjects import unpartitioned
from recovery.report.checks import FailedChecks
from recovery.report.figures import job_report, lemons, mttr, never_ran, restarts, sum_dicts
from recovery.report.onset import onset, silent_nodes
from recovery.report.source import RawDict
from recovery.report.stacks import StackGroups
from recovery.report.state import Incident, JobFold, Phase
from recovery.report.state import seconds as _s

REPORT_VERSION = 1
"""The version of the `--json` shape; a change that removes or renames a field increments it."""

STEP_POINTS = 2048
RECENT_INPUTS = 512
MAX_HELD = 10_000
"""decisions held for an earlier sibling at most; past it (a sibling that never comes: cut by --since, lost with
the stream's head) every held one is folded"""
LOOSE_DECISIONS = 200
"""decisions outside incidents listed per job (the rest are counted by kind)"""
LIST_ITEMS = 16
INCIDENT_DECISIONS = 500
INCIDENT_FAULTS = 64
"""an incident's decisions and faults listed in full (a job-wide crash reported as thousands of exits is one
incident of thousands of faults: the rest are counted)"""

_OPENING = frozenset({"fault.confirmed", "faults.confirmed_together", "node.drain_planned"})
_FAULT_KINDS = frozenset({"fault.confirmed", "faults.confirmed_together", "fault.added"})
_ENDS = {"job.completed": "completed", "job.failed": "failed", "job.cancelled": "cancelled"}
_ATTEMPT_ENDS = {"attempt.failed": "failed", "attempt.timed_out": "timed_out", "attempt.superseded": "superseded"}
_QUIET_INPUTS = frozenset({"process.heartbeat"})
_REPORTS = frozenset({"process.heartbeat", "progress.step", "progress.report", "progress.summary"})
_FOLDS = frozenset({"progress.report", "progress.summary"})
_AGENT_SPOKE = frozenset({"node.heartbeat", "node.ready", "node.joined", "node.not_ready", "node.heard"})
"""what a node's agent says (or the daemon, having heard it): it was alive then"""
_CLASS_OF_SIGNAL = {"process.exited": "process", "process.hang": "hang", "device.fault": "device",
                    "network.link_down": "network", "network.collective_timeout": "hang", "node.not_ready": "node",
                    "process.collective_failed": "network"}
"""the fault class of a fault that joined an incident, from its signal (only a confirmation records its class)"""


JOB_EVENTS = "recovery.ev.job."
FIRST_DEAD_LETTERS = 5
"""a job's first dead letters kept with their reasons (the counts cover all of them)"""


class ReportFold:
    """Feed records with `add`, one at a time; `result()` gives the report as a dict of the documented shape."""

    def __init__(self, job: str | None = None, since: int | None = None, until: int | None = None) -> None:
        self.job_filter = job
        self.since = since
        self.until = until
        self.jobs: dict[str, JobFold] = {}
        self.recent: dict[int, RawDict] = {}
        self.node_heard: dict[str, int] = {}
        """node -> log time of its agent's last node event (a heartbeat, a ready): when a lost node was last heard"""
        self.checks = FailedChecks()
        self.records = 0
        self.read = 0
        self.first_ts: int | None = None
        self.last_ts: int | None = None
        self.rejections: dict[str, int] = {}
        self.notes: list[str] = []
        self.malformed = 0
        # A batch's decisions can be stored permuted when the daemon's connection dropped mid-batch
        # (`recovery.log.recorder.decision_order`): a decision whose earlier siblings (same cause and job, lower
        # index) are not in yet waits for them here, so an incident is never seen planned before it was confirmed.
        # (cause seq, job) -> the index of the next decision expected: a decision's index counts within its job
        self.next_index: dict[tuple[int, str], int] = {}
        self.held: dict[tuple[int, str, int], tuple[RawDict, int]] = {}

    # -- reading ------------------------------------------------------------------------------------------
    def add_all(self, records: Iterable[RawDict]) -> ReportFold:
        for record in records:
            self.add(record)
        return self

    def add(self, record: RawDict) -> None:
        try:
            self._add(record)
        except (KeyError, TypeError, ValueError, AttributeError):
            # an input the engine rejected for its shape (a step that is not a number, a field missing): its dead
            # letter is counted; the record itself says nothing the report can use
            self.malformed += 1

    def _add(self, record: RawDict) -> None:
        self.read += 1
        ts = record["ts"]
        if self.since is not None and ts < self.since:
            return
        if self.until is not None and ts > self.until:
            return
        self.records += 1
        if self.first_ts is None:
            self.first_ts = ts
        self.last_ts = ts
        subject: str = record["subject"]
        env = record["envelope"]
        type_ = env.get("type")
        if subject.startswith("recovery.dec."):
            if type_ == "decision":
                self._in_order(record, env["data"], ts)
            return
        if subject.startswith("recovery.dlq."):
            if type_ == "rejection":
                self._dead_letter(env["data"], ts)
            return
        job_id = env.get("job")
        if self.job_filter is not None and job_id is not None and job_id != self.job_filter:
            return
        if type_ in _REPORTS and job_id is not None:
            job = self.jobs.get(job_id)
            if job is not None:
                for entry in env["data"]["ranks"] if type_ in _FOLDS else [env["data"]]:
                    # a summary's rank was heard `heard_s` before the record (the engine's reading too)
                    self._heard(job, entry, ts - round(float(entry.get("heard_s") or 0) * 1e9))
        if type_ in _AGENT_SPOKE and env.get("node"):
            self.node_heard[str(env["node"])] = ts
        if type_ == "node.checked" and env.get("node"):
            self.checks.add(str(env["node"]), env.get("data") or {}, ts)
        if type_ in ("node.ready", "node.joined") and env.get("node") and (env.get("data") or {}).get("last_exit"):
            self._agent_back(str(env["node"]), str(env["data"]["last_exit"]), ts)
        if type_ == "process.stacks" and job_id is not None:
            self._stacks(job_id, env["data"])
            return  # big, and no decision's input: not kept among the recent inputs
        if type_ in _QUIET_INPUTS:
            return
        recent = self.recent
        recent[record["seq"]] = record
        if len(recent) > 2 * RECENT_INPUTS:
            # keep the newest half: amortised constant time (deleting the oldest one by one makes a dict's
            # iteration skip ever more holes)
            self.recent = dict(list(recent.items())[-RECENT_INPUTS:])
        if job_id is None:
            return
        if type_ in ("process.started", "process.output"):
            job = self.jobs.get(job_id)
            if job is not None:
                self._restarted(job, type_, env["data"], ts)
        elif type_ == "process.capabilities":
            job = self.jobs.get(job_id)
            caps = (env.get("data") or {}).get("caps")
            if job is not None and isinstance(caps, list):
                job.caps = (job.caps or set()) | {str(c) for c in caps}
        elif type_ == "job.submitted":
            self._submitted(job_id, env["data"]["spec"], ts)

    def _agent_back(self, node: str, last_exit: str, ts: int) -> None:
        """A node's agent started again and said why the one before it stopped: that is the root cause of each job's
        latest node fault on the node (`agent of n0 silent`, a host not ready), which the silence alone cannot tell
        from a host that went down."""
        for job in self.jobs.values():
            for incident in [job.incident, *reversed(job.incidents)]:
                struck = [f for f in incident.faults if f["class"] == "node" and node in f["nodes"] and f["ts"] <= ts
                          ] if incident is not None else []
                if struck:
                    for fault in struck:
                        fault.setdefault("agent_exit", last_exit[:300])
                    break

    def _heard(self, job: JobFold, entry: dict[str, Any], ts: int) -> None:
        """A rank's heartbeat or step, alone or as an entry of its agent's `progress.report` (what the engine, and so
        `recovery-ctl jobs`, reads the job's step from): the job's step is the highest reported."""
        rank = entry.get("rank")
        if isinstance(rank, int):
            job.last_heard[rank] = ts
        job.sdk = True
        step = entry.get("step")
        if step is not None:
            self._progress(job, int(step), ts)  # a step that is no number: malformed, as the engine found it
            incident = job.incident or (job.incidents[-1] if job.incidents else None)
            if (incident is not None and incident.first_step is None and incident.generation is not None
                    and entry.get("attempt") == incident.generation):
                incident.first_step = ts  # the restart's first step (its processes' generation)

    def _restarted(self, job: JobFold, type_: str, data: dict[str, Any], ts: int) -> None:
        """A process of the incident's restart started, or wrote its first output: when a script that reports no
        steps ran again (the incident open, or just closed: its grace may have ended first)."""
        incident = job.incident or (job.incidents[-1] if job.incidents else None)
        if incident is None or incident.generation is None or data.get("attempt") != incident.generation:
            return
        if type_ == "process.output":
            incident.first_output = incident.first_output or ts
            return
        incident.starts += 1
        if incident.starts >= incident.restarted and incident.all_started is None:
            incident.all_started = ts

    def _stacks(self, job_id: str, data: dict[str, Any]) -> None:
        """A node's stacks, taken for the hang its job's incident is about (the open one, else the one just closed:
        a dump may land after a quick recovery)."""
        job = self.jobs.get(job_id)
        incident = None if job is None else job.incident or (job.incidents[-1] if job.incidents else None)
        if incident is not None:
            if incident.stacks is None:
                incident.stacks = StackGroups()
            incident.stacks.add(data)

    def _in_order(self, record: RawDict, d: dict[str, Any], ts: int) -> None:
        """Fold `d` now if the decisions of its cause and job before it are folded, else hold it until they are."""
        cause = (int(d["cause_seq"]), str(d["job"]))
        index = int(d["index"])
        expected = self.next_index.get(cause, 0)
        if index > expected:
            self.held[(*cause, index)] = (record, ts)
            if len(self.held) > MAX_HELD:  # a sibling that never comes (cut by --since): stop waiting for it
                self._release_held()
            return
        self._fold(record, ts)
        index += 1
        while (*cause, index) in self.held:
            self._fold(*self.held.pop((*cause, index)))
            index += 1
        self.next_index[cause] = max(expected, index)
        if len(self.next_index) > 2 * RECENT_INPUTS:
            self.next_index = dict(list(self.next_index.items())[-RECENT_INPUTS:])

    def _release_held(self) -> None:
        """Fold every held decision, in their causes' order: the ones before them are not coming."""
        held, self.held = self.held, {}
        for key in sorted(held):
            self._fold(*held[key])

    def _fold(self, record: RawDict, ts: int) -> None:
        try:
            self._decision(record, record["envelope"]["data"], ts)
        except (KeyError, TypeError, ValueError, AttributeError):
            self.malformed += 1

    def _job(self, job_id: str, ts: int) -> JobFold:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobFold(job_id, first_seen=ts)
        job.last_seen = ts
        return job

    def _submitted(self, job_id: str, spec: dict[str, Any], ts: int) -> None:
        job = self._job(job_id, ts)
        job.submitted = True
        job.nodes = list(spec.get("nodes", []))
        job.rpn = int(spec.get("ranks_per_node", 1))
        job.gpus = len(job.nodes) * job.rpn
        job.params = {family: ref.get("params", {}) for family, ref in (spec.get("policies") or {}).items()}

    def _progress(self, job: JobFold, step: int, ts: int) -> None:
        job.last_seen = ts
        if step <= job.step:
            return
        if job.incident is None and job.last_step is not None and job.last_step[1] < step:
            per_step = (ts - job.last_step[0]) / (step - job.last_step[1])
            # a running mean that forgets slowly: the pace of recent training, not of the start
            job.step_ns = per_step if job.step_ns is None else 0.9 * job.step_ns + 0.1 * per_step
        job.last_step = (ts, step)
        job.step = step
        job.seen_points += 1
        if job.seen_points % job.thin == 0:
            job.step_points.append((ts, step))
            if len(job.step_points) >= STEP_POINTS:
                job.step_points = job.step_points[::2]
                job.thin *= 2

    # -- decisions ----------------------------------------------------------------------------------------
    def _decision(self, record: RawDict, d: dict[str, Any], ts: int) -> None:
        job_id: str = d["job"]
        if self.job_filter is not None and job_id != self.job_filter:
            return
        job = self._job(job_id, ts)
        kind: str = d["kind"]
        job.decision_counts[kind] = job.decision_counts.get(kind, 0) + 1
        job.state = d.get("state", job.state)
        detail: dict[str, Any] = d.get("detail") or {}
        if kind == "policy.failed":
            job.policy_failures += 1
            if len(job.first_policy_failures) < FIRST_DEAD_LETTERS:
                job.first_policy_failures.append({"seq": record.get("seq"), "ts": ts,
                                                  "reason": str(d.get("reason", ""))[:300]})
        if kind == "job.accepted":
            job.policies = dict(detail.get("policies", {}))
        elif kind == "job.started" and job.started is None:
            job.started = ts
        elif kind == "fault.suspected":
            job.suspected[str(detail.get("key"))] = self._signal_ts(d, ts)
        elif kind == "fault.cleared":
            for key in [str(detail.get("key", ""))] + [str(k) for k in detail.get("keys", [])]:
                job.suspected.pop(key, None)
        elif kind == "job.unserved":
            job.unserved = str(d.get("reason", ""))
        elif kind == "progress.corrected":
            job.step = min(job.step, int(detail.get("step", job.step)))
        phase = d.get("phase")
        incident = job.incident
        if incident is None and phase is not None:
            incident = self._open(job, d, ts, kind)
        if incident is not None:
            self._incident_decision(job, incident, record, d, ts, kind, detail)
            if phase is None or kind == "incident.closed":
                self._close(job, incident, ts, kind, detail)
            elif not incident.phases or incident.phases[-1].name != phase:
                if incident.phases:
                    incident.phases[-1].end = ts
                incident.phases.append(Phase(phase, ts))
        else:
            self._loose(job, record, d, ts)
        if kind in _ENDS:
            job.ended, job.end_state, job.end_reason = ts, _ENDS[kind], str(d.get("reason", ""))

    def _signal_ts(self, d: dict[str, Any], ts: int) -> int:
        """When the signal behind decision `d` began: its record's time, or before it for a record that says so (a
        hang report's `seconds_without_progress`)."""
        cause = self.recent.get(d["cause_seq"])
        return onset("hang", [], [], cause, int(cause["ts"]), {}, {}) if cause is not None else ts

    def _open(self, job: JobFold, d: dict[str, Any], ts: int, kind: str) -> Incident:
        job.incident_count += 1
        incident_id = d.get("incident") or f"{job.id}#{job.incident_count}"
        cause = "fault" if kind in _FAULT_KINDS else ("drain" if kind.startswith("node.drain") else "operator")
        incident = Incident(id=incident_id, job=job.id, opened=ts, opened_seq=d["cause_seq"], cause=cause,
                            step_at_open=job.step,
                            before_window=self.since is not None and kind not in _OPENING)
        if job.step_after_close is not None and job.step <= job.step_after_close and job.incidents:
            incident.restart_loop = True  # the recovery before this one did not get the job going
        signals = list(job.suspected.values())
        fault = (d.get("detail") or {}).get("fault")
        if kind in _FAULT_KINDS and not (isinstance(fault, dict) and isinstance(fault.get("ts"), int)):
            signals.append(self._signal_ts(d, ts))  # a fault the decision does not record: its signal's time
        # a fault's onset (a silence from when it was last heard) lowers this in `_incident_decision`, for every fault
        incident.first_signal = min(signals) if signals else ts
        job.suspected.clear()
        job.incident = incident
        return incident

    def _incident_decision(self, job: JobFold, incident: Incident, record: RawDict, d: dict[str, Any], ts: int,
                           kind: str, detail: dict[str, Any]) -> None:
        commands = d.get("commands") or []
        if commands and incident.first_command is None:
            incident.first_command = ts
        if len(incident.decisions) < INCIDENT_DECISIONS:
            incident.decisions.append(self._why(record, d, ts))
        else:
            incident.decisions_omitted += 1
        if kind in _FAULT_KINDS:
            incident.fault_count += 1
            fault = self._fault(job, d, ts, detail)
            # a fault that joined later may have begun first (a node lost before its peers' exits were heard)
            incident.first_signal = min(incident.first_signal or ts, fault["onset_ts"])
            if len(incident.faults) < INCIDENT_FAULTS:
                incident.faults.append(fault)
        elif kind == "attempt.started":
            incident.attempts.append({"attempt": detail.get("attempt"), "granularity": detail.get("granularity"),
                                      "rung": detail.get("rung"), "ranks": len(detail.get("ranks", [])),
                                      "vacate": detail.get("vacate", []), "policy": d.get("policy"),
                                      "reason": d.get("reason", ""), "started_s": _s(ts - incident.opened),
                                      "outcome": None, "outcome_reason": None})
        elif kind in _ATTEMPT_ENDS and incident.attempts:
            attempt = incident.attempts[-1]
            attempt["outcome"], attempt["outcome_reason"] = _ATTEMPT_ENDS[kind], d.get("reason", "")
        elif kind == "checkpoint.plan":
            incident.checkpoint = {"checkpoint_step": detail.get("checkpoint_step"),
                                   "next_step": detail.get("next_step"), "tiers": detail.get("tiers", {}),
                                   "policy": d.get("policy"), "reason": d.get("reason", "")}
        elif kind in ("checkpoint.dying", "checkpoint.awaiting"):
            incident.dying = {"step": detail.get("step"), "how": "saved by replicas" if kind == "checkpoint.dying"
                              else "written by exiting ranks", "outcome": None}
        elif kind in ("checkpoint.dying_done", "checkpoint.dying_failed") and incident.dying is not None:
            incident.dying["outcome"] = "done" if kind.endswith("done") else "failed"
        elif kind == "ranks.rescheduling":
            if detail.get("nodes"):
                job.nodes = list(detail["nodes"])  # the job's placement from here on: ranks map to these nodes
            incident.generation = detail.get("generation")
            incident.restarted = incident.attempts[-1]["ranks"] if incident.attempts else job.gpus
            incident.starts, incident.all_started, incident.first_output = 0, None, None

    def _fault(self, job: JobFold, d: dict[str, Any], ts: int, detail: dict[str, Any]) -> dict[str, Any]:
        found = self._fault_as_recorded(job, d, ts, detail)
        cause = self.recent.get(d["cause_seq"])
        found["onset_ts"] = onset(found["class"], found["nodes"], found["ranks"], cause, found["ts"], self.node_heard,
                                  job.last_heard)
        return found

    def _fault_as_recorded(self, job: JobFold, d: dict[str, Any], ts: int, detail: dict[str, Any]
                           ) -> dict[str, Any]:
        fault = detail.get("fault")
        if isinstance(fault, dict):
            ranks = list(fault.get("ranks") or [])
            node = fault.get("node")
            # a job-wide fault (every rank exited: a dependency they share) implicates no node of its own
            few = fault.get("scope") != "job" and len(ranks) <= max(job.rpn, 1)
            nodes = [node] if node else sorted({n for n in (job.node_of(r) for r in ranks) if n}) if few else []
            return {"class": fault.get("class"), "scope": fault.get("scope"), "code": fault.get("code"),
                    "ranks": ranks[:64], "rank_count": len(ranks), "nodes": nodes, "device": fault.get("device"),
                    "signal_seq": fault.get("seq"), "at_s": _s(int(fault.get("ts", ts)) - (job.started or ts)),
                    "ts": int(fault.get("ts", ts)), "reason": fault.get("reason", d.get("reason", ""))}
        cause = self.recent.get(d["cause_seq"])
        env = cause["envelope"] if cause is not None else {}
        data = env.get("data") or {}
        nodes = list(detail.get("nodes", []))
        if env.get("node"):
            nodes = [env["node"]]
        rank = data.get("rank")
        if not nodes and isinstance(rank, int):
            node = job.node_of(rank)
            nodes = [node] if node else []
        kind_class = "node" if d["kind"] == "faults.confirmed_together" else _CLASS_OF_SIGNAL.get(str(env.get("type")))
        lost = silent_nodes(str(d.get("reason", "")), job.nodes) if env.get("type") in ("timer.fired", None) else []
        if lost:  # a silent agent's, found at a watchdog's tick: the node's ranks
            nodes, kind_class = lost, "node"
            ranks = [r for r in range(len(job.nodes) * max(job.rpn, 1)) if job.node_of(r) in lost]
            return {"class": "node", "scope": "node", "code": None, "ranks": ranks[:64], "rank_count": len(ranks),
                    "nodes": nodes, "device": None, "signal_seq": d["cause_seq"],
                    "at_s": _s(ts - (job.started or ts)), "ts": ts, "reason": d.get("reason", "")}
        return {"class": kind_class, "scope": None,
                "code": data.get("code"), "ranks": [rank] if isinstance(rank, int) else [],
                "rank_count": 1 if isinstance(rank, int) else 0, "nodes": nodes, "device": data.get("device"),
                "signal_seq": d["cause_seq"], "at_s": _s(ts - (job.started or ts)), "ts": ts,
                "reason": d.get("reason", "")}

    def _why(self, record: RawDict, d: dict[str, Any], ts: int) -> dict[str, Any]:
        """Why the engine took a decision: the policy (name@version, or the engine's own rule), the rule that fired
        (the decision's recorded reason), and its inputs: the record that caused it and what the decision noted."""
        cause = self.recent.get(d["cause_seq"])
        inputs: dict[str, Any] = {"cause_seq": d["cause_seq"]}
        if cause is not None:
            env = cause["envelope"]
            inputs["cause"] = {"type": env.get("type"), "job": env.get("job"), "node": env.get("node"),
                               "data": _bounded(env.get("data"))}
        detail = d.get("detail") or {}
        if detail:
            inputs["detail"] = _bounded(detail)
        return {"seq": record["seq"], "ts": ts, "kind": d["kind"], "phase": d.get("phase"),
                "policy": d.get("policy") or "engine", "rule": d.get("reason", ""), "inputs": inputs,
                "commands": [c.get("kind") for c in d.get("commands") or []]}

    def _loose(self, job: JobFold, record: RawDict, d: dict[str, Any], ts: int) -> None:
        if len(job.loose) < LOOSE_DECISIONS:
            job.loose.append(self._why(record, d, ts))
        else:
            job.loose_omitted += 1

    def _close(self, job: JobFold, incident: Incident, ts: int, kind: str, detail: dict[str, Any]) -> None:
        if incident.phases and incident.phases[-1].end is None:
            incident.phases[-1].end = ts
        incident.closed = ts
        incident.outcome = "recovered" if kind == "incident.closed" else _ENDS.get(kind, kind)
        lost = detail.get("lost_steps", 0) if kind == "incident.closed" and job.speaks else None
        incident.lost_steps = None if lost is None else int(lost)  # None: the script reports no steps
        job.incident = None
        job.incidents.append(incident)
        resumed = incident.checkpoint.get("next_step")
        if incident.outcome == "recovered" and isinstance(resumed, int) and resumed < job.step:
            # the job rolled back to its resume point: the step line goes down with it, and later reports count
            job.step = resumed
            job.last_step = (ts, resumed)
            job.step_points.append((ts, resumed))
        job.step_after_close = incident.step_at_open

    def _dead_letter(self, data: RawDict, ts: int) -> None:
        """A dead letter counts for the whole log and, when the rejected input was a job's (its subject names the
        job), against that job: a policy that errs on every record leaves the job's state as it was, and only its
        dead letters say the job is not being recovered."""
        code = str(data.get("code"))
        self.rejections[code] = self.rejections.get(code, 0) + 1
        rejected = unpartitioned(str(data.get("subject") or ""))  # a partitioned log's daemon read it so
        if not rejected.startswith(JOB_EVENTS):
            return
        job_id = rejected[len(JOB_EVENTS):].split(".", 1)[0]
        if self.job_filter is not None and job_id != self.job_filter:
            return
        job = self.jobs.get(job_id)
        if job is None:
            return  # the job was never accepted: the whole log's count has it
        if rejected.endswith(".job.submitted") and job.started is None and job.refused is None:
            job.refused = f"refused [{code}]: {data.get('reason', '')}"[:300]
        job.dead_letters[code] = job.dead_letters.get(code, 0) + 1
        if len(job.first_dead_letters) < FIRST_DEAD_LETTERS:
            job.first_dead_letters.append({"seq": data.get("seq"), "ts": ts, "code": code,
                                           "reason": str(data.get("reason", ""))[:300]})

    # -- the result ---------------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """The report (documented in docs/on-call.md, "report": `--json` prints exactly this)."""
        self._release_held()
        end = self.last_ts if self.last_ts is not None else 0
        # A job that never ran (refused, or placed where no agent serves it) lost nothing and trained nothing: it is
        # listed apart and counted in no figure, which its wall time as "effective" would raise.
        ran = sorted((j for j in self.jobs.values() if not j.never_ran), key=lambda j: j.id)
        never = [never_ran(j, end) for j in sorted(self.jobs.values(), key=lambda j: j.id) if j.never_ran]
        jobs = [job_report(job, end) for job in ran]
        incidents = [inc for j in jobs for inc in j["incidents"]]
        wall = sum(j["wall_s"] for j in jobs)
        lost = sum(j["lost_s"] for j in jobs)
        gpu_wall = sum(j["wall_s"] * j["gpus"] for j in jobs)
        gpu_lost = sum(j["lost_s"] * j["gpus"] for j in jobs)
        notes = list(self.notes)
        if self.malformed:
            notes.append(f"{self.malformed} records were malformed inputs (rejected by the engine) and were skipped")
        if self.since is not None or any(i["before_window"] for i in incidents):
            notes.append("records before --since were not read: an incident open then starts where the window does")
        return {
            "report": REPORT_VERSION,
            "filters": {"job": self.job_filter, "since_ns": self.since, "until_ns": self.until},
            "records": self.records,
            "span": {"first_ns": self.first_ts, "last_ns": self.last_ts,
                     "seconds": _s(end - self.first_ts) if self.first_ts is not None else 0.0},
            "summary": {
                "jobs": len(jobs), "incidents": len(incidents),
                "ettr": round(1 - gpu_lost / gpu_wall, 6) if gpu_wall else None,
                "ettr_upper_bound": any(j["ettr_upper_bound"] for j in jobs),
                "wall_s": round(wall, 3), "lost_s": round(lost, 3),
                "lost_gpu_hours": round(gpu_lost / 3600, 3),
                "lost_gpu_hours_by_cause": sum_dicts(j["lost_gpu_hours_by_cause"] for j in jobs),
                "mttr_by_fault_class": mttr(incidents),
                "restarts_by_granularity": restarts(incidents),
                "restart_loops": sum(j["restart_loops"] for j in jobs),
                "rejections": dict(sorted(self.rejections.items())),
                "dead_letters": sum(self.rejections.values()),
                "policy_errors": self.rejections.get("policy_error", 0) + sum(j["policy_failures"] for j in jobs),
                "policy_failures": sum(j["policy_failures"] for j in jobs),
            },
            "jobs": jobs,
            "never_ran": never,
            "lemons": lemons(incidents),
            "health_checks_failed": self.checks.result(),
            "notes": notes,
        }


def _bounded(value: Any, depth: int = 0) -> Any:
    """A decision's inputs as the report keeps them: a list longer than `LIST_ITEMS` (the 16,384 ranks of a job-wide
    fault, a collective's members) is cut to its first items and a count, so that an incident's whys stay small."""
    if isinstance(value, dict):
        return {k: _bounded(v, depth + 1) for k, v in value.items()} if depth < 4 else value
    if isinstance(value, list) and len(value) > LIST_ITEMS:
        return [*value[:LIST_ITEMS], f"... {len(value) - LIST_ITEMS} more"]
    return value


def build_report(records: Iterable[RawDict], job: str | None = None, since: int | None = None,
                 until: int | None = None) -> dict[str, Any]:
    """The report over `records` (dicts, see `recovery.report.source`), folded one at a time."""
    return ReportFold(job, since, until).add_all(records).result()

"""The decisions that differ between two logs of the same inputs, side by side, with their causes.

Both logs are read once, in step on their inputs: the first input that differs is named (after it, the logs do not
hold the same inputs: usually the cluster answering different decisions differently). Each log's decisions are
kept in a compact form (what the engine decided, not the sequence numbers and ids that locate it) and aligned per
job with `difflib`; the jobs' policy selections (names, versions and parameters) are compared too, since a changed
parameter is the usual reason why the same inputs lead to other decisions.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from recovery.report.source import RawDict

_VOLATILE_DATA = frozenset({"command_id", "timer_id", "due"})
"""input fields that carry sequence numbers (command and timer ids): equal inputs of two logs differ in them"""
_VOLATILE_DETAIL = frozenset({"mttr_ns", "generation"})
_NUMBERED = re.compile(r"\b\d+:\d+:\d+\b|/\d+$")


@dataclass(frozen=True)
class DecisionRow:
    """One decision as compared: `key` is what must be equal; the rest says where it is and why it was taken."""

    key: tuple[Any, ...]
    order: tuple[int, int]  # (cause_seq, index): the order it was made in, whatever order it was stored in
    seq: int
    ts: int
    job: str
    kind: str
    policy: str | None
    reason: str
    phase: str | None
    commands: tuple[str, ...]
    detail: dict[str, Any]
    cause: str

    def as_dict(self, origin: int) -> dict[str, Any]:
        return {"seq": self.seq, "at_s": round((self.ts - origin) / 1e9, 3), "kind": self.kind,
                "policy": self.policy or "engine", "rule": self.reason, "phase": self.phase,
                "commands": list(self.commands), "detail": self.detail, "cause": self.cause}


@dataclass
class LogSide:
    """What one log contributes: its decisions per job, the policies each job ran, its first record's time."""

    decisions: dict[str, list[DecisionRow]] = field(default_factory=dict)
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    origin: int | None = None
    records: int = 0
    recent: dict[int, str] = field(default_factory=dict)


def _input_key(env: dict[str, Any]) -> tuple[Any, ...]:
    data = env.get("data") or {}
    clean = {k: v for k, v in data.items() if k not in _VOLATILE_DATA}
    if isinstance(clean.get("spec"), dict):  # a job's policies are compared on their own (`policies`)
        clean["spec"] = {k: v for k, v in clean["spec"].items() if k != "policies"}
    return env.get("type"), env.get("job"), env.get("node"), repr(sorted(clean.items()))


def _brief(env: dict[str, Any]) -> str:
    data = env.get("data") or {}
    shown = " ".join(f"{k}={v}" for k, v in data.items() if k != "spec" and v not in (None, "", [], {}))
    return f"{env.get('type')}@{env.get('node') or env.get('job')} {shown}"[:200]


def _inputs(records: Iterable[RawDict], side: LogSide, job: str | None) -> Iterator[RawDict]:
    """The log's inputs, one at a time; its decisions are collected into `side` on the way."""
    for record in records:
        side.records += 1
        if side.origin is None:
            side.origin = record["ts"]
        subject: str = record["subject"]
        env = record["envelope"]
        if subject.startswith("recovery.dec."):
            if env.get("type") == "decision":
                d = env["data"]
                if job is None or d["job"] == job:
                    _decision(side, record, d)
            continue
        if subject.startswith("recovery.dlq."):
            continue
        if env.get("type") == "job.submitted" and (job is None or env.get("job") == job):
            spec = env["data"]["spec"]
            side.policies.setdefault(env["job"], {}).update(
                {family: {"name": ref.get("name"), "params": ref.get("params", {})}
                 for family, ref in (spec.get("policies") or {}).items()})
        if env.get("type") != "process.heartbeat":
            side.recent[record["seq"]] = _brief(env)
            if len(side.recent) > 512:
                del side.recent[next(iter(side.recent))]
        yield record


def _decision(side: LogSide, record: RawDict, d: dict[str, Any]) -> None:
    detail = {k: v for k, v in (d.get("detail") or {}).items() if k not in _VOLATILE_DETAIL}
    if d["kind"] == "job.accepted":
        labels = detail.pop("policies", {})  # compared on their own, with the spec's parameters
        for family, label in labels.items():
            side.policies.setdefault(d["job"], {}).setdefault(family, {})["version"] = label
    commands = tuple(c.get("kind", "?") for c in d.get("commands") or [])
    fault = detail.get("fault")
    if isinstance(fault, dict):  # where the fault was is compared; which record said so is not
        detail = {**detail, "fault": {k: v for k, v in fault.items() if k not in ("seq", "ts")}}
    key = (d["kind"], d.get("policy"), _NUMBERED.sub("#", d.get("reason", "")), d.get("phase"), d.get("state"),
           commands, repr(sorted(detail.items())))
    side.decisions.setdefault(d["job"], []).append(DecisionRow(
        key=key, order=(int(d["cause_seq"]), int(d.get("index", 0))), seq=record["seq"], ts=record["ts"],
        job=d["job"], kind=d["kind"], policy=d.get("policy"),
        reason=d.get("reason", ""), phase=d.get("phase"), commands=commands, detail=detail,
        cause=f"seq {d['cause_seq']} " + side.recent.get(d["cause_seq"], "(an input not in view)")))


def diff_logs(a: Iterable[RawDict], b: Iterable[RawDict], job: str | None = None,
              labels: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """The differences between two logs: their policies, the first input that differs, and per job every hunk of
    differing decisions with both sides' decisions and causes."""
    left, right = LogSide(), LogSide()
    first_input: dict[str, Any] | None = None
    inputs = 0
    for ra, rb in zip_longest(_inputs(a, left, job), _inputs(b, right, job)):
        if first_input is not None:
            continue  # read on, for the decisions
        inputs += 1
        if ra is None or rb is None or _input_key(ra["envelope"]) != _input_key(rb["envelope"]):
            first_input = {"index": inputs,
                           labels[0]: None if ra is None else {"seq": ra["seq"], "input": _brief(ra["envelope"])},
                           labels[1]: None if rb is None else {"seq": rb["seq"], "input": _brief(rb["envelope"])}}
    policies = []
    for name in sorted(set(left.policies) | set(right.policies)):
        pa, pb = left.policies.get(name, {}), right.policies.get(name, {})
        for family in sorted(set(pa) | set(pb)):
            if pa.get(family) != pb.get(family):
                policies.append({"job": name, "family": family, labels[0]: pa.get(family), labels[1]: pb.get(family),
                                 "changed": _changed(pa.get(family) or {}, pb.get(family) or {})})
    jobs = []
    first: dict[str, Any] | None = None
    for name in sorted(set(left.decisions) | set(right.decisions)):
        # a batch's decisions may be stored permuted (`recovery.log.recorder.decision_order`)
        da = sorted(left.decisions.get(name, []), key=lambda r: r.order)
        db = sorted(right.decisions.get(name, []), key=lambda r: r.order)
        matcher = difflib.SequenceMatcher(None, [r.key for r in da], [r.key for r in db], autojunk=False)
        hunks = []
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                continue
            hunk = {"change": tag, labels[0]: [r.as_dict(left.origin or 0) for r in da[i1:i2]],
                    labels[1]: [r.as_dict(right.origin or 0) for r in db[j1:j2]]}
            hunks.append(hunk)
            candidate = {"job": name, "index": i1, **{k: (v[0] if v else None) for k, v in hunk.items()
                                                       if k in labels}}
            # when it happened, on A's clock, or on B's for decisions only B took
            ts = min([r.ts - (left.origin or 0) for r in da[i1:i2]] or
                     [r.ts - (right.origin or 0) for r in db[j1:j2]] or [None])
            if first is None or (ts is not None and ts < first["_ts"]):
                first = {**candidate, "_ts": ts if ts is not None else 1 << 62}
        jobs.append({"job": name, "decisions": [len(da), len(db)], "same": len(hunks) == 0, "hunks": hunks})
    if first is not None:
        first.pop("_ts")
    return {"labels": list(labels), "records": [left.records, right.records], "policies": policies,
            "first_input_difference": first_input, "first_decision_difference": first, "jobs": jobs,
            "same": first is None}


def _changed(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two policy selections, as `name`, `version` or `params.key` paths."""
    out = [k for k in ("name", "version") if a.get(k) != b.get(k)]
    pa, pb = a.get("params") or {}, b.get("params") or {}
    out += [f"params.{k}" for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)]
    return out

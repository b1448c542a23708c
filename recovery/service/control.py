"""The daemon's side of `recovery-ctl`: a NATS request/reply service on `recovery.ctl.<verb>`.

Requests and replies are JSON objects; a reply has `ok` and either the answer or `error`. Verbs that change
something (submit, inject, scale, pause, resume, cancel, force, release) publish an input event into the log, like
any other source, with the request's id as its dedupe id (a retried request is the same event), wait until
the engine has applied it and answer with the decisions or the rejection it caused. Queries (status, jobs,
job, incidents) read the engine's state between two records.

A partitioned control plane (`partitions` P > 1, `recovery.service.ownership`) answers per partition: the active
owner of partition k serves `recovery.ctl.p.<k>.<verb>` in a queue group of that partition (a standby subscribes
nothing until it holds the lease, and a handover's two owners never both answer), about its own jobs only. Each
daemon process answers `recovery.ctl.partitions` with P and refuses every unpartitioned verb naming P, so that
`recovery-ctl` learns where to ask (`recovery.cli.ctl_routes`): a job's request goes to `partition_of(job, P)`,
fleet-wide queries to every partition.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import anyio
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from events import subjects
from events.codec import encode_envelope
from events.envelope import ENVELOPES, make_envelope
from events.kinds import JOB_EVENTS, NODE_EVENTS
from events.outputs import Decision
from events.values import JobSpec
from recovery.core.engine import Effect, Engine
from recovery.core.partition import Partition
from recovery.service.fleet import node_rows, unserved
from recovery.service.publisher import Outgoing, Publisher

logger = logging.getLogger("recovery.control")
SUBJECT = f"{subjects.PREFIX}.ctl"
SOURCE = "recovery-ctl"
QUEUE = "recovery-daemon"
VERBS = ("status", "jobs", "nodes", "job", "incidents", "submit", "inject", "scale", "pause", "resume", "cancel",
         "force", "release", "partitions")
PARTITIONS_VERB = "partitions"
"""how many partitions the control plane has: 1 from an unpartitioned daemon, P from a partitioned one"""


def partition_subject(index: int, verb: str) -> str:
    """Where partition `index`'s active owner answers `verb`."""
    return f"{SUBJECT}.p.{index}.{verb}"


def partition_queue(index: int) -> str:
    """The queue group of partition `index`'s control service: one answer per request, whoever subscribed."""
    return f"{QUEUE}-p{index}"


class CtlError(Exception):
    """A request the daemon refuses: the message goes back to the caller."""


def job_row(snapshot: dict[str, Any], no_agent: list[str] | None = None) -> dict[str, Any]:
    """`jobs`' row of a job; `no_agent`: its nodes no agent serves (`recovery.service.fleet.unserved`)."""
    incident = snapshot["incident"]
    attempt = incident["attempts"][-1] if incident and incident["attempts"] else None
    return {"job": snapshot["job"], "state": snapshot["state"], "step": snapshot["step"],
            "generation": snapshot["generation"], "alive": snapshot["alive"], "world": snapshot["world"],
            "nodes": len(snapshot["nodes"]), "dp": snapshot["layout"]["dp"],
            "incident": incident["id"] if incident else None,
            "phase": incident["phase"] if incident else None,
            "attempt": None if attempt is None else attempt["granularity"],
            "incidents_closed": len(snapshot["incidents"]), "restarts_used": snapshot["restarts_used"],
            "no_agent": no_agent or []}


def incident_row(job: str, inc: dict[str, Any]) -> dict[str, Any]:
    phase = inc["phase"]
    return {"job": job, "incident": inc["id"], "cause": inc["cause"], "fault_class": inc["fault_class"],
            "opened": inc["opened"], "closed": inc["closed"], "outcome": inc["outcome"], "phase": phase,
            "faults": len(inc["faults"]), "lost_steps": inc["lost_steps"],
            "attempts": [f"{a['granularity']}:{a['outcome'] or 'open'}" for a in inc["attempts"]]}


def effect_summary(effects: list[Any]) -> dict[str, Any]:
    decisions, rejections = [], []
    for effect in effects:
        if isinstance(effect, Decision):
            decisions.append({"job": effect.job, "kind": effect.kind, "state": effect.state, "reason": effect.reason,
                              "commands": [c.kind for c in effect.commands]})
        else:
            rejections.append({"code": effect.code, "reason": effect.reason})
    return {"decisions": decisions, "rejections": rejections}


class Controlled(Protocol):
    """What the control service reads and drives of the daemon it serves."""

    @property
    def engine(self) -> Engine: ...

    @property
    def publisher(self) -> Publisher | None: ...

    @property
    def partition(self) -> Partition | None:
        """the partition the daemon owns, or None: every job"""
        ...

    @property
    def recent(self) -> Mapping[int, list[Effect]]:
        """the effects of the inputs applied last, by sequence"""
        ...

    async def status(self) -> dict[str, object]: ...

    async def wait_applied(self, seq: int, timeout: float) -> bool: ...


class ControlService:
    """Subscribed (`subscribe`), it queues the requests; served (`serve`, until cancelled), it answers each in a
    task of its own task group: a request waiting for the engine blocks no other, and none outlives the service."""

    def __init__(self, daemon: Controlled, apply_timeout: float = 5.0) -> None:
        self.daemon = daemon
        self.apply_timeout = apply_timeout
        self._sub: Subscription | None = None
        self._queue, self._requests = anyio.create_memory_object_stream[Msg](math.inf)
        self.partition = daemon.partition
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "status": self._status, "jobs": self._jobs, "nodes": self._nodes, "job": self._job,
            "incidents": self._incidents,
            "submit": self._submit, "inject": self._inject, "scale": self._operator, "pause": self._operator,
            "resume": self._operator, "cancel": self._operator, "force": self._operator,
            "release": self._operator, PARTITIONS_VERB: self._partitions,
        }

    async def subscribe(self, nc: Client) -> None:
        part = self.partition
        if part is None:
            self._sub = await nc.subscribe(f"{SUBJECT}.*", queue=QUEUE, cb=self._on_request)
        else:
            self._sub = await nc.subscribe(partition_subject(part.index, "*"), queue=partition_queue(part.index),
                                           cb=self._on_request)

    async def serve(self) -> None:
        async with anyio.create_task_group() as answering, self._requests:
            async for msg in self._requests:
                answering.start_soon(self._answer, msg)

    async def close(self) -> None:
        """Unsubscribe: requests go to another daemon of the queue group, or time out at the caller."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        self._queue.close()

    async def _on_request(self, msg: Msg) -> None:
        with contextlib.suppress(anyio.ClosedResourceError):
            self._queue.send_nowait(msg)

    async def _answer(self, msg: Msg) -> None:
        verb = msg.subject.rsplit(".", 1)[-1]
        try:
            body = orjson.loads(msg.data) if msg.data else {}
            if not isinstance(body, dict):
                raise CtlError("the request must be a JSON object")
            handler = self._handlers.get(verb)
            if handler is None:
                raise CtlError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
            body["_verb"] = verb
            reply = {"ok": True, **(await handler(body))}
        except CtlError as exc:
            reply = {"ok": False, "error": str(exc)}
        except orjson.JSONDecodeError as exc:
            reply = {"ok": False, "error": f"the request is not JSON: {exc}"}
        except Exception as exc:
            logger.exception("ctl request failed", extra={"fields": {"verb": verb}})
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(orjson.dumps(reply, default=str))

    # -- queries ------------------------------------------------------------------------------------------
    async def _partitions(self, body: dict[str, Any]) -> dict[str, Any]:
        part = self.partition
        return {"partitions": 1} if part is None else {"partitions": part.count, "partition": part.index}

    async def _status(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": await self.daemon.status()}

    async def _jobs(self, body: dict[str, Any]) -> dict[str, Any]:
        engine = self.daemon.engine
        return {"jobs": [job_row(engine.jobs[j].snapshot(), unserved(engine, engine.jobs[j].nodes))
                         for j in sorted(engine.jobs)]}

    async def _nodes(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"nodes": node_rows(self.daemon.engine)}

    async def _job(self, body: dict[str, Any]) -> dict[str, Any]:
        job = self._job_id(body)
        return {"job": self.daemon.engine.jobs[job].snapshot()}

    async def _incidents(self, body: dict[str, Any]) -> dict[str, Any]:
        engine = self.daemon.engine
        rows = []
        for job_id in sorted(engine.jobs):
            job = engine.jobs[job_id]
            if body.get("all"):
                rows += [incident_row(job_id, inc) for inc in job.closed]
            if job.incident is not None:
                rows.append(incident_row(job_id, job.incident.summary()))
        return {"incidents": rows}

    def _job_id(self, body: dict[str, Any], known: bool = True) -> str:
        job = body.get("job")
        if not isinstance(job, str) or not job:
            raise CtlError("'job' is required")
        part = self.partition
        if part is not None and not part.owns_job(job):
            # a client that routed with another partition count: its event would be applied by another engine
            owner = subjects.partition_of(job, part.count)
            raise CtlError(f"job {job!r} belongs to partition {owner} of {part.count}, not to this one "
                           f"({part.index}): ask {partition_subject(owner, str(body.get('_verb', '<verb>')))}")
        if known and job not in self.daemon.engine.jobs:
            raise CtlError(f"no job {job!r}")
        return job

    # -- changes ------------------------------------------------------------------------------------------
    async def _submit(self, body: dict[str, Any]) -> dict[str, Any]:
        job = self._job_id(body, known=False)
        try:
            spec = JobSpec.model_validate(body.get("spec"))
        except ValidationError as exc:
            raise CtlError(f"invalid job spec: {_errors(exc)}") from None
        return await self._publish("job.submitted", {"spec": spec.model_dump(mode="json")}, body, job=job)

    async def _inject(self, body: dict[str, Any]) -> dict[str, Any]:
        type_ = body.get("type")
        if type_ in JOB_EVENTS:
            return await self._publish(type_, body.get("data") or {}, body, job=self._job_id(body, known=False))
        if type_ in NODE_EVENTS:
            node = body.get("node")
            if not isinstance(node, str) or not node:
                raise CtlError(f"{type_} is a node event: 'node' is required")
            return await self._publish(type_, body.get("data") or {}, body, node=node)
        raise CtlError(f"unknown event type {type_!r}; known: {', '.join(sorted(ENVELOPES))}")

    async def _operator(self, body: dict[str, Any]) -> dict[str, Any]:
        verb = body["_verb"]
        job = self._job_id(body)
        data: dict[str, Any] = {}
        if verb == "scale":
            data["dp"] = body.get("dp")
        if verb == "force":
            data["granularity"] = body.get("granularity")
        if verb == "release":
            data["node"] = body.get("node")
            if body.get("device") is not None:
                data["device"] = body.get("device")
        if verb in ("pause", "cancel", "force", "release") and body.get("reason"):
            data["reason"] = str(body["reason"])
        if verb == "cancel":  # a graceful cancel: checked as the event's own fields, named in the error if invalid
            for key in ("grace_s", "signal"):
                if body.get(key) is not None:
                    data[key] = body[key]
        return await self._publish(f"operator.{verb}", data, body, job=job)

    async def _publish(self, type_: str, data: dict[str, Any], body: dict[str, Any], *, job: str | None = None,
                       node: str | None = None) -> dict[str, Any]:
        ident = body.get("id") or f"ctl-{secrets.token_hex(8)}"
        try:
            envelope = make_envelope(type_, data, id=str(ident), job=job, node=node, source=SOURCE)
        except ValidationError as exc:
            raise CtlError(f"invalid {type_}: {_errors(exc)}") from None
        subject = subjects.job_event(job, type_) if job is not None else subjects.node_event(node or "", type_)
        publisher = self.daemon.publisher
        assert publisher is not None
        try:
            acks = await publisher.publish([Outgoing(subject, encode_envelope(envelope), envelope.id, "input")],
                                           deadline=time.monotonic() + self.apply_timeout)
        except TimeoutError:
            raise CtlError("the log did not acknowledge the event in time (NATS outage?)") from None
        seq = acks[0].seq
        out: dict[str, Any] = {"seq": seq, "id": envelope.id, "subject": subject, "duplicate": bool(acks[0].duplicate)}
        try:
            await self.daemon.wait_applied(seq, self.apply_timeout)
        except TimeoutError:
            return {**out, "applied": False}
        effects = self.daemon.recent.get(seq)
        return {**out, "applied": True, **effect_summary(effects or [])}


class PartitionDirectory:
    """A partitioned daemon process's answer on the unpartitioned subjects (`recovery.ctl.<verb>`): `partitions`
    says how many there are and which this process owns; every other verb is refused naming the count, so that a
    client that does not route says why rather than timing out, and one that does learns where to ask."""

    def __init__(self, count: int, instance: str, owned: Callable[[], list[int]]) -> None:
        self.count = count
        self.instance = instance
        self.owned = owned

    async def subscribe(self, nc: Client) -> None:
        """Answer until the connection closes (the process's own, closed when it stops). In no queue group: every
        daemon process answers alike and the client takes the first answer, so that one frozen process, which would
        get its share of a queue group's requests, holds no request up."""
        await nc.subscribe(f"{SUBJECT}.*", cb=self._on_request)

    def answer(self, verb: str) -> dict[str, Any]:
        if verb == PARTITIONS_VERB:
            return {"ok": True, "partitions": self.count, "instance": self.instance, "owned": self.owned()}
        return {"ok": False, "partitions": self.count,
                "error": f"the control plane has {self.count} partitions: each answers on "
                         f"{SUBJECT}.p.<k>.{verb} about its own jobs "
                         f"(recovery-ctl routes there by itself)"}

    async def _on_request(self, msg: Msg) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(orjson.dumps(self.answer(msg.subject.rsplit(".", 1)[-1])))


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}"
                     for e in exc.errors(include_url=False)[:5])

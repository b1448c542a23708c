"""The daemon's processor: a batch of input deliveries in, the messages to publish out. No I/O.

Each delivery is applied to the engine in stream order through the `EffectRouter`; commands go to
`recovery.cmd.<node>.<job>.<kind>` in the command stream (a copy for each node the command concerns), decisions
to `recovery.dec.<job>` and dead letters to `recovery.dlq.<reason>` in the log, each with its deterministic id as
`Nats-Msg-Id`. Effects a restart found already stored (`skip_ids`) are routed but not published again. The daemon
publishes what comes out, waits for JetStream to acknowledge it, and only then acknowledges the inputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import orjson

from events import subjects
from events.codec import encode_envelope
from events.commands import Command
from events.envelope import EnvelopeBase, RawRecord, Record
from events.kinds import PolicyOverran as PolicyOverranFact
from events.outputs import Decision, Rejection
from events.subjects import unpartitioned
from policies.base import FAMILIES
from recovery.core.addressing import command_nodes
from recovery.core.engine import Effect, Engine
from recovery.core.firings import FORGED_FIRING_CODES
from recovery.core.overruns import fact_message
from recovery.core.router import EffectRouter
from recovery.core.sandbox import builtin
from recovery.core.timers import TimerTable
from recovery.log import to_record
from recovery.log.pull import Delivery
from recovery.plugins import DEFAULT_BUDGET_S, PolicyWorkers
from recovery.service.publisher import Outgoing

logger = logging.getLogger("recovery.daemon")

CTL_SOURCE = "recovery-ctl"
RECENT = 1024
"""how many control requests' effects are kept for their answers"""

Listener = Callable[[Record | RawRecord, list[Effect]], None]


@dataclass(slots=True)
class Processed:
    """What one batch made: the messages to publish and what the metrics count."""

    out: list[Outgoing] = field(default_factory=list)
    applied: int = 0
    last: Delivery | None = None
    rest: list[Delivery] = field(default_factory=list)
    """the deliveries after the one that gave a command, left for the next call: the command goes out first"""
    timed: list[int] = field(default_factory=list)
    """log times of the inputs that had effects: their decision latency is measured once published"""
    types: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)


class Processor(EffectRouter):
    """Applies batches of deliveries to the engine and turns their effects into messages to publish."""

    def __init__(self, engine: Engine | None = None, timers: TimerTable | None = None,
                 policy_budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.policy_workers = PolicyWorkers(policy_budget_s)
        """where third-party policies run: a call past the budget is abandoned, and a fact in the log"""
        super().__init__(engine, timers)
        self.skip_ids: set[str] = set()
        """ids of effects stored before a restart, found by scanning the streams: routed, not published again"""
        self.seal: Callable[[str], str] = str
        """the message id a decision or dead letter is published under (`recovery.service.seal`)"""
        self.sealed_from: int | None = None
        """the log's first sequence from which daemon-only records must be sealed (`recovery.service.streams`)"""
        self.recent: OrderedDict[int, list[Effect]] = OrderedDict()
        """the effects of the control service's inputs, by sequence, for its answers"""
        self.listeners: list[Listener] = []
        self.reads: Callable[[str], bool] | None = None
        """which stored subjects are inputs, for a partition that reads the whole log (None: all it is given)"""
        self._batch = Processed()

    def process(self, batch: list[Delivery], observe: Callable[[int], None] | None = None,
                first_command: bool = False) -> Processed:
        """Apply `batch` (deliveries already applied are skipped) and say what to publish; `observe` is given each
        delivery's log time (the timer service's server clock). With `first_command` it stops after the first
        delivery that gave a command and leaves the others in `rest`: an agent waits on a command, which should not
        wait for a batch of reports behind the fault (half a batch of a 131,072-GPU job's reports is 30 ms)."""
        engine = self.engine
        self._batch = done = Processed()
        types = done.types
        recent, listeners, reads = self.recent, self.listeners, self.reads
        for index, d in enumerate(batch):
            if first_command and done.commands:
                done.rest = batch[index:]
                break
            done.last = d
            if observe is not None:
                observe(d.ts)
            if d.seq <= engine.last_seq or (reads is not None and not reads(d.subject)):
                continue  # applied before, or not this partition's (acknowledged with the batch all the same)
            # A partitioned job event is applied as the subject it was published on (`subjects.unpartitioned`).
            record = to_record(d.seq, d.ts, unpartitioned(d.subject), d.headers or {}, d.data)
            encoded = self.apply(record)  # a record whose effects cannot be written is revoked
            done.applied += 1
            is_record = type(record) is Record
            types[record.envelope.type if is_record else "undecodable"] += 1  # type: ignore[union-attr]
            if encoded:
                done.timed.append(d.ts)
            from_ctl = is_record and record.envelope.source == CTL_SOURCE  # type: ignore[union-attr]
            if from_ctl or listeners:
                effects = [effect for effect, _, _, _ in encoded]
                if from_ctl:
                    recent[d.seq] = effects
                    while len(recent) > RECENT:
                        recent.popitem(last=False)
                for listener in listeners:
                    listener(record, effects)
        return done

    @property
    def engine(self) -> Engine:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        # Every engine this processor drives (a restored snapshot's too) runs plugins in its workers.
        engine.policy_calls = self.policy_workers
        self._engine = engine

    def _prepare(self, job_id: str) -> None:
        """Start the workers of a job's third-party policies as it is accepted: their first call need not wait
        for an interpreter to start, and neither does the daemon's loop."""
        job = self.engine.jobs.get(job_id)
        if job is not None:
            for family in FAMILIES:
                policy = getattr(job.policies, family)
                if not builtin(policy):
                    self.policy_workers.prepare(policy)

    def published(self, out: list[Outgoing]) -> None:
        """`out` is stored: a later restart's scan finds it, this run needs not remember it."""
        if self.skip_ids:
            self.skip_ids.difference_update(o.msg_id for o in out)

    # -- where effects go ---------------------------------------------------------------------------------
    def commanded(self, command: Command, decision: Decision) -> None:
        self._batch.commands[command.kind] += 1
        self._batch.out.extend(o for o in addressed(self.engine, command) if o.msg_id not in self.skip_ids)

    def _stored(self, ident: str, msg_id: str) -> bool:
        # Either form: outputs stored before seals carry their plain id.
        return bool(self.skip_ids) and (msg_id in self.skip_ids or ident in self.skip_ids)

    def decided(self, decision: Decision, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        self._batch.decisions[decision.kind] += 1
        if decision.kind == "job.accepted":
            self._prepare(decision.job)
        msg_id = self.seal(envelope.id)
        if not self._stored(envelope.id, msg_id):
            self._batch.out.append(Outgoing(subject, data, msg_id, "decision", envelope.id))

    def overran(self, job: str, fact: PolicyOverranFact) -> None:
        logger.warning("policy call abandoned", extra={"fields": {
            "job": job, "seq": fact.seq, "policy": fact.policy, "family": fact.family, "method": fact.method,
            "budget_s": fact.budget_s}})
        subject, envelope = fact_message(job, fact)
        # An input, read back and applied after the input it is about; sealed like a firing, so that no publisher
        # of inputs can take its id first and make it a duplicate.
        self._batch.out.append(Outgoing(subject, encode_envelope(envelope), self.seal(envelope.id), "input"))

    def rejected(self, rejection: Rejection, subject: str, envelope: EnvelopeBase, data: bytes) -> None:
        self._batch.rejections[rejection.code] += 1
        # A forged or early timer firing is someone publishing what only the timer service may: a warning.
        log = logger.warning if rejection.code in FORGED_FIRING_CODES else logger.info
        log("rejected", extra={"fields": {"seq": rejection.seq, "subject": rejection.subject,
                                          "code": rejection.code, "reason": rejection.reason,
                                          "event_id": rejection.event_id}})
        msg_id = self.seal(envelope.id)
        if not self._stored(envelope.id, msg_id):
            self._batch.out.append(Outgoing(subject, data, msg_id, "rejection", envelope.id))


class AppliedWaits:
    """Who waits for an input to be applied and its effects published (`Daemon.wait_applied`)."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, anyio.Event]] = []  # (input sequence, set once applied)

    async def wait(self, seq: int, clean_seq: int, timeout: float) -> bool:
        if clean_seq >= seq:
            return True
        applied = anyio.Event()
        waiter = (seq, applied)
        self._waiting.append(waiter)
        try:
            with anyio.fail_after(timeout):
                await applied.wait()
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)
        return True

    def reached(self, clean_seq: int) -> None:
        """Every input up to `clean_seq` is applied and its effects published."""
        if not self._waiting:
            return
        still = []
        for seq, applied in self._waiting:
            if seq <= clean_seq:
                applied.set()
            else:
                still.append((seq, applied))
        self._waiting = still


def addressed(engine: Engine, command: Command) -> list[Outgoing]:
    """One copy of `command` per node it concerns, on that node's command subject, each with its own message id
    (the job's placement is the engine's after the record that decided the command)."""
    job = engine.jobs.get(command.job)
    job_nodes = job.nodes if job is not None else []

    def node_of(rank: int) -> str:
        if job is None or not 0 <= rank // job.rpn < len(job.nodes):
            return ""
        return job.node_of(rank)

    data = orjson.dumps(command.model_dump(mode="json"))
    nodes = [node for node in command_nodes(command, node_of, job_nodes) if node]
    if not nodes:
        logger.warning("command concerns no node", extra={"fields": {"command": command.id, "kind": command.kind}})
    return [Outgoing(subjects.command(node, command.job, command.kind), data, subjects.command_msg_id(command.id, node),
                     "command") for node in nodes]

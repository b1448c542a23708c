"""Whether a `timer.fired` record is a real firing: one the timer service sent, at or after the timer's due time;
and whether a `control.outage`, `node.silent` or `node.heard` record is the daemon's own (the seal rule alone).

Timer firings travel on job subjects, which every agent may publish, and name a timer id and due time that any
decision lists: without a check, a forged firing fires a 20 s debounce or a 60 s deadline at once. Two rules, both
read only the record and the engine's state, so a replay judges every firing as the daemon did:

- **Never before its due time in log time.** A firing whose record is older than the due time the engine holds for
  that timer is dead-lettered (`timer_early`). The timer service fires on its estimate of the server's clock, which
  never runs ahead of it (`recovery.service.timers.ServerClock`), so a real firing is never early; one the engine
  refuses is sent again no sooner than its due time (`TimerTable.refused`).
- **Only from the timer service.** The daemon publishes each firing under its id sealed with an HMAC of a secret
  only daemons read (`recovery.service.seal`). From the log's `sealed_from` on (a sequence the daemon records in the
  log stream's metadata: 1 for a log it created, the one after the last record for a log an older version wrote),
  and in a replay that does not know it from the first sealed firing in the log on, a firing whose message id
  is not sealed is dead-lettered (`timer_unsealed`); an engine given the deployment's seal (the daemon's) also checks
  the digest (`timer_forged`). Logs made before seals, and drivers that do not seal (`Scenario`, the simulator,
  file logs), hold no sealed firing and replay as they always did. A replay without the secret (`recovery-replay
  verify` of an export) checks the seal's form only: a forger who imitates the form is dead-lettered by the daemon,
  and such a verify shows it as the daemon's dead letter that the replay does not make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from events.envelope import EnvelopeBase, RawRecord, Record
from recovery.core.record import Rejected
from recovery.core.seals import FORGED_FIRING_CODES, MSG_ID, SEALED_FACTS, sealed_form
from recovery.core.timers import TimerEntry


class FiringState(Protocol):
    """What the rules read and keep in the engine."""

    firing_seal: Callable[[str], str] | None
    firings_sealed: bool
    sealed_from: int | None

    @property
    def timers(self) -> Mapping[str, TimerEntry]: ...


def admit_firing(engine: FiringState, record: Record | RawRecord, envelope: EnvelopeBase) -> None:
    """Raise `Rejected` unless the `timer.fired` `record` is a real firing (see the module's rules)."""
    ident = envelope.id
    msg_id = record.headers.get(MSG_ID)
    sealed = sealed_form(msg_id, ident)
    if sealed and not engine.firings_sealed:
        engine.firings_sealed = True  # the daemon seals its firings from here on: every later one must be
    data = envelope.data
    entry = engine.timers.get(data.timer_id)
    # Due time first: a replay without the secret judges an early firing as the daemon does, whatever its seal.
    if entry is not None and entry[0] == envelope.job and record.ts < entry[1] and (
            entry[2] is None or data.due == entry[1]):
        raise Rejected("timer_early", f"timer {data.timer_id} of job {entry[0]} is due at {entry[1]}; a firing at "
                                      f"log time {record.ts} is {(entry[1] - record.ts) / 1e9:.3f}s early and fires "
                                      f"nothing")
    _check_seal(engine, msg_id, ident, sealed, "timer", "timer.fired", "the timer service", record.seq)


def admit_fact(engine: FiringState, record: Record | RawRecord, envelope: EnvelopeBase) -> None:
    """Raise `Rejected` unless the `record` of one of `SEALED_FACTS` comes from the daemon. A forged outage would
    have the engine overlook a real silence, a forged `node.silent` move a healthy node's ranks; the daemon seals
    them as it seals its firings, and the same rule holds."""
    ident = envelope.id
    msg_id = record.headers.get(MSG_ID)
    sealed = sealed_form(msg_id, ident)
    if sealed and not engine.firings_sealed:
        engine.firings_sealed = True  # the daemon seals what it sends: every later firing must be sealed too
    _check_seal(engine, msg_id, ident, sealed, SEALED_FACTS[envelope.type], envelope.type, "the daemon", record.seq)


def sealed_from_in(records: Iterable[Record | RawRecord]) -> int | None:
    """For a replay that reads a log without its stream's metadata (an export, a file): the first input the daemon
    dead-lettered as an unsealed daemon-only record, or None. The log's own `sealed_from` is at or before it, and no
    unsealed daemon-only record lies between the two (the daemon would have dead-lettered it too): from there on the
    replay judges as the daemon did."""
    from events.outputs import Rejection
    from events.subjects import is_output

    first: int | None = None
    for record in records:
        if type(record) is Record and is_output(record.subject) and record.envelope.type == "rejection":
            data = record.envelope.data
            if isinstance(data, Rejection) and data.code.endswith("_unsealed") and data.code in FORGED_FIRING_CODES:
                first = data.seq if first is None else min(first, data.seq)
    return first


JOINS = frozenset(("node.joined", "node.ready"))
"""how a node becomes known: a spare's agent joins, a job node's agent says it is ready as it starts"""


def unknown_node(engine: Any, seq: int) -> bool:
    """Is a node event at `seq` from a node the engine's cluster view has never seen to be dead-lettered? In the
    daemon, from the log's `nodes_from` on (where its seals begin: what an older version accepted replays as it was);
    in a replay, exactly where the daemon did (`unknown_nodes_in`): a replay of a slice of the log lacks the joins
    before the slice, and must not refuse what the daemon knew. Not with several partitions: each hears every node's
    events but knows only the nodes of its own jobs and spares, and the one that owns the node applies them."""
    if engine.partition is not None:
        return False
    return (engine.nodes_from is not None and seq >= engine.nodes_from) or seq in engine.unknown_nodes_at


def unknown_nodes_in(records: Iterable[Record | RawRecord]) -> frozenset[int]:
    """The inputs the daemon dead-lettered as events of a node that never joined."""
    from events.outputs import Rejection
    from events.subjects import is_output

    return frozenset(record.envelope.data.seq for record in records
                     if type(record) is Record and is_output(record.subject) and record.envelope.type == "rejection"
                     and isinstance(record.envelope.data, Rejection) and record.envelope.data.code == "unknown_node")


def must_be_sealed(engine: FiringState, seq: int) -> bool:
    """Must a daemon-only record at `seq` be sealed: from the log's `sealed_from` on (the daemon knows it), or once
    the log held a sealed one (a replay that does not know it reads the log as the daemon did before it was
    recorded)."""
    return engine.firings_sealed or (engine.sealed_from is not None and seq >= engine.sealed_from)


def _check_seal(engine: FiringState, msg_id: str | None, ident: str, sealed: bool, code: str, type_: str,
                sender: str, seq: int) -> None:
    if sealed:
        seal = engine.firing_seal
        if seal is not None and msg_id != seal(ident):
            raise Rejected(f"{code}_forged", f"{type_} {ident} was not sent by {sender}: its message id "
                                             f"{msg_id!r} carries a seal that does not verify")
    elif must_be_sealed(engine, seq):
        raise Rejected(f"{code}_unsealed", f"{type_} {ident} was not sent by {sender}: its message id "
                                           f"{msg_id!r} is not sealed, and the daemon seals every firing")

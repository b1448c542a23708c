"""Fencing a partition's outputs: a stale owner's publishes are refused by JetStream itself.

The lease (`recovery.service.lease`) keeps two daemons from reading a partition at once as long as clocks and
pauses behave; the fence holds when they do not (a daemon frozen by a long GC pause or a SIGSTOP that wakes up
after its lease was taken over). The owner that takes a partition first publishes a claim on the partition's fence
subject in each stream it writes to (`recovery.fence.log.<partition>` in the log, `recovery.fence.cmd.<partition>`
in the command stream), expecting the subject's last sequence it read (a compare-and-set), and then publishes every
output with `Nats-Expected-Last-Subject-Sequence` set to its claim's sequence on that fence subject
(`Nats-Expected-Last-Subject-Sequence-Subject`). Once a new owner has claimed, the server refuses each of the old
owner's publishes (error 10071, wrong last sequence: N): the old owner learns it is `Fenced` and stops.

A replicated stream's leader checks the expectation before it proposes the write, and while a conditional write on
the same fence subject is still in flight it refuses the next one without comparing anything (error 10164, wrong
last sequence, no number). That answer decides nothing: the write is sent again (`is_in_flight_refusal`). So that
a write sent again never lands after one sent behind it, a fenced owner publishes each stream's outputs in order,
one acknowledged before the next (`recovery.service.publisher`): the two streams' fences are separate subjects, so
the log's outputs and the commands still go side by side.
"""

from __future__ import annotations

import asyncio
import logging
import os

import nats.js.errors
import orjson
from nats.js import JetStreamContext

from events import subjects

logger = logging.getLogger("recovery.daemon")

EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a publish whose expected last sequence is not the stream's"""
IN_FLIGHT_CONDITIONAL = 10164
"""a replicated stream's refusal of a conditional write while another on the same subject is in flight: it compared
nothing, and the write is sent again"""
_COMMANDS = f"{subjects.PREFIX}.cmd."


class Fenced(RuntimeError):
    """Another owner claimed the partition after this one: this one's publishes are refused; it must stop."""


def is_fence_refusal(exc: BaseException) -> bool:
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST_SEQUENCE


def fenced_stream(subject: str) -> str:
    """Which of the two fenced streams an output on `subject` goes to (`log` or `cmd`)."""
    return "cmd" if subject.startswith(_COMMANDS) else "log"


def is_in_flight_refusal(exc: BaseException) -> bool:
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code == IN_FLIGHT_CONDITIONAL


class Fence:
    """One owner's claim on a partition's outputs, and the headers that make each output depend on it."""

    def __init__(self, js: JetStreamContext, key: str, owner: str, log_stream: str, command_stream: str) -> None:
        self.js = js
        self.key = key
        self.owner = owner
        self._targets = {"log": (log_stream, subjects.fence("log", key)),
                         "cmd": (command_stream, subjects.fence("cmd", key))}
        self.claimed: dict[str, int] = {}
        self._headers: dict[str, dict[str, str]] = {}

    async def claim(self) -> None:
        """Claim the partition in both streams, at once (a takeover waits on them): from now on an earlier owner's
        publishes are refused. A claim that races another one reads the new last sequence and claims again: only
        the lease holder claims, and it claims after every earlier holder did."""
        claims = [asyncio.ensure_future(self._claim_in(stream, subject)) for stream, subject in self._targets.values()]
        try:
            seqs = await asyncio.gather(*claims)
        finally:  # one failed (the caller claims both again): the other stops, not left running on its own
            for claim in claims:
                claim.cancel()
        for (kind, (_, subject)), seq in zip(self._targets.items(), seqs, strict=True):
            self.claimed[kind] = seq
            self._headers[kind] = {EXPECTED_LAST_SUBJECT_SEQUENCE: str(seq),
                                   EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: subject}
        logger.info("partition claimed", extra={"fields": {"partition": self.key, "claims": self.claimed}})

    async def _claim_in(self, stream: str, subject: str) -> int:
        """The sequence of this owner's claim on `subject` in `stream`."""
        while True:
            last = await self._last(stream, subject)
            body = orjson.dumps({"owner": self.owner, "pid": os.getpid(), "after": last})
            try:
                ack = await self.js.publish(subject, body, stream=stream,
                                            headers={EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)})
            except nats.js.errors.APIError as exc:
                if not (is_fence_refusal(exc) or is_in_flight_refusal(exc)):
                    raise
                continue  # read the subject's last sequence again (an in-flight write may be landing)
            return int(ack.seq)

    async def _last(self, stream: str, subject: str) -> int:
        try:
            return int((await self.js.get_last_msg(stream, subject)).seq or 0)
        except nats.js.errors.NotFoundError:
            return 0

    def headers(self, subject: str) -> dict[str, str]:
        """What an output on `subject` carries so that it is stored only while this claim is the last one."""
        return self._headers[fenced_stream(subject)]

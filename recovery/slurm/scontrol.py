"""The one door to Slurm: `scontrol`, run as a process (Slurm has no stable client library; its command line is
what operators use and what every Slurm version keeps).

Changing a node's state needs an operator or administrator of the cluster (root, SlurmUser or an account with
AdminLevel=Operator); reading does not, nor does expanding a host list.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, field

import anyio

logger = logging.getLogger("recovery.slurm")

TIMEOUT_S = 30.0
"""an scontrol that has not answered by then is stuck on an unreachable slurmctld: its own retries take 10 s"""
REASON_PREFIX = "recovery: "
"""what the drain reasons set here start with: a node drained by anyone else is never resumed from here"""
MAX_REASON = 240
"""Slurm keeps a reason in full, but `sinfo -R` and most dashboards show a line: a long one says less, not more"""


class ScontrolFailed(Exception):
    """scontrol exited with an error; `output` is what it said."""

    def __init__(self, args: list[str], code: int, output: str) -> None:
        super().__init__(f"`{' '.join(args)}` exited with {code}: {output.strip()}")
        self.output = output


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol -o show ...` line as its Key=Value pairs. A value may hold spaces (a Reason): a word without
    `=` belongs to the value before it."""
    record: dict[str, str] = {}
    key = ""
    for word in line.split(" "):
        name, sep, value = word.partition("=")
        if sep and name and (name[0].isupper() or name[0] == "_"):
            key = name
            record[key] = value
        elif key:
            record[key] += f" {word}"
    return record


@dataclass(frozen=True)
class NodeState:
    """What Slurm says of one node: its state flags (`IDLE`, `DRAIN`, `DOWN`...) and the reason it was given."""

    name: str
    states: frozenset[str]
    reason: str

    @property
    def drained(self) -> bool:
        """Drained or draining: out of service for new jobs."""
        return "DRAIN" in self.states

    @property
    def drained_by_recovery(self) -> bool:
        return self.drained and self.reason.startswith(REASON_PREFIX)


@dataclass
class Scontrol:
    """`scontrol` with the environment to reach one cluster (`SLURM_CONF` when it is not the system's)."""

    binary: str = "scontrol"
    env: dict[str, str] = field(default_factory=dict)

    def _command(self, args: list[str]) -> list[str]:
        return [self.binary, *args]

    def run_sync(self, args: list[str], timeout_s: float = TIMEOUT_S) -> str:
        command = self._command(args)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, **self.env}, check=False)
        except subprocess.TimeoutExpired:
            raise ScontrolFailed(command, -1, f"no answer within {timeout_s:g}s") from None
        if done.returncode != 0:
            raise ScontrolFailed(command, done.returncode, done.stderr or done.stdout)
        return done.stdout

    async def run(self, args: list[str], timeout_s: float = TIMEOUT_S) -> str:
        command = self._command(args)
        with anyio.move_on_after(timeout_s) as scope:
            done = await anyio.run_process(command, check=False, env={**os.environ, **self.env})
        if scope.cancelled_caught:
            raise ScontrolFailed(command, -1, f"no answer within {timeout_s:g}s")
        if done.returncode != 0:
            raise ScontrolFailed(command, done.returncode, (done.stderr or done.stdout).decode(errors="replace"))
        return done.stdout.decode(errors="replace")

    def hostnames(self, nodelist: str) -> list[str]:
        """A Slurm host list (`gpu-[01-03,07]`) expanded as Slurm expands it, in its order."""
        return [line.strip() for line in self.run_sync(["show", "hostnames", nodelist]).splitlines() if line.strip()]

    async def node(self, name: str) -> NodeState:
        record = parse_record((await self.run(["-o", "show", "node", name])).strip())
        return NodeState(name, frozenset(record.get("State", "").split("+")), record.get("Reason", ""))

    async def job(self, job_id: str) -> dict[str, str]:
        return parse_record((await self.run(["-o", "show", "job", job_id])).strip())

    async def drain(self, name: str, reason: str) -> None:
        """Take the node out of service for new jobs (a running one keeps it until it ends), saying why."""
        text = (REASON_PREFIX + " ".join(reason.split()))[:MAX_REASON]
        await self.run(["update", f"nodename={name}", "state=drain", f"reason={text}"])

    async def resume(self, name: str) -> None:
        await self.run(["update", f"nodename={name}", "state=resume"])

    async def requeue(self, job_id: str) -> None:
        """End the job's run and put it back in the queue: the batch script starts again on the nodes Slurm picks."""
        await self.run(["requeue", job_id])

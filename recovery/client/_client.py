"""`Client`: what a training script calls. See the package docstring."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recovery.client._channel import SOCKET_ENV, AgentChannel

GENERATION_ENV = "RECOVERY_GENERATION"
RESUME_PLAN_ENV = "RECOVERY_RESUME_PLAN"
JOB_ENV = "RECOVERY_JOB"
NODE_ENV = "RECOVERY_NODE"
HEARTBEAT_ENV = "RECOVERY_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 1.0
JOIN_ASK_S = 0.5


@dataclass(frozen=True)
class ShardSource:
    """Where one shard of the model state comes from: a tier (`peer`: live replicas) and its holders."""

    shard: int
    tier: str
    holders: list[str]


@dataclass(frozen=True)
class ResumePlan:
    """Where this process resumes: the checkpoint step (None: none usable), the next step to train, and per shard
    where the state comes from. A rank holds shard `rank % len(shards)`."""

    checkpoint_step: int | None
    next_step: int
    shards: list[ShardSource] = field(default_factory=list)

    def source_of(self, rank: int) -> ShardSource | None:
        return self.shards[rank % len(self.shards)] if self.shards else None

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        raw = json.loads(text)
        shards = [ShardSource(int(s["shard"]), str(s["tier"]), [str(h) for h in s["holders"]])
                  for s in raw.get("shards", [])]
        step = raw.get("checkpoint_step")
        return cls(None if step is None else int(step), int(raw["next_step"]), shards)


class Client:
    """A training process's side of its agent. Create it with `connect()`, once per process."""

    def __init__(self, socket_path: str | None, rank: int, generation: int = 0, plan: ResumePlan | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.rank = rank
        self.generation = generation
        self._plan = plan
        self._heartbeat_s = heartbeat_s
        self._step: int | None = None
        self._save: Callable[[int], dict[str, Any] | None] | None = None
        self._save_requested: str | None = None  # the request's id, until the step boundary runs it
        self._hold_after_save = False  # the request's: after saving, wait at the boundary to be stopped
        self._stop_requested = threading.Event()
        self._join_answers: dict[int, bool] = {}  # generation -> the agent's answer to joining it
        self._join_answered = threading.Condition()
        self._closed = threading.Event()
        self._channel = AgentChannel(socket_path, self._on_message) if socket_path else None
        self._thread: threading.Thread | None = None
        if self._channel is not None:
            self._send({"op": "hello", "pid": os.getpid()})
            self._thread = threading.Thread(target=self._beat, name="recovery-heartbeat", daemon=True)
            self._thread.start()

    # -- what training calls ---------------------------------------------------------------------------
    def resume_plan(self) -> ResumePlan | None:
        """The plan this process was started with: None on a job's first start."""
        return self._plan

    def report_step(self, step: int) -> None:
        """`step` steps are complete. At this boundary a dying checkpoint the agent asked for is written."""
        self._step = step
        self._send({"op": "step", "step": step})
        self.at_boundary()

    def at_boundary(self) -> None:
        """The state is that of a completed step (`report_step` calls it; so does a survivor waiting for the next
        generation, whose state is that of its last reported step): write a dying checkpoint the agent asked for.
        If the agent asked this process to stop after saving (its node is being taken away), it waits here for the
        agent's SIGTERM, so that no step is trained past the checkpoint."""
        if self._save_requested is None:
            return
        hold = self._hold_after_save
        self._run_save()
        if hold:
            self._stop_requested.set()
            threading.Event().wait()  # until the agent's SIGTERM ends the process

    def checkpoint_saved(self, step: int, tier: str, shards: list[int], location: str | None = None) -> None:
        """A checkpoint of `shards` at `step` is complete in `tier` (memory, local, dying, storage); `location`
        is where (a path or URL), kept by the agent for the operator."""
        self._send({"op": "checkpoint", "step": step, "tier": tier, "shards": list(shards), "location": location})

    def on_save(self, save: Callable[[int], dict[str, Any] | None]) -> None:
        """`save(step)` writes a dying checkpoint of this rank's state at `step` and may return
        `{"tier": ..., "shards": [...], "location": ...}` (default: tier `dying`, this rank's shard 0)."""
        self._save = save

    def collective_failed(self, generation: int, error: str, operation: str = "allreduce", timeout_s: float = 0.0,
                          step: int | None = None) -> None:
        """A collective of `generation`'s process group timed out in this live process (`error`: what the backend
        raised): the agent reports it as `process.collective_failed`, and with every rank alive the engine retries
        the step in a new generation. `step`: the step it belonged to (default: the one after the last reported)."""
        failed_step = step if step is not None else (self._step or 0) + 1
        self._send({"op": "collective_failed", "generation": generation, "step": failed_step,
                    "operation": operation, "timeout_s": timeout_s, "error": error[:1024]})

    def joined(self, generation: int) -> None:
        """This process re-formed its process group in `generation`: its reports now carry it."""
        self.generation = generation
        self._send({"op": "joined"})

    def may_join(self, generation: int, timeout_s: float) -> bool | None:
        """Ask the agent whether this process may join `generation`'s process group: True, False (the agent does
        not run it: a replacement of its rank may run elsewhere, or here), or None when no answer came within
        `timeout_s` (no agent: it died with the process still running, which must then not join). Without an agent
        socket at all (a script run by hand), True."""
        if self._channel is None:
            return True
        deadline = time.monotonic() + timeout_s
        with self._join_answered:
            while generation not in self._join_answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._send({"op": "join", "generation": generation, "pid": os.getpid()})
                # the heartbeat thread hands over the answer; asked again every half second (an agent restarted
                # meanwhile, a message dropped on a reconnect)
                self._join_answered.wait(min(left, JOIN_ASK_S))
            return self._join_answers[generation]

    def should_stop(self) -> bool:
        """The agent asked this process to stop (a graceful stop): finish the step and exit."""
        return self._stop_requested.is_set()

    def close(self, keep_heartbeats: bool = False) -> None:
        """The script is done with the client. With `keep_heartbeats` (a script about to exit), heartbeats go on
        from their daemon thread until the process has exited: an interpreter that takes seconds to end (torch's
        teardown on a loaded host) is not taken for a hung rank, and the agent reports the exit it sees."""
        # An agent that did not start this process (it was restarted meanwhile) cannot read its exit status: this
        # tells it that the exit to come is the script's own end.
        self._send({"op": "closing"})
        if keep_heartbeats:
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._heartbeat_s)
        if self._channel is not None:
            self._channel.close()

    # -- inside ----------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        if self._channel is not None:
            self._channel.send({**message, "rank": self.rank, "attempt": self.generation})

    def _beat(self) -> None:
        assert self._channel is not None
        while not self._closed.is_set():
            self._send({"op": "heartbeat", "step": self._step})
            # Waiting for the agent's messages is the pause between heartbeats.
            self._channel.poll(self._heartbeat_s)

    def _on_message(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "save":
            self._hold_after_save = bool(message.get("hold", False))
            self._save_requested = str(message.get("id", ""))
        elif op == "stop":
            self._stop_requested.set()
        elif op in ("join_ok", "join_refused"):
            with self._join_answered:
                self._join_answers[int(message.get("generation", -1))] = op == "join_ok"
                self._join_answered.notify_all()

    def _run_save(self) -> None:
        request, self._save_requested = self._save_requested, None
        self._hold_after_save = False
        step = self._step if self._step is not None else 0
        if self._save is None:
            self._send({"op": "save_failed", "id": request, "reason": "no save function registered"})
            return
        try:
            result = self._save(step) or {}
        except Exception as exc:  # the user's code: its failure is the agent's to report, not training's end
            self._send({"op": "save_failed", "id": request, "reason": f"{type(exc).__name__}: {exc}"})
            return
        self._send({"op": "saved", "id": request, "step": step, "tier": result.get("tier", "dying"),
                    "shards": result.get("shards", [0]), "location": result.get("location")})


def connect(heartbeat_s: float | None = None) -> Client:
    """The client for this process, from the environment its agent set (RANK, the agent's socket, the generation
    and the resume plan); without an agent, a client whose calls do nothing."""
    plan_text = os.environ.get(RESUME_PLAN_ENV)
    interval = heartbeat_s if heartbeat_s is not None else float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S))
    return Client(os.environ.get(SOCKET_ENV) or None, int(os.environ.get("RANK", "0")),
                  int(os.environ.get(GENERATION_ENV, "0")), ResumePlan.from_json(plan_text) if plan_text else None,
                  interval)

"""`Client`: what a training script calls. See the package docstring."""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recovery.client import memory
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
    skip_steps: frozenset[int] = frozenset()
    """steps rolled back as bad whose data the script must skip (it named none of its own for them)"""
    skip_data: frozenset[str] = frozenset()
    """the samples or batches the script named for its bad steps: skip them"""

    def source_of(self, rank: int) -> ShardSource | None:
        """Where `rank`'s shard of the state comes from (its tier and holders); None: the plan names none."""
        return self.shards[rank % len(self.shards)] if self.shards else None

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        """The plan as the agent passes it in RECOVERY_RESUME_PLAN (`connect` reads it)."""
        raw = json.loads(text)
        shards = [ShardSource(int(s["shard"]), str(s["tier"]), [str(h) for h in s["holders"]])
                  for s in raw.get("shards", [])]
        step = raw.get("checkpoint_step")
        return cls(None if step is None else int(step), int(raw["next_step"]), shards,
                   frozenset(int(s) for s in raw.get("skip_steps", [])),
                   frozenset(str(d) for d in raw.get("skip_data", [])))


_live: Client | None = None
"""the process's client connected to an agent, if any (the step hook stays quiet beside one)"""


def live_client() -> Client | None:
    return _live


class Client:
    """A training process's side of its agent. Create it with `connect()`, once per process."""

    def __init__(self, socket_path: str | None, rank: int, generation: int = 0, plan: ResumePlan | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, counts: bool = False) -> None:
        """`counts`: the client of the step hook (`recovery.client.steps`), which says so before its first
        heartbeat: its steps are counts of optimizer steps since the process started."""
        global _live
        self._pid = os.getpid()  # a forked child inherits the client, and its exit handlers, but is not the rank
        self.rank = rank
        self.generation = generation
        self._plan = plan
        self._heartbeat_s = heartbeat_s
        self._step: int | None = None
        self._caps: set[str] = set()  # what this process said it can do (`announce`)
        self._save: Callable[[int], dict[str, Any] | None] | None = None
        self._save_requested: str | None = None  # the request's id, until the step boundary runs it
        self._hold_after_save = False  # the request's: after saving, wait at the boundary to be stopped
        self._stop_requested = threading.Event()
        self._join_answers: dict[int, bool] = {}  # generation -> the agent's answer to joining it
        self._world_callbacks: list[Callable[[int, int], None]] = []
        self._join_answered = threading.Condition()
        self._closed = threading.Event()
        self._memory_dir = memory.memory_dir()
        self._slots: memory.MemorySlots | None = None
        self._channel = AgentChannel(socket_path, self._on_message, self._said) if socket_path else None
        self._thread: threading.Thread | None = None
        if self._channel is not None:
            _live = self
            self._send({"op": "hello", "pid": os.getpid()})
            if counts:
                self.announce("counts")
            self._thread = threading.Thread(target=self._beat, name="recovery-heartbeat", daemon=True)
            self._thread.start()
            # Registered first, run last: after the script's own exit handlers, just before finalisation.
            atexit.register(self._exiting)

    # -- what training calls ---------------------------------------------------------------------------
    @property
    def memory_directory(self) -> Path | None:
        """The job's directory of this node's shared memory that the agent keeps (`save_async` writes there), or
        None without one."""
        return self._memory_dir

    def resume_plan(self) -> ResumePlan | None:
        """The plan this process was started with: None on a job's first start."""
        return self._plan

    def report_step(self, step: int, compute_s: float | None = None, loss: float | None = None,
                    skip: list[str] | None = None) -> None:
        """`step` steps are complete. At this boundary a dying checkpoint the agent asked for is written.

        `compute_s`: how long this rank computed the step, from its start to its first collective (not the wall
        time: in synchronous data parallelism every rank waits for the slowest in the collective, so only the time
        before it tells a slow GPU or host from its peers). The control plane drains the node of a rank persistently
        slower than its peers.

        `loss` is the step's training loss: a NaN, an infinity or a spike makes it a bad step, and the job rolls back
        to a checkpoint before it. `skip` names the step's data (sample or batch ids, at most 64 of up to 128
        characters): what the job skips should the step be bad; without it, the step itself is skipped
        (`skip_steps`)."""
        self._step = step
        self.announce("steps")
        message: dict[str, Any] = {"op": "step", "step": step}
        if compute_s is not None:
            message["compute_s"] = compute_s
        if loss is not None:
            value = float(loss)
            # JSON has no NaN nor infinity: the agent reads them as these words
            message["loss"] = value if math.isfinite(value) else "nan" if math.isnan(value) else (
                "inf" if value > 0 else "-inf")
            if skip:
                message["skip"] = [str(name) for name in skip]
        self._send(message)
        self.at_boundary()

    @property
    def skip_steps(self) -> frozenset[int]:
        """Steps (as `report_step` counts them) whose data this run must skip: bad steps rolled back before, for which
        the script named no data. Step n's data is what the script trains on to complete step n."""
        return self._plan.skip_steps if self._plan is not None else frozenset()

    @property
    def skip_data(self) -> frozenset[str]:
        """The samples or batches the script named (`report_step(..., skip=...)`) for bad steps: skip them."""
        return self._plan.skip_data if self._plan is not None else frozenset()

    def skips(self, step: int, data: list[str] | tuple[str, ...] = ()) -> bool:
        """Should the script skip the data of `step` (or the named `data`) rather than train on it?"""
        return step in self.skip_steps or any(name in self.skip_data for name in data)

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
        self.announce("checkpoints")
        self._send({"op": "checkpoint", "step": step, "tier": tier, "shards": list(shards), "location": location})

    def save_async(self, state: Any, step: int | None = None, *, shards: list[int] | None = None,
                   storage: str | os.PathLike[str] | None = None, keep: int = 1) -> Path | None:
        """Checkpoint `state` (tensors anywhere in it, on the CPU) at `step` (default: the last reported) into the
        node agent's shared memory, which outlives this process: training stalls only for the copy. The agent
        reports it (tier `memory`, this node), and with `storage` (a directory every node reads) persists it there
        in the background and reports that too (tier `storage`). `shards`: the shards the state is (default: 0);
        `keep`: how many of this rank's newest checkpoints the agent keeps in memory (default 1: the newest).
        Returns the file, or None when the agent keeps no memory tier (none, or an older one)."""
        if self._memory_dir is None:
            return None
        if self._slots is None:
            self._slots = memory.MemorySlots(self._memory_dir, self.rank)
        at = step if step is not None else (self._step if self._step is not None else 0)
        shards = list(shards) if shards is not None else [0]
        path = self._memory_dir / memory.file_name(at, shards[0], self.rank)
        self.announce("checkpoints")
        self._slots.write(state, path)
        self._send({"op": "memory_saved", "step": at, "shards": shards, "file": path.name,
                    "storage": None if storage is None else str(Path(storage).resolve()), "keep": keep})
        return path

    def held_copy(self, step: int, shards: list[int], path: Path, for_rank: int, keep: int = 1) -> None:
        """`path`, in this node's shared memory, is now a whole copy of rank `for_rank`'s checkpoint of `shards` at
        `step` (a sharded job's copy for a rank on another node): the agent reports it in tier `memory` on this
        node, keeps the newest `keep` of that rank's copies here and never persists them (their rank does)."""
        self._send({"op": "memory_saved", "step": step, "shards": list(shards), "file": path.name, "storage": None,
                    "held_for": for_rank, "keep": keep})

    def restore(self, storage: str | os.PathLike[str] | None = None) -> memory.Restored | None:
        """The state the resume plan names for this rank in the `memory` or `storage` tier, read from this node's
        shared memory (an in-place restart) or from `storage`, where `save_async` persisted it; None without such
        a plan (a first start, or the `peer` or `dying` tier, which the script reads itself)."""
        plan = self._plan
        source = plan.source_of(self.rank) if plan is not None else None
        if plan is None or source is None or plan.checkpoint_step is None:
            return None
        return memory.restore(plan.checkpoint_step, source.shard, source.tier, source.holders,
                              os.environ.get(NODE_ENV), self._memory_dir,
                              None if storage is None else Path(storage))

    def on_save(self, save: Callable[[int], dict[str, Any] | None]) -> None:
        """`save(step)` writes a dying checkpoint of this rank's state at `step` and may return
        `{"tier": ..., "shards": [...], "location": ..., "shared": ...}` (default: tier `dying`, this rank's shard
        0, on this node only; `shared: True` when every node reads `location`, so that it outlives this node)."""
        self._save = save
        self.announce("save")

    def count_step(self, count: int) -> None:
        """The step hook's report: `count` optimizer steps since this process started (not the job's step)."""
        self._step = count
        self._send({"op": "step", "step": count})

    def _said(self) -> list[dict[str, Any]]:
        """What a new connection to the agent is told again: the capabilities said so far."""
        said = {"op": "caps", "caps": sorted(self._caps), "rank": self.rank, "attempt": self.generation}
        return [said] if self._caps else []

    def announce(self, capability: str) -> None:
        """Say that this process can do `capability`: `reform` (its process group is formed again in this process
        when a peer restarts: `ProcessGroupRecovery` says it), `save` (`on_save` says it), `checkpoints`
        (`checkpoint_saved` and `save_async` say it), `steps` (`report_step` says it), `stops` (`should_stop` says
        it). The control plane restarts a rank alone, keeping its peers' processes, only where the ranks said
        `reform`, and asks a dying checkpoint only where they said `save`; an integration that wires these up in a
        framework's own loop says so here."""
        if capability in self._caps:
            return
        self._caps.add(capability)
        self._send({"op": "caps", "caps": sorted(self._caps)})

    def on_world_change(self, callback: Callable[[int, int], None]) -> None:
        """`callback(world_size, rank)` runs when this process re-forms its process group in a world of another size
        or as another rank (an elastic job scaled in or out), after the group formed and before training goes on (a
        process started in the new world is not called, so no collective there): the script decides what happens to
        its global batch (keep it by accumulating more micro-batches per
        rank, as `examples/dp-training/train.py` does, or scale it and the learning rate). Without a callback the
        script reads `ProcessGroupRecovery.world_size` and `rank` itself."""
        self._world_callbacks.append(callback)

    def world_changed(self, world_size: int, rank: int) -> None:
        """This process re-formed as `rank` of `world_size` (`ProcessGroupRecovery` calls it): the callbacks run."""
        self.rank = rank
        for callback in self._world_callbacks:
            callback(world_size, rank)

    def collective_failed(self, generation: int, error: str, operation: str = "allreduce", timeout_s: float = 0.0,
                          step: int | None = None) -> None:
        """A collective of `generation`'s process group timed out in this live process (`error`: what the backend
        raised): the agent reports it as `process.collective_failed`, and with every rank alive the engine retries
        the step in a new generation. `step`: the step it belonged to (default: the one after the last reported)."""
        failed_step = step if step is not None else (self._step or 0) + 1
        self._send({"op": "collective_failed", "generation": generation, "step": failed_step,
                    "operation": operation, "timeout_s": timeout_s, "error": error[:1024]})

    def peer_lost(self, generation: int, error: str) -> None:
        """A peer's connection in `generation`'s process group closed under this live process (`error`: what the
        backend raised): the peer died, maybe with its host and agent, which then say nothing. The agent tells the
        daemon, which asks the job's agents at once instead of waiting out their silence
        (`recovery.service.reachability`)."""
        self._send({"op": "peer_lost", "generation": generation, "error": error[:1024]})

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
        """The agent asked this process to stop (a graceful stop): finish the step and exit. Calling it says
        `stops`: from then on the agent asks a stop here first, and signals only after half the grace."""
        if "stops" not in self._caps:
            self.announce("stops")
        return self._stop_requested.is_set()

    def close(self, keep_heartbeats: bool = False) -> None:
        """The script is done with the client. With `keep_heartbeats` (a script about to exit), heartbeats go on
        from their daemon thread until the process has exited: an interpreter that takes seconds to end (torch's
        teardown on a loaded host) is not taken for a hung rank, and the agent reports the exit it sees."""
        # An agent that did not start this process (it was restarted meanwhile) cannot read its exit status: this
        # tells it that the exit to come is the script's own end.
        self._send({"op": "closing", "pid": os.getpid()})
        if keep_heartbeats:
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._heartbeat_s)
        if self._channel is not None:
            self._channel.close()
        if self._slots is not None:
            self._slots.close()

    # -- inside ----------------------------------------------------------------------------------------
    def _exiting(self) -> None:
        """The interpreter is exiting: from here on no heartbeat comes (finalisation stops the heartbeat's daemon
        thread, and tearing torch down takes seconds on a loaded host), so the agent hears that the process is
        ending, not hung. Not `closing`: the exit status is not known here, and an agent that did not start the
        process must not count a failure as a clean end."""
        if not self._closed.is_set() and os.getpid() == self._pid:
            self._send({"op": "exiting", "pid": os.getpid()})

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
                    "shards": result.get("shards", [0]), "location": result.get("location"),
                    "shared": result.get("shared") is True})


def connect(heartbeat_s: float | None = None, counts: bool = False) -> Client:
    """The client for this process, from the environment its agent set (RANK, the agent's socket, the generation
    and the resume plan); without an agent, a client whose calls do nothing."""
    plan_text = os.environ.get(RESUME_PLAN_ENV)
    interval = heartbeat_s if heartbeat_s is not None else float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S))
    return Client(os.environ.get(SOCKET_ENV) or None, int(os.environ.get("RANK", "0")),
                  int(os.environ.get(GENERATION_ENV, "0")), ResumePlan.from_json(plan_text) if plan_text else None,
                  interval, counts)

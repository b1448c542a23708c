"""PyTorch helpers of the SDK: in-process recovery of a data-parallel job's survivors on gloo. torch is imported
inside the functions, so that `import recovery.client` never imports it.

A partial restart replaces only the dead ranks. The survivors notice on gloo (a collective with a dead peer raises a
`RuntimeError` within tens of milliseconds) and do not exit:

    group = ProcessGroupRecovery(client)
    group.form()                                    # the process group of the generation the agent gave us
    step = load_own_snapshot()                      # the script's own resume point: 0 without one
    # a process started into a running job takes a live replica's state and step (`live=False`)
    step = group.synchronize(step, get_state, set_state, live=not group.takes_peer_state())
    while step < steps:
        failed = False
        try:
            group.check()                           # a newer generation: peers replaced behind a live group
            train_one_step(step)                    # its collectives raise RuntimeError when a peer dies
        except RuntimeError:
            failed = True                           # leave the except block first: see `recover`
        if failed:
            group.recover()
            step = group.synchronize(step, get_state, set_state)
            continue
        step += 1
        client.report_step(step)

Generations live on the job store (never in a training process, so rank 0 may die like any other: the agent of the
job's first node serves it, or the platform off the training nodes, see `recovery.agent.rendezvous`), under the job's
run id: each generation's process group uses its own key prefix (`gen<g>/`), and a process started in a new
generation announces it under `recovery/generation`; an agent's request for the generation's torch store says it
earlier, tens of milliseconds after the engine's decision.

gloo tells a survivor about a dead peer only if it waits on that peer: in a ring all_reduce (DDP's buckets, any
gradient bigger than a few kilobytes) a survivor between two other survivors waits on them, and they, having caught
the error, hold their connections open (`destroy_process_group` releases none of them: measured, the same four
sockets before and after it and a gc, with or without DDP), so it waited out the group's timeout. Hence a watcher
thread per live group: when a peer marks the generation failed (`recover` does, first) or a newer generation is
decided, it shuts the group's connections down under it (shutdown(2) on the TCP connections the group opened; gloo's
own `abort()` frees nothing on gloo), and the blocked collective raises within `WATCH_S`. Where a survivor cannot
notice (a peer stopped rather than dead), the agent kills the stuck peer, which turns it into the case above, or the
group's timeout ends the wait.

A new generation forms once every rank has arrived in it; one that a newer generation supersedes before then (a
second fault during a recovery) is abandoned for the newest, so no process waits in a generation the engine gave up.
Where the peers were replaced while their processes live on (their node's agent died, so the engine moved them), the
watcher (or `check`, at a step boundary) sees the newer generation; the old processes ask their agent before joining
(`Client.may_join`), find none or are refused, and exit instead of joining beside their replacements.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import io
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from recovery.client import _backend
from recovery.client._client import Client

logger = logging.getLogger("recovery.client")

GENERATION_KEY = "recovery/generation"
WORLD_KEY = "{run_id}/recovery/world/{generation}"
"""the world of a generation that a scale decided (an elastic job scaled in or out), a key of the job store itself like
TORCH_STORE_KEY: `world_size`, and `nodes` with `ranks_per_node`, from which a process that lives on into it takes its
rank (its node's place, its local rank). Written by the agents before they announce the generation
(`recovery.agent.rescale`); a generation without one keeps the world of the one before."""
TORCH_STORE_KEY = "{run_id}/recovery/torch-store/{generation}"
"""where the job store answers an agent's request for generation's torch store (`recovery.agent.rendezvous`, a key of
the store itself, not under the SDK's prefix): it is there tens of milliseconds after the engine decided the
generation, before any process of it has started"""
POLL_S = 0.01
"""how often a survivor looks for the new generation: a store read, cheap against a restart's second"""
WATCH_S = 0.05
"""how often the watcher of a live group reads the job store (three reads): how late a blocked survivor is freed"""
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure")
"""how gloo says a collective of this process timed out (`Timed out waiting 5000ms for recv operation to complete`;
or, for an operation its own timeout closed the pairs under, `Application timeout caused pair closure`), where a
dead peer (or a peer's timeout) is `Connection closed by peer` or `Connection reset by peer`"""
FORM_TIMEOUT_S = 5.0
"""the longest forming a group may take once every rank has arrived in its generation: a peer that died after
arriving makes it fail, and the survivors wait for the next generation instead of the group's whole timeout"""


class RecoveryTimeout(TimeoutError):
    """No new generation came in time, or no agent answered whether to join it: the process exits, and the agent's
    report of it escalates."""


class RecoveryFenced(RuntimeError):
    """The agent does not run this process any more (its rank was replaced while the process outlived the agent
    that started it): it must not join the new generation beside its replacement, and exits."""


class GenerationChanged(RuntimeError):
    """A newer generation was announced while this process's collectives still worked: peers were replaced without
    this process noticing a failure (their node's agent died, not their processes). Handled as a failed collective:
    `recover`."""


class _JobStore:
    """A client of the job store, where generations live across formations (RECOVERY_STORE_ADDR/PORT; an older
    agent gave only MASTER_ADDR/PORT, which then is the job store): `scoped`, the SDK's keys under the job's run id
    (a store the platform runs off the training nodes serves many jobs), and `raw`, the store's own keys."""

    def __init__(self, timeout: timedelta) -> None:
        import torch.distributed as dist

        addr = os.environ.get("RECOVERY_STORE_ADDR") or os.environ["MASTER_ADDR"]
        port = int(os.environ.get("RECOVERY_STORE_PORT") or os.environ["MASTER_PORT"])
        self.raw = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        self.scoped = dist.PrefixStore(f"{self.run_id}/", self.raw) if self.run_id else self.raw

    def torch_store_asked(self, generation: int) -> bool:
        """Has an agent asked the job store for `generation`'s torch store (the engine decided it)?"""
        return self.run_id is not None and \
            self.raw.check([TORCH_STORE_KEY.format(run_id=self.run_id, generation=generation)])


def _sockets() -> dict[int, str]:
    """This process's open sockets: fd -> `socket:[inode]`."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:"):
                    found[int(name)] = link
    return found


def _connections_since(before: dict[int, str]) -> dict[int, str]:
    """The TCP connections opened since `before` (the group's pairs to its peers), without listening sockets (gloo
    aborts the process when its listener fails)."""
    opened: dict[int, str] = {}
    for fd, link in _sockets().items():
        if before.get(fd) == link:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and \
                        not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    opened[fd] = link
        except OSError:
            continue
    return opened


def _shut(connections: dict[int, str]) -> None:
    """Shut the group's connections down under it: a collective blocked on one raises at once ("Connection closed"),
    and each peer's end sees its side closed too. The descriptors stay gloo's, to close when the group is freed;
    one whose number now names another socket is left alone."""
    open_now = _sockets()
    for fd, link in connections.items():
        if open_now.get(fd) != link:
            continue
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)


class ProcessGroupRecovery:
    """The default process group of one rank, formed again in every generation. Not thread-safe: one training
    thread calls it; its own watcher thread only tears a live group down."""

    def __init__(self, client: Client, backend: str = "gloo", timeout_s: float = 30.0,
                 wait_for_generation_s: float = 300.0, check_every_s: float = 1.0, watch: bool = True) -> None:
        self.client = client
        client.announce("reform")  # peers restarted alone find this process's group formed again with them
        self.check_every_s = check_every_s
        self._checked = 0.0
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.wait_for_generation_s = wait_for_generation_s
        self.watch = watch
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        """this process's rank and world size in the generation it last formed: a scale of an elastic job changes them
        (`Client.on_world_change` tells the script)"""
        self._world_known = client.generation  # the generation whose world this process knows
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = _backend.collective_device(backend, self._local_rank)
        """where the SDK's own collectives keep their tensors: the GPU of this process on NCCL, the CPU on gloo"""
        self._store: _JobStore | None = None
        self.recoveries = 0
        self.holders: list[Callable[[], None]] = []
        """called before the group is destroyed: each drops an object's hold on it (a DDP wrapper)"""
        self._lock = threading.Lock()  # the live group, between the training thread and the watcher
        self._formed: int | None = None  # the generation of the live group
        self._connections: dict[int, str] = {}
        self._aborted = False  # the watcher shut the live group down
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this process, in arrivals
        # A watcher still reading the store while the interpreter finalises aborts the process (a C++ terminate):
        # stopped first, however the script ends.
        atexit.register(self._stop_watcher)

    @property
    def job_store(self) -> _JobStore:
        """The job's long-lived store (RECOVERY_STORE_ADDR/PORT), where the generations live."""
        if self._store is None:
            self._store = _JobStore(self.timeout)
        return self._store

    @property
    def store(self) -> Any:
        """The job store, under the job's run id: the SDK's keys (generations, arrivals, failures, process groups)."""
        return self.job_store.scoped

    def _announced(self, store: Any = None) -> int:
        store = store or self.store
        return int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else -1

    def newest(self, job_store: _JobStore | None = None) -> int:
        """The newest generation decided for the job: the one a process started in it announced, or a later one
        whose torch store an agent asked for before starting its ranks (tens of milliseconds after the engine's
        decision, where the announcement waits for the new process's imports)."""
        job_store = job_store or self.job_store
        newest = max(self._announced(job_store.scoped), self.client.generation)
        while job_store.torch_store_asked(newest + 1):
            newest += 1
        return newest

    def takes_peer_state(self) -> bool:
        """This process was started to receive its state from a live replica (its resume plan names the `peer`
        tier): its own state is not live, whatever snapshot it loaded (`synchronize(..., live=False)`)."""
        plan = self.client.resume_plan()
        source = plan.source_of(self.rank) if plan is not None else None
        return source is not None and source.tier == "peer"

    @property
    def aborted(self) -> bool:
        """The watcher shut the live group down (a peer failed, or a newer generation was decided)."""
        return self._aborted

    def form(self) -> None:
        """Join the process group of the client's generation, announcing the generation if it is new; if a newer
        one is decided before every rank has arrived (a second fault during a recovery), join that one instead."""
        generation = self.client.generation
        self._announce(generation)
        self._join(generation, time.monotonic() + self.wait_for_generation_s, survivor=False)

    def _announce(self, generation: int) -> None:
        """Announce `generation` unless a newer one is announced already, atomically: two faults a few milliseconds
        apart start their replacements together, each in its own generation, and a read then a write let the older
        one's process overwrite the newer announcement. Survivors would then see the older generation as the
        newest (where the job store writes no torch-store keys to tell them better) and wait in the one the engine
        abandoned, for a rank whose replacement waits in the newer one."""
        seen = self.store.get(GENERATION_KEY).decode() if self.store.check([GENERATION_KEY]) else ""
        while not seen or int(seen) < generation:  # the store's compare-and-set answers what it holds now
            seen = self.store.compare_set(GENERATION_KEY, seen, str(generation)).decode()

    def check(self) -> None:
        """At a step boundary, before the step's collectives: raise `GenerationChanged` if a newer generation was
        announced (read at most every `check_every_s`, one store read), or the watcher shut the group down. Ranks
        replaced while their processes kept running (the agent of their node died) are otherwise noticed only by
        the watcher: the survivors would train on with those processes while the replacements wait."""
        if self._aborted:
            raise GenerationChanged("the process group was shut down: a peer failed or a newer generation began")
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        if self._announced() > self.client.generation:
            raise GenerationChanged(f"generation {self._announced()} announced; this process is in "
                                    f"{self.client.generation}")

    def settled(self) -> None:
        """After a step's collectives were queued and before their result is used (an optimizer's step): wait for
        them (NCCL returns to the host before they ran; nothing to wait for on gloo) and raise `GenerationChanged` if
        the watcher aborted the group meanwhile, since an aborted NCCL kernel returns without an error and its
        result is partial. `Training.wrap` calls it before every optimizer step on NCCL."""
        _backend.settle(self.backend)
        if self._aborted:
            raise GenerationChanged("the process group was aborted: a peer failed or a newer generation began")

    def collective_failed(self, exc: BaseException) -> bool:
        """Is `exc` a failure of the group (a peer gone, the group shut down) rather than the script's own error?"""
        import torch.distributed as dist

        text = str(exc).lower()
        return self._aborted or isinstance(exc, (GenerationChanged, dist.DistError)) or "gloo" in text or \
            "nccl" in text

    def timed_out(self, error: str) -> bool:
        """Did the group's own collective time out (`error`, the text of what it raised), every peer of this process
        maybe alive? Not when the watcher shut the group down (a peer failed first, or a newer generation began),
        nor a peer's closed connection (it died: its exit is the fault)."""
        return not self._aborted and any(said in error for said in TIMED_OUT)

    def recover(self, error: str | None = None) -> None:
        """After a collective failed: tear the group down, wait for the next generation, form it.

        Call it outside the `except` block that caught the failure (the traceback holds the frames that hold
        the process group), with the failure's text as `error` (`str(exc)`): a collective that timed out is
        reported to the agent (`Client.collective_failed`), and with every rank alive the engine retries the step in
        a new generation, which this process then joins, as it joins one after a peer's restart; a peer's closed
        connection is reported too (`Client.peer_lost`): the daemon asks the agents at once. The group's
        connections are shut first, so that peers blocked on this process are freed at once even while something
        still holds it, and its failure is marked in the job store, where every peer's watcher sees it and shuts its
        own group down: a survivor blocked in a collective with other survivors only (not next to the dead rank) is
        freed within `WATCH_S`, not at the group's timeout."""
        failed = self._formed if self._formed is not None else self.client.generation
        if error is not None and self.timed_out(error):
            self.client.collective_failed(failed, error, timeout_s=self.timeout.total_seconds())
        elif error is not None and not self._aborted:  # a peer's connection closed: its host may be gone, unheard
            self.client.peer_lost(failed, error)
        with contextlib.suppress(Exception):  # the store unreachable: the peers' own failures free them
            self.store.set(f"gen{failed}/failed", str(self.rank))
        self._teardown()
        deadline = time.monotonic() + self.wait_for_generation_s
        self._join(self._wait_newer(failed, deadline), deadline, survivor=True)
        self.recoveries += 1

    def _wait_newer(self, generation: int, deadline: float) -> int:
        while (newest := self.newest()) <= generation:
            if time.monotonic() > deadline:
                raise RecoveryTimeout(f"no generation after {generation} within {self.wait_for_generation_s:g}s")
            # A dying checkpoint asked of this survivor (a healthy replica, MindIO TTP's power-off checkpoint) is
            # written while it waits: its state is that of its last reported step, and the restart may wait for it.
            self.client.at_boundary()
            time.sleep(POLL_S)  # polling the job store, within the deadline above
        return newest

    def _join(self, generation: int, deadline: float, survivor: bool) -> None:
        """Form the group of `generation` or of a newer one: arrive in it, wait for every rank to arrive (moving on
        to a newer generation decided meanwhile: the engine abandoned this one), then form it among the processes
        that arrived. A process that dies after arriving makes the forming fail (after `FORM_TIMEOUT_S`): the
        others form again, with its rank's replacement once it arrived, until a newer generation is decided."""
        started_in = self.client.generation
        asked = -1
        world = (self.world_size, self.rank)
        while True:
            self._take_world(generation)  # before asking: the agent's answer reaches this process under its new rank
            if (survivor or generation != started_in) and asked != generation:
                self._may_join(generation, deadline)
                asked = generation
            self.store.set(f"gen{generation}/arrived/{self.rank}", self._token)
            keys = [f"gen{generation}/arrived/{rank}" for rank in range(self.world_size)]
            newer = generation
            while not self.store.check(keys) and (newer := self.newest()) <= generation:
                self._pause(deadline, f"not every rank arrived in generation {generation}", survivor)
            newer = max(newer, self.newest())  # every rank arrived, some maybe dead since: a newer one still wins
            if newer > generation:
                logger.info("rank %d: generation %d abandoned before it formed: joining %d", self.rank, generation,
                            newer)
                generation = newer  # abandoned by the engine before it formed: join the newest
                continue
            arrived = self.store.multi_get(keys)
            # The group's keys are those of this set of processes: a process that died after arriving (or after
            # writing its address) leaves keys that its replacement's forming must not read.
            formation = hashlib.sha256(b"|".join(arrived)).hexdigest()[:16]
            # Each try of a set has keys of its own (a failed try's addresses are dead): the first of its processes
            # to fail moves the set on to the next try, and the others follow when theirs fails too.
            tries = f"gen{generation}/{formation}/try"
            attempt = self.store.compare_set(tries, "", "0").decode()
            if self._init(generation, f"{formation}/{attempt}"):
                logger.info("rank %d: formed generation %d", self.rank, generation)
                break
            self.store.compare_set(tries, attempt, str(int(attempt) + 1))
            # A rank that arrived is gone, or its replacement arrived while others formed without it: read the
            # arrivals again and form again, every live process the same set in the end; a newer generation wins.
            logger.info("rank %d: generation %d did not form: forming it again", self.rank, generation)
            self._pause(deadline, f"generation {generation} did not form", survivor)
        if generation != self.client.generation:
            self.client.joined(generation)
        if (self.world_size, self.rank) != world:
            logger.info("rank %d of %d (was %d of %d) in generation %d", self.rank, self.world_size, world[1],
                        world[0], generation)
            self.client.world_changed(self.world_size, self.rank)
        if self.watch:
            self._stop_watching = threading.Event()
            self._watcher = threading.Thread(target=self._watch, args=(generation, self._stop_watching),
                                             name=f"recovery-watch-gen{generation}", daemon=True)
            self._watcher.start()

    def _take_world(self, generation: int) -> None:
        """Take the world a scale decided for `generation` (or for the newest generation before it that had one), if
        this process does not know it yet: its world size, and its rank (its node's place in the new placement, its
        local rank). A process whose node the new placement leaves out must not join: the agent ends it."""
        found = None
        raw, run_id = self.job_store.raw, self.job_store.run_id
        for candidate in range(generation, self._world_known, -1) if run_id is not None else ():
            key = WORLD_KEY.format(run_id=run_id, generation=candidate)
            if raw.check([key]):
                found = json.loads(raw.get(key))
                break
        self._world_known = max(self._world_known, generation)
        if found is None:
            return
        node = os.environ.get("RECOVERY_NODE", "")
        nodes = [str(n) for n in found["nodes"]]
        if node not in nodes:
            raise RecoveryFenced(f"generation {generation} runs on {nodes}, not on this process's node {node!r}")
        self.rank = nodes.index(node) * int(found["ranks_per_node"]) + self._local_rank
        self.world_size = int(found["world_size"])
        self.client.rank = self.rank  # its reports, and the agent's answers, under its new rank

    def _stop_watcher(self) -> None:
        self._stop_watching.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5 * WATCH_S + 1.0)

    def _pause(self, deadline: float, what: str, survivor: bool) -> None:
        if time.monotonic() > deadline:
            raise RecoveryTimeout(f"{what} within {self.wait_for_generation_s:g}s")
        if survivor:
            self.client.at_boundary()  # a dying checkpoint asked of a survivor is written while it waits
        time.sleep(POLL_S)  # polling the job store, within the deadline

    def _may_join(self, generation: int, deadline: float) -> None:
        """Only a process the node's agent runs may join: one that outlived its agent may have been replaced."""
        answer = self.client.may_join(generation, max(0.0, deadline - time.monotonic()))
        if answer is None:
            raise RecoveryTimeout(f"no agent answered whether this process may join generation {generation} within "
                                  f"{self.wait_for_generation_s:g}s")
        if not answer:
            raise RecoveryFenced(f"the agent does not run this process any more: not joining generation "
                                 f"{generation}")

    def _init(self, generation: int, formation: str) -> bool:
        import torch.distributed as dist

        form_timeout = min(self.timeout, timedelta(seconds=FORM_TIMEOUT_S))
        options = _backend.prepare(self.backend, self._local_rank)
        before = _sockets()
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}/{formation}/", self.store),
                                    rank=self.rank, world_size=self.world_size, timeout=form_timeout, **options)
        except RuntimeError:  # a peer's address never came, or it refused the connection: it died meanwhile
            _backend.release(self.backend, aborted=True)
            return False
        if form_timeout < self.timeout:
            dist.distributed_c10d._set_pg_timeout(self.timeout)  # the collectives' timeout, as asked
        with self._lock:
            self._formed, self._aborted = generation, False
            self._connections = _connections_since(before)
        return True

    def shut_with_group(self, before: dict[int, str]) -> None:
        """The TCP connections opened since `before` (`_sockets()` before a device mesh's subgroups were made) are
        shut with the group's own on a failure: a collective blocked in a subgroup is freed as in the default one."""
        with self._lock:
            if self._formed is not None:
                self._connections.update(_connections_since(before))

    def _watch(self, generation: int, stop: threading.Event) -> None:
        """While the group of `generation` lives: shut it down as soon as a peer marks it failed or a newer
        generation is decided, so that a collective blocked in it raises now."""
        failed = f"gen{generation}/failed"
        store: _JobStore | None = None  # its own connection (the training thread's may be busy), closed with it
        while not stop.wait(WATCH_S):
            try:
                if store is None:
                    store = _JobStore(self.timeout)
                if store.scoped.check([failed]) or self.newest(store) > generation:
                    logger.info("rank %d: generation %d failed or superseded: shutting its group down", self.rank,
                                generation)
                    with self._lock:
                        if self._formed == generation and not self._aborted:
                            self._interrupt()
                    return
            except Exception:  # the store unreachable: the group's own failures and timeout still end a collective
                continue

    def _interrupt(self) -> None:
        """Under the lock: end the live group's collectives now, blocked or queued. The flag comes first: an aborted
        NCCL kernel returns without an error, and `settled` reads the flag once the stream is through."""
        self._aborted = True
        if not _backend.abort(self.backend):
            _shut(self._connections)

    def _teardown(self) -> None:
        self._stop_watcher()
        with self._lock:
            if self._formed is not None and not self._aborted:
                self._interrupt()  # peers blocked on this process are freed now, whatever holds the group
            aborted = self._aborted
            self._formed, self._connections = None, {}
        for release in self.holders:
            release()
        _backend.release(self.backend, aborted)

    def synchronize(self, step: int, get_state: Callable[[], Any], set_state: Callable[[Any], None],
                    live: bool = True) -> int:
        """Agree on the step with every replica and take the state of the one furthest ahead (the lowest rank of
        those): a restarted rank receives its state from a live replica (the `peer` tier), and survivors that
        disagree on whether the interrupted step completed all continue from the one where it did. Returns the
        step to train next. A process started to receive its state (`live=False`: a restarted rank whose plan
        names the `peer` tier) is never the source. Pure data parallelism: every rank holds the whole state."""
        import torch
        import torch.distributed as dist

        steps = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(steps, torch.tensor([step if live else -1], dtype=torch.int64, device=self.device))
        values = [int(s.item()) for s in steps]
        best = max(values)
        if best < 0:
            raise RuntimeError("no replica holds live state: restart from a checkpoint instead")
        source = values.index(best)
        if len(set(values)) > 1:  # every replica at one step holds one state (a restart from a checkpoint)
            state = _broadcast(get_state() if self.rank == source else None, source, self.rank, self.device)
            if self.rank != source:
                set_state(state)
        return best

    def close(self) -> None:
        """Stop watching the job store and release the live group's connections (before the process exits)."""
        self._stop_watcher()
        with self._lock:
            aborted = self._aborted
            self._formed, self._connections = None, {}
        _backend.release(self.backend, aborted)


def _broadcast(state: Any, source: int, rank: int, device: Any = None) -> Any:
    """`state` from `source` to every rank, serialised with torch.save (tensors byte for byte; broadcast_object_list
    would need numpy, which a training environment may not have). `device`: where the group's collectives take
    their tensors (the GPU on NCCL); tensors of the state come back on the devices they were saved from."""
    import torch
    import torch.distributed as dist

    device = device if device is not None else torch.device("cpu")
    size = torch.zeros(1, dtype=torch.int64, device=device)
    data = b""
    if rank == source:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        size[0] = len(data)
    dist.broadcast(size, src=source)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == source else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=source)
    if rank == source:
        return state
    payload = payload.cpu()
    # One copy of the bytes (bytes() of a storage reads it element by element: 30 s for a 6 MB state).
    return torch.load(io.BytesIO(ctypes.string_at(payload.data_ptr(), payload.numel())), weights_only=False)


def warm_up() -> None:
    """Pay now what a new process pays on its first step: autograd's first backward pass, an optimizer's first step
    (`torch._dynamo`'s import among it), a state's serialisation both ways, and on a node with a GPU CUDA's
    initialisation and a device's context (seconds: see `warm_up_cuda`). A warm standby calls it before it waits
    (`recovery.client.torch:warm_up` in the agent's `standby_preload`); the global random state is left as it was, so
    a rank handed to the standby draws the numbers a cold start would."""
    import torch

    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    warm_up_cuda()


STANDBY_DEVICE_ENV = "RECOVERY_STANDBY_DEVICE"
"""the GPU (an index) a warm standby creates its CUDA context on before it waits; unset: the only one, where one is
visible, and none where several are (a context on a device the rank handed over does not use would hold hundreds of
MiB of it for the rank's life)"""


def warm_up_cuda() -> int | None:
    """Initialise CUDA (the driver, the runtime, the libraries torch loads) and, on the standby's device
    (`RECOVERY_STANDBY_DEVICE`, or the only visible one), create its context and run a first product, backward and
    optimizer step there (cuBLAS's handle and workspace, the caching allocator's first segments, the kernels' first
    loads): the device warmed, or None (no GPU, or several and none named). What of NCCL needs the rank (its
    communicator) waits for the group; its library is loaded with torch."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    named = os.environ.get(STANDBY_DEVICE_ENV, "")
    index = int(named) if named else 0 if torch.cuda.device_count() == 1 else None
    if index is None:
        return None
    device = torch.device("cuda", index)
    # The CUDA generators are left alone (fork_rng(devices=[]) above forks none): nothing here draws from them.
    model = torch.nn.Linear(8, 8).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8, device=device)).sum().backward()
    optimizer.step()
    torch.cuda.synchronize(device)
    return index

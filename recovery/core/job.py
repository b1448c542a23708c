"""The per-job aggregate: spec, placement, per-rank liveness and progress, checkpoints, incidents."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

from events.names import ATTEMPT_ENDED, AttemptOutcome, AttemptPurpose, IncidentCause, IncidentOutcome
from events.values import FaultClass, Granularity, JobSpec, Layout, ResumePlan, Tier, shards_at
from policies.base import NS, AttemptSummary, FailedExits, Fault, PolicySet, SaveRequest
from recovery.core.machine import fire_phase

DEDUPE_WINDOW = 256
"""event ids remembered per job: JetStream's duplicate window is the first line, this the second"""
CATALOG_STEPS = 16
"""checkpoint steps kept in the catalog: older ones are never the newest complete"""
CLOSED_INCIDENTS = 32
RESTART_TIMES = 256
"""restart start times kept per job, for a policy's restart budget over a window of time"""


@dataclass(slots=True)
class Attempt:
    number: int
    granularity: Granularity
    rung: int
    purpose: AttemptPurpose
    reason: str
    started: int
    deadline_timer: str | None = None
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)  # command id -> (kind, ack timer id)
    acks_due: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """command id -> the nodes whose agents have yet to report it done (a command addressed to several nodes is
    done when each of them says so); a command with none listed is done at its first `done`"""
    ranks: tuple[int, ...] = ()  # ranks whose processes restart (all of them for job-level)
    stopping: tuple[int, ...] = ()
    vacate: tuple[str, ...] = ()
    save: SaveRequest | None = None
    plan: ResumePlan | None = None
    dp: int | None = None
    outcome: AttemptOutcome | None = None
    budget_keys: tuple[str, ...] = ()
    covered: frozenset[int] | None = None  # ranks + stopping, built on first use
    ranks_set: frozenset[int] | None = None  # ranks, built on first use (a restoring job's reports ask per entry)
    awaiting: int | None = None  # the step of a dying checkpoint the restart is held for
    reset: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """devices the restart resets first, by node (a fallback when no spare came for a fault a reset clears)"""
    grace_ns: int = 30 * NS
    """a stock script's attempt recovers once its restarted processes have run this long (StartRung.grace_ns)"""
    grace_timer: str | None = None
    carried: tuple[int, ...] = ()
    """ranks whose restart an attempt this one superseded already sent: their new processes join this attempt's
    generation as they are, rather than being replaced again (two ranks killed a few ms apart restart 2 processes)"""
    carried_ids: tuple[str, ...] = ()  # the restart commands that started the carried ranks: a failed one fails this
    restart_ids: tuple[str, ...] = ()  # the restart commands this attempt sent
    planned_at: int = -1  # the log record whose checkpoint plan `plan` is
    moves: dict[str, tuple[str, str]] = field(default_factory=dict)
    """migrations sent and not yet done: command id -> (from node, to node). The placement is changed when the
    command is sent; one that fails or never answers did not move the ranks, and is undone."""

    @property
    def restarted(self) -> frozenset[int]:
        """`ranks` as a set."""
        if self.ranks_set is None:
            self.ranks_set = frozenset(self.ranks)
        return self.ranks_set

    def __getstate__(self) -> tuple[Any, ...]:
        # `ranks_set` is a cache of `ranks`, made when first asked (maybe by a record that fails): not state.
        return tuple(None if name == "ranks_set" else getattr(self, name) for name in _ATTEMPT_FIELDS)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(_ATTEMPT_FIELDS, state, strict=True):
            object.__setattr__(self, name, value)

    def copy(self) -> Attempt:
        twin = replace(self)
        twin.pending = dict(self.pending)
        twin.moves = dict(self.moves)
        twin.acks_due = dict(self.acks_due)
        return twin

    def summary(self) -> dict[str, Any]:
        return {"number": self.number, "granularity": self.granularity.value, "rung": self.rung,
                "purpose": self.purpose, "started": self.started,
                "ranks": list(self.ranks), "vacate": list(self.vacate), "outcome": self.outcome,
                "resume_step": None if self.plan is None else self.plan.checkpoint_step}


_ATTEMPT_FIELDS = tuple(f.name for f in fields(Attempt))


@dataclass(slots=True)
class Incident:
    id: str
    opened_seq: int
    opened: int
    fault_step: int
    fault_class: FaultClass | None
    cause: IncidentCause
    faults: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    phase: str = "planning"
    """where the recovery stands: driven only through `move` (recovery.core.machine's phase machine)"""
    phases: list[list[Any]] = field(default_factory=list)
    """the phases so far, [name, start, end or None], for reports: a history, not the state"""
    dying_tried: bool = False
    peer_tried: bool = False
    widened: bool = False  # a fault outside the attempt under way superseded it; no attempt since
    settle_timer: str | None = None  # armed while faults of a widening incident are collected
    exiting: frozenset[int] = frozenset()  # ranks stopped by SIGTERM: saving a dying checkpoint on the way out
    ended: set[int] = field(default_factory=set)  # ranks whose process's end was seen in this incident
    settles: int = 0  # a plugin's settle windows in a row, no attempt between (a loop past LOOP_ANSWERS)
    rewaits: int = 0  # a plugin's waits in a row answered after the last one's deadline
    plan_times: tuple[int, ...] = ()  # log times of a plugin's latest answers (PLAN_BURST of them)
    stopped: frozenset[int] = frozenset()
    """ranks the engine itself stopped and has not restarted yet: their exits are its own doing, no fault"""
    fresh: frozenset[int] = frozenset()
    """ranks an in-place attempt of this incident restarted whose new process no fault has named since"""
    awaited: bool = False  # an attempt held its restart for their dying checkpoint already
    dead_hosts: frozenset[str] = frozenset()  # hosts a node fault declared gone: no source of state
    struck: frozenset[str] = frozenset()  # nodes its faults struck, where their ranks ran then (PastIncident.nodes)
    waiting_since: int | None = None  # log time the incident began to wait for nodes; None: not waiting
    wait_timer: str | None = None  # the wait's deadline: when it fires the policy is asked to fall back
    wait_expired: bool = False  # the wait ran out: the next answer is the policy's fallback
    closed: int | None = None
    outcome: IncidentOutcome | None = None
    lost_steps: int | None = None
    bad_step: int | None = None
    """the earliest bad step of the incident (a NaN or spiking loss): it resumes from a checkpoint before it"""
    bad_steps: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
    """the bad steps whose data its resume plans skip, as (generation, step, data named): one per generation, the
    earliest it reported (the later ones of a generation are its consequence: the all-reduce spread the bad state)"""
    exits: tuple[FailedExits, ...] = ()
    """the failed process exits of its last two generations that had any, counted by the way they failed
    (`recovery.core.failures`)"""

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts and self.attempts[-1].outcome is None else None

    def history(self) -> tuple[AttemptSummary, ...]:
        return tuple(AttemptSummary(a.granularity, a.outcome, a.rung)  # type: ignore[arg-type]
                     for a in self.attempts if a.outcome in ATTEMPT_ENDED)

    def __post_init__(self) -> None:
        if not self.phases:
            self.phases.append([self.phase, self.opened, None])

    def move(self, trigger: str, ts: int) -> None:
        """Fire `trigger` on the incident's phase at log time `ts`, and note the phase in its history."""
        fire_phase(self, trigger)
        phases = self.phases
        if phases and phases[-1][0] == self.phase and phases[-1][2] is None:
            return  # a self-loop (another dying checkpoint asked for): the same interval goes on
        if phases and phases[-1][1] == ts and phases[-1][2] is None:
            phases.pop()  # a phase left at the log time it was entered (planning, mostly) took no time
            if phases and phases[-1][0] == self.phase and phases[-1][2] == ts:
                phases[-1][2] = None  # back where it was at the same time: one interval, not three
                return
        if phases and phases[-1][2] is None:
            phases[-1][2] = ts
        phases.append([self.phase, ts, None])

    def copy(self) -> Incident:
        """A copy for the journal: it shares only the faults list, which a record only appends to."""
        twin = replace(self)  # faults stays shared: only ever appended to, a restore cuts it back (Job.restore)
        twin.attempts = [attempt.copy() for attempt in self.attempts]
        twin.phases = [list(phase) for phase in self.phases]
        return twin

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "opened": self.opened, "closed": self.closed, "cause": self.cause,
                "fault_class": None if self.fault_class is None else self.fault_class.value,
                "fault_step": self.fault_step, "outcome": self.outcome, "lost_steps": self.lost_steps,
                "faults": self.faults, "attempts": [a.summary() for a in self.attempts],
                "phase": self.phase, "phases": [list(p) for p in self.phases],
                **({"bad_step": self.bad_step} if self.bad_step is not None else {}),
                **({"nodes": sorted(self.struck)} if self.struck else {})}


class Job:
    """One training job. `state` is driven only through recovery.core.machine.fire."""

    __slots__ = (
        "alive",
        "caps",
        "catalog",
        "catalog_log",
        "closed",
        "compute_ns",
        "compute_steps",
        "drains",
        "generation",
        "id",
        "incident",
        "incidents_opened",
        "last_progress",
        "last_seen",
        "layout",
        "losses",
        "nodes",
        "own_nodes",
        "policies",
        "policy_errors",
        "rank_gen",
        "rank_log",
        "restart_times",
        "restarts_used",
        "rpn",
        "sdk",
        "seen",
        "shard_counts",
        "skip_data",
        "skip_steps",
        "spec",
        "spoke",
        "state",
        "step",
        "step_time",
        "step_ts",
        "steps",
        "suspects",
        "target_dp",
        "used",
        "watchdog",
    )

    def __init__(self, job_id: str, spec: JobSpec, policies: PolicySet) -> None:
        self.id = job_id
        self.spec = spec
        self.policies = policies
        self.state = "submitted"
        self.layout: Layout = spec.layout
        self.rpn = spec.ranks_per_node
        self.nodes: list[str] = list(spec.nodes)
        self.own_nodes = frozenset(spec.nodes)  # its placement at submission: any other node it holds is a spare
        self.target_dp = spec.layout.dp
        self.generation = 0
        self.step = 0  # newest completed step any rank reported
        self.step_ts: int | None = None
        self.step_time: int | None = None  # ns per step, smoothed
        world = spec.layout.world
        self.alive = bytearray(world)
        self.steps = [0] * world
        self.rank_gen = [0] * world  # the generation whose restart started each rank's current process
        self.last_seen = [0] * world
        self.spoke = bytearray(world)  # 1 once the rank's current process sent a heartbeat or a step
        self.last_progress = [0] * world
        self.compute_steps = [0] * world  # steps whose compute time each rank reported in this generation
        self.compute_ns = [0] * world  # ... and that time in all (a straggler's stands out: detection's watchdog)
        self.shard_counts: tuple[tuple[int, int], ...] = ()
        """an `fsdp` job a scale resharded: (first step, shards) of each world it trained in (`CheckpointContext`)"""
        self.catalog: dict[int, dict[Tier, dict[int, set[str]]]] = {}
        self.catalog_log: list[tuple[int, dict[Tier, dict[int, set[str]]] | None]] | None = None
        self.rank_log: list[tuple[list[int] | bytearray, int, int]] | None = None
        """while a record is journaled: each per-rank value it overwrote, with its array and rank"""
        """while a record is journaled: each catalog step as it was before the record changed it (None: absent)"""
        self.incident: Incident | None = None
        self.incidents_opened = 0
        self.closed: list[dict[str, Any]] = []
        self.drains: dict[str, str] = {}  # node -> why: sub-health to leave at the next complete checkpoint
        self.suspects: dict[str, tuple[Fault, str]] = {}  # key -> (the fault to confirm, timer id), in log order
        self.watchdog: str | None = None
        self.used: dict[str, int] = {}
        self.restarts_used = 0
        self.restart_times: tuple[int, ...] = ()  # log times the job's restarts began, newest last (RESTART_TIMES kept)
        self.policy_errors: dict[str, int] = {}  # family -> errors of its plugin (replaced whole, never changed)
        self.sdk = False  # some rank reported through the SDK (a heartbeat, a step): not a stock script
        self.caps: frozenset[str] | None = None
        """what the job's ranks said their SDK can do (`process.capabilities`), from the first process whose agent
        relays it; None: its agents relay nothing of it (an older log): `can` answers as the engine did before"""
        self.seen: dict[str, None] = {}  # in insertion order: the oldest id is next(iter(seen))
        self.losses: tuple[float, ...] = ()  # recent finite losses, none judged bad, oldest first (LOSS_HISTORY)
        self.skip_steps: tuple[int, ...] = ()  # the data every resume plan skips: bad steps of closed incidents
        self.skip_data: tuple[str, ...] = ()

    def memento(self) -> Memento:
        """What a record may change, so that `restore` undoes a record that failed half way. Cheap whatever the
        job's size: the per-rank arrays and the catalog are not copied (at 16,384 ranks that cost 0.1 ms a record,
        and a job-wide crash brings one record per rank); from here on each write to them is logged with the value it
        replaced (`put`, `add_checkpoint`), and the incident's faults, only ever appended to, are cut back to their
        length. The placement is kept by reference: it is only ever replaced, never changed in place (`replace_node`).
        `seen` is left out: the engine adds an event id only once the record has succeeded."""
        self.catalog_log = []
        self.rank_log = []
        incident = self.incident
        if incident is None:
            kept, faults = None, -1
        else:
            kept, faults = incident.copy(), len(incident.faults)
        return (_SCALARS(self), self.nodes, self.closed[:], dict(self.drains), dict(self.suspects),
                dict(self.used), kept, faults, self.catalog_log, self.rank_log)

    def restore(self, memento: Memento) -> None:
        scalars, nodes, closed, drains, suspects, used, incident, faults, catalog_log, rank_log = memento
        for array, rank, before in reversed(rank_log):
            array[rank] = before
        for name, value in zip(_SCALAR_NAMES, scalars, strict=True):
            setattr(self, name, value)
        self.nodes, self.closed, self.drains, self.suspects, self.used = nodes, closed, drains, suspects, used
        self.incident = incident
        if incident is not None:
            del incident.faults[faults:]  # the copy restored shares the list with the incident it was taken from
        for step, before in reversed(catalog_log):
            if before is None:
                self.catalog.pop(step, None)
            else:
                self.catalog[step] = before
        self.end_journal()

    def end_journal(self) -> None:
        self.catalog_log = None
        self.rank_log = None

    def put(self, array: list[int] | bytearray, rank: int, value: int) -> None:
        """Write one per-rank value, logging the one it replaces while a record is journaled."""
        log = self.rank_log
        if log is not None:
            log.append((array, rank, array[rank]))
        array[rank] = value

    def holds_memory_on(self, node: str) -> bool:
        for by_tier in self.catalog.values():
            shards = by_tier.get(Tier.MEMORY)
            if shards:
                for holders in shards.values():
                    if node in holders:
                        return True
        return False

    def next_incident_id(self) -> str:
        # Counted, not derived from the closed list: that list keeps only the newest incidents.
        self.incidents_opened += 1
        return f"{self.id}#{self.incidents_opened}"

    @property
    def world(self) -> int:
        return len(self.steps)

    def node_of(self, rank: int) -> str:
        return self.nodes[rank // self.rpn]

    @property
    def phase(self) -> str | None:
        """The phase of the recovery under way (its incident's), or None while no incident is open."""
        incident = self.incident
        return incident.phase if incident is not None else None

    def replace_node(self, old: str, new: str) -> None:
        """`new` takes `old`'s place (its ranks). A new list, never a change in place: a journal's memento holds the
        placement as it was by reference (a 16,384-node job's placement is not copied for each record)."""
        nodes = self.nodes[:]
        nodes[nodes.index(old)] = new
        self.nodes = nodes

    def ranks_on(self, node: str) -> range:
        index = self.nodes.index(node)
        return range(index * self.rpn, (index + 1) * self.rpn)

    def resize(self, layout: Layout, nodes: list[str], ts: int) -> None:
        self.layout = layout
        self.nodes = nodes
        world = layout.world
        self.alive = bytearray(world)
        self.steps = [0] * world
        self.rank_gen = [self.generation] * world
        self.last_seen = [ts] * world
        self.spoke = bytearray(world)
        self.last_progress = [ts] * world
        self.compute_steps = [0] * world
        self.compute_ns = [0] * world

    def shards_at(self, step: int) -> int:
        """The shards a checkpoint of `step` is whole in: the layout's, or for a resharded `fsdp` job, those of the
        world that trained the step."""
        return shards_at(self.shard_counts, step, self.layout)

    def reshard(self, layout: Layout, resume_step: int | None) -> None:
        """A scale of an `fsdp` job to `layout`, resuming after `resume_step`: steps up to it stay whole in the old
        world's shards (the new world reshards them on load); the old world's checkpoints past it are of steps the
        new world trains again, in its own shards, and leave the catalog."""
        if not layout.fsdp or layout.shards == self.layout.shards:
            return
        first = 0 if resume_step is None else resume_step + 1
        counts = self.shard_counts or ((0, self.layout.shards),)
        self.shard_counts = (*(entry for entry in counts if entry[0] < first), (first, layout.shards))
        for step in sorted(s for s in self.catalog if s >= first):
            if self.catalog_log is not None:
                self.catalog_log.append((step, self.catalog[step]))  # never changed once dropped: no copy needed
            del self.catalog[step]

    def add_checkpoint(self, step: int, tier: Tier, shards: list[int], holder: str) -> None:
        by_tier = self.catalog.get(step)
        log = self.catalog_log
        if log is not None:
            log.append((step, None if by_tier is None else _copied_step(by_tier)))
        if by_tier is None:
            by_tier = self.catalog[step] = {}
            if len(self.catalog) > CATALOG_STEPS:
                oldest = min(self.catalog)
                if log is not None:
                    log.append((oldest, self.catalog[oldest]))  # never changed once dropped: no copy needed
                del self.catalog[oldest]
        by_shard = by_tier.setdefault(tier, {})
        for shard in shards:
            by_shard.setdefault(shard, set()).add(holder)

    def forget_memory(self, node: str) -> None:
        for step, by_tier in self.catalog.items():
            shards = by_tier.get(Tier.MEMORY)
            if shards is not None:
                if self.catalog_log is not None:
                    self.catalog_log.append((step, _copied_step(by_tier)))
                for holders in shards.values():
                    holders.discard(node)

    def frozen_catalog(self) -> dict[int, dict[Tier, dict[int, tuple[str, ...]]]]:
        return {step: {tier: {shard: tuple(sorted(h)) for shard, h in sorted(shards.items()) if h}
                       for tier, shards in sorted(by_tier.items())}
                for step, by_tier in sorted(self.catalog.items(), reverse=True)}

    @property
    def counted(self) -> bool:
        """Only the step hook reports the job's steps (`counts`, no `steps`): they count each process's optimizer
        steps from 1, so they time a restart and show progress, yet are no resume point; in all else (detection, the
        ladder's grace) the job is a stock script."""
        return self.caps is not None and "counts" in self.caps and "steps" not in self.caps

    def can(self, capability: str) -> bool:
        """Did the job's ranks say they can do `capability` (`events.values.Capability`)? A job whose agents relay
        no capabilities is answered as before they were announced: any rank reporting through the SDK could rejoin
        restarted peers, and a dying checkpoint was asked of any script."""
        if self.caps is None:
            return self.sdk if capability == "reform" else capability == "save" or self.sdk
        return capability in self.caps

    def snapshot(self) -> dict[str, Any]:
        """The job's state as plain data, for replay output, `recovery-ctl` and tests."""
        return {
            "job": self.id, "state": self.state, "phase": self.phase, "generation": self.generation,
            "step": self.step,
            "layout": self.layout.model_dump(), "nodes": list(self.nodes),
            "alive": sum(self.alive), "world": self.world, "step_time_ns": self.step_time,
            "restarts_used": self.restarts_used, "used": dict(sorted(self.used.items())), "sdk": self.sdk,
            **({} if self.caps is None else {"capabilities": sorted(self.caps)}),
            "checkpoints": {str(step): {tier.value: sorted(shards) for tier, shards in by_tier.items()}
                            for step, by_tier in self.frozen_catalog().items()},
            **({"shard_counts": [list(entry) for entry in self.shard_counts]} if self.shard_counts else {}),
            "incident": None if self.incident is None else self.incident.summary(),
            **({"skip_steps": list(self.skip_steps), "skip_data": list(self.skip_data)} if self.skip_steps
               or self.skip_data else {}),
            "incidents": list(self.closed),
            "suspects": list(self.suspects),
            "drains": dict(self.drains),
            "policies": dict(self.policies.labels),
        }

    def skips(self) -> tuple[list[int], list[str]]:
        """The steps and the data every resume plan of the job skips now: its closed incidents' bad steps and the open
        one's, each as the data its script named for it, or the step itself when it named none."""
        steps, data = list(self.skip_steps), list(self.skip_data)
        for _, step, named in self.incident.bad_steps if self.incident is not None else ():
            if named:
                data.extend(d for d in named if d not in data)
            elif step not in steps:
                steps.append(step)
        return sorted(steps), data

    def complete_at(self, step: int) -> bool:
        """Does some tier hold every shard of `step`?"""
        shards = self.shards_at(step)
        held: set[int] = set()
        for by_shard in self.catalog.get(step, {}).values():
            held.update(shard for shard, holders in by_shard.items() if holders)
        return len(held) >= shards and all(shard in held for shard in range(shards))


_SCALAR_NAMES = ("state", "layout", "target_dp", "generation", "step", "step_ts", "step_time", "incidents_opened",
                 "watchdog", "restarts_used", "restart_times", "sdk", "caps", "policies", "policy_errors", "alive",
                 "steps", "rank_gen", "last_seen", "spoke", "last_progress", "compute_steps", "compute_ns", "losses",
                 "skip_steps", "skip_data", "shard_counts")
"""what the memento keeps as it is: immutable values, and the per-rank arrays, which are written only through
Job.put (logged) or replaced whole (a resize), which restoring the attribute undoes"""
_SCALARS = attrgetter(*_SCALAR_NAMES)
_JOURNALED = frozenset((*_SCALAR_NAMES, "nodes", "closed", "drains", "suspects", "used", "incident", "catalog"))
"""every slot a record may change (test_job_journal checks that no other slot exists but the fixed ones)"""
Memento = tuple[tuple[Any, ...], list[str], list[dict[str, Any]], dict[str, str], dict[str, Any], dict[str, int],
                "Incident | None", int, list[Any], list[Any]]


def dead_ranks(alive: bytearray) -> tuple[int, ...]:
    """The ranks whose flag in `alive` is 0, in order: found by `bytearray.find`, at C speed (a job of 131,072
    ranks with one dead is one pass in C, not 131,072 Python steps)."""
    dead: list[int] = []
    at = alive.find(0)
    while at >= 0:
        dead.append(at)
        at = alive.find(0, at + 1)
    return tuple(dead)


def _copied_step(by_tier: dict[Tier, dict[int, set[str]]]) -> dict[Tier, dict[int, set[str]]]:
    return {tier: {shard: set(holders) for shard, holders in shards.items()} for tier, shards in by_tier.items()}


def hungry(job: Job) -> bool:
    """Can nodes coming back help this job: is it waiting for nodes, or elastic and below its target size?"""
    return (job.phase == "waiting"
            or (job.state == "running" and not job.suspects and job.spec.elastic is not None
                and job.layout.dp < job.target_dp))

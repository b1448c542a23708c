"""The steady state: the records that only keep count, applied in place.

Nineteen records in twenty a training job sends are a rank's heartbeat or step, or a node's checkpoint that nothing
waits for. `Engine._dispatch` routes every input the one general way (subject, duplicate, job, rank, the journal,
the engine's parts), and for these records that way costs several times what they change: a few per-rank counters,
the job's step and pace, the checkpoint catalog, the dedupe window. `steady` applies such a record directly and
leaves any other to the general way. What it changes, and in which order, is what the general way would change
(`Progress._progress`, `Engine._job_event`, `Liveness.heard_from`, `Engine._remember`), so a replay decides the same
byte for byte whichever way a record took; the golden logs hold records of both ways.

Every condition is read before anything is written: a record `steady` declines has changed nothing, and one it
takes cannot fail half way, which is why it needs no journal. A record is taken when:

- its job exists, its subject is the job's for its type, and its id is not in the job's dedupe window;
- the node it speaks for, if any (`Liveness.speaker`), is not one a fault declared gone: its word would bring the
  node back, a decision;
- for a `process.heartbeat` or a `progress.step` (without a loss: a loss is judged by the detection policy): it comes
  from the rank's current process (its attempt is the job's generation), its step, if any, is not below the rank's
  last (a roll-back or a refusal), the job is not restoring (a step past the resume point may close the incident)
  and has heard from the SDK before (the first such report is journaled);
- for a `checkpoint.saved`: it is valid (shards of the layout, a plausible step), no attempt of the job awaits a
  dying checkpoint and no node of it waits to drain at a complete one.

Nothing here reads a clock or iterates over anything unordered: the result depends on the record and the state.
"""

from __future__ import annotations

from events import kinds
from events.envelope import EnvelopeBase
from events.subjects import PREFIX
from policies.base import NS
from recovery.core.cluster import ClusterView
from recovery.core.job import DEDUPE_WINDOW, Job
from recovery.core.progress import COMPUTE_WINDOW, implausible_checkpoint

HEARTBEAT = "process.heartbeat"
STEP = "progress.step"
SAVED = "checkpoint.saved"
_JOB_SUBJECTS = f"{PREFIX}.ev.job."  # `events.subjects.job_event`, built inline: it is asked once per record
_Heartbeat = kinds.Heartbeat
_StepReported = kinds.StepReported
_CheckpointSaved = kinds.CheckpointSaved


def steady(jobs: dict[str, Job], cluster: ClusterView, subject: str, ts: int, env: EnvelopeBase) -> bool:
    """Apply `env`, logged at `ts` on `subject`, to the engine's `jobs` and `cluster` if it is a record of the steady
    state (see the module); False if it is not, and then nothing was changed."""
    type_ = env.type
    data = env.data
    if type_ == STEP:
        if data.__class__ is not _StepReported or data.loss is not None:
            return False
    elif type_ == HEARTBEAT:
        if data.__class__ is not _Heartbeat:
            return False
    elif type_ != SAVED or data.__class__ is not _CheckpointSaved:
        return False
    job_id = env.job
    job = jobs.get(job_id) if job_id is not None else None
    if job is None or subject != f"{_JOB_SUBJECTS}{job_id}.{type_}":
        return False
    seen = job.seen
    event_id = env.id
    if event_id in seen:
        return False
    # The node the record speaks for (`Liveness.speaker`, asked before the record moves the job).
    name = env.node
    if type_ != SAVED:
        rank = data.rank
        if rank >= len(job.steps) or data.attempt != job.generation:
            return False
        if name is None and rank // job.rpn < len(job.nodes) and data.attempt >= job.rank_gen[rank]:
            name = job.nodes[rank // job.rpn]  # the placement's node runs the rank's current process
    node = cluster.nodes.get(name) if name is not None else None
    if node is not None and node.gone:
        return False
    if type_ == SAVED:
        if not _saved(job, data, ts):
            return False
    elif not _beat(job, data, ts):
        return False
    if node is not None and (node.silent is not None or node.unreachable is not None) and node.job == job_id:
        # `Liveness.heard_from`: its agent speaks for a node the monitor took for silent or unreachable.
        node = cluster.node(node.name)  # noted as maybe impaired, as every change to a node is
        node.silent = node.unreachable = None
    # `Engine._remember` without a journal.
    seen[event_id] = None
    if len(seen) > DEDUPE_WINDOW:
        del seen[next(iter(seen))]
    return True


def _beat(job: Job, data: kinds.Heartbeat | kinds.StepReported, ts: int) -> bool:
    """The writes of `Progress._progress` for the current process's heartbeat or step, in its order; False, having
    written nothing, for one the general way must judge."""
    rank, step = data.rank, data.step
    steps = job.steps
    last = steps[rank]
    if step is not None and step < last:
        return False
    incident = job.incident
    if incident is not None and incident.phase == "restoring":
        return False
    if not job.sdk and not job.counted:
        return False
    # No journal is open for a record taken here: the per-rank arrays are written in place, as `Job.put` writes them
    # then (and as the general way writes a beat's).
    if step is not None and step > last:
        steps[rank] = step
        job.last_progress[rank] = ts
        if step > job.step:
            # No pace from a time that runs backwards (see `Progress._progress`).
            if job.step_ts is not None and ts >= job.step_ts:
                per_step = (ts - job.step_ts) // (step - job.step)
                job.step_time = per_step if job.step_time is None else (7 * job.step_time + per_step) // 8
            job.step = step
            job.step_ts = ts if job.step_ts is None else max(ts, job.step_ts)
    if data.__class__ is _StepReported:
        compute = data.compute_s  # type: ignore[union-attr]
        if compute is not None:
            count, total = job.compute_steps[rank] + 1, job.compute_ns[rank] + round(compute * NS)
            if count > 2 * COMPUTE_WINDOW:
                count, total = COMPUTE_WINDOW, total * COMPUTE_WINDOW // count
            job.compute_steps[rank] = count
            job.compute_ns[rank] = total
    job.last_seen[rank] = ts
    if not job.spoke[rank]:
        job.spoke[rank] = 1
    return True


def _saved(job: Job, data: kinds.CheckpointSaved, ts: int) -> bool:
    """`Engine._job_event` for a checkpoint nothing waits for: into the catalog; False, having written nothing, for
    an invalid one (the general way refuses it and says why) or one an attempt or a drain waits for."""
    incident = job.incident
    if (incident is not None and incident.attempt is not None and incident.attempt.awaiting is not None) or job.drains:
        return False
    shards = job.shards_at(data.step)
    if any(shard >= shards for shard in data.shards):
        return False
    if implausible_checkpoint(job, data.step, ts) is not None:
        return False
    job.add_checkpoint(data.step, data.tier, data.shards, data.holder)
    return True

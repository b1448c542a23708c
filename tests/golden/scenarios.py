"""The golden scenarios: one per behaviour of the seed systems, scripted on the time-skipping harness.

`python -m tests.golden.scenarios` rewrites the committed logs (tests/golden/*.jsonl). CI replays
each committed log, checks that the replay reproduces every recorded decision, that the scenario
still produces the same bytes, and asserts on the decisions that make the behaviour.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from recovery.log import write_file
from recovery.testing.scenario import Scenario
from tests.golden import scenarios_elastic, scenarios_scripts, scenarios_signals

HERE = Path(__file__).parent
SCENARIOS: dict[str, Callable[[], Scenario]] = {}


def scenario(func: Callable[[], Scenario]) -> Callable[[], Scenario]:
    SCENARIOS[func.__name__] = func
    return func


NO_DYING = {"checkpoint": {"name": "newest-complete", "params": {"dying": False}}}
NO_PEER = {"checkpoint": {"name": "newest-complete", "params": {"peer": False}}}


def heartbeats(s: Scenario, job: str, ranks: list[int], step: int | None = None) -> None:
    for rank in ranks:
        if step is None:
            s.job_event(job, "process.heartbeat", rank=rank, attempt=s.engine.jobs[job].generation)
        else:
            s.job_event(job, "process.heartbeat", rank=rank, step=step, attempt=s.engine.jobs[job].generation)


@scenario
def graceful_exit() -> Scenario:
    """ModelArts graceful exit: the platform SIGTERMs the job; each process saves its shard as a dying
    checkpoint before it exits; the job restarts and resumes from that dying checkpoint, losing nothing."""
    s = Scenario()
    s.submit("gpt", ["n0", "n1"], ranks_per_node=4, dp=2, tp=4)
    s.train("gpt", 10)
    s.checkpoint("gpt", 10, "storage", "storage")
    s.train("gpt", 10)
    s.advance(0.5)
    for rank in range(4):  # replica 0 writes the four shards in its SIGTERM handler
        s.checkpoint("gpt", 20, "dying", "storage", shards=[rank])
    for rank in range(8):
        s.job_event("gpt", "process.exited", rank=rank, exit_code=None, signal=15)
    s.advance(5)
    s.ack_all()
    s.advance(30)
    s.train("gpt", 2)
    return s


@scenario
def watchdog_heartbeat() -> Scenario:
    """MindCluster-style watchdog: rank 5 hangs; the others block in the collective but their agents
    still heartbeat. The silence is caught in seconds, not after HCCL's 30-minute timeout."""
    s = Scenario()
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("llm", 20)
    s.checkpoint("llm", 20, "storage", "storage")
    for _ in range(40):  # rank 5 is silent from here; the rest heartbeat without progress
        s.advance(1)
        heartbeats(s, "llm", [r for r in range(8) if r != 5])
        if s.engine.jobs["llm"].incident is not None:
            break
    s.ack_all()
    s.advance(10)
    s.train("llm", 2)
    return s


@scenario
def watchdog_collective() -> Scenario:
    """A collective timeout that names its group: seven ranks report, so the eighth is the one they all
    wait for, and only it is restarted."""
    s = Scenario()
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("llm", 20)
    s.checkpoint("llm", 20, "storage", "storage")
    s.advance(3)
    s.job_event("llm", "network.collective_timeout", group="dp-all", members=list(range(8)),
                reporters=[0, 1, 2, 4, 5, 6, 7], operation="allreduce", timeout_s=3)
    s.ack_all()
    s.advance(10)
    s.train("llm", 2)
    return s


@scenario
def pod_level_reschedule() -> Scenario:
    """A GPU falls off the bus (XID 79): the node's ranks move to a spare; no other node restarts."""
    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1", "n2", "n3"], ranks_per_node=2, dp=4, tp=2)
    s.train("llm", 10)
    s.checkpoint("llm", 10, "storage", "storage")
    s.train("llm", 5)
    s.node_event("n2", "device.fault", device=1, vendor="nvidia", code="79")
    s.ack_all()
    s.advance(20)
    s.train("llm", 2)
    return s


@scenario
def recover_in_place_fallback() -> Scenario:
    """Process-level recovery: only the crashed process restarts; when that fails the ranks move to a
    spare (pod level); when that misses its deadline the whole job restarts (job level)."""
    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8, policies=NO_DYING)
    s.train("llm", 10)
    s.checkpoint("llm", 10, "storage", "storage")
    s.train("llm", 3)
    s.job_event("llm", "process.exited", rank=3, exit_code=139)
    restart = s.outstanding("restart_ranks")[0]
    s.ack(restart, "failed", "CUDA context creation failed")
    s.ack_all(rounds=1)  # the migration's stop goes through; the migration itself is never acknowledged
    s.advance(301)
    s.ack_all()
    s.advance(30)
    s.train("llm", 2)
    return s


def _ttp(job: str, victim: int, peer: bool = False) -> Scenario:
    s = Scenario()
    nodes = [f"{job}-n{i}" for i in range(4)]
    s.submit(job, nodes, ranks_per_node=1, dp=4, **({} if peer else {"policies": NO_PEER}))
    s.train(job, 10)
    s.checkpoint(job, 10, "storage", "storage")
    s.train(job, 7)
    s.job_event(job, "process.exited", rank=victim, exit_code=None, signal=9)
    s.ack_all()
    s.idle(job, 5)
    s.train(job, 2)
    return s


@scenario
def power_off_checkpoint() -> Scenario:
    """MindIO TTP: 4-way data parallel, rank 2 is killed, a healthy replica saves a dying checkpoint at the
    current step and the job resumes at the next step: nothing is lost."""
    return _ttp("ttp", 2)


@scenario
def peer_recovery() -> Scenario:
    """TorchFT-style live recovery, the default: rank 2 is killed and its replacement takes the state of step 17
    straight from a live replica; nothing is saved, nothing is lost."""
    return _ttp("peer", 2, peer=True)


@scenario
def power_off_rank0() -> Scenario:
    """Rank 0 killed is no different: the controller is not on rank 0, and rank 1 saves instead."""
    return _ttp("rank0", 0)


@scenario
def power_off_no_replica() -> Scenario:
    """Both replicas of one shard are gone: no dying checkpoint is possible, so the job resumes from
    the newest complete saved checkpoint."""
    s = Scenario()
    s.submit("noreplica", ["nr-n0", "nr-n1"], ranks_per_node=2, dp=2, tp=2)
    s.train("noreplica", 10)
    s.checkpoint("noreplica", 10, "storage", "storage")
    s.train("noreplica", 7)
    s.job_event("noreplica", "process.exited", rank=1, exit_code=None, signal=9)
    s.job_event("noreplica", "process.exited", rank=3, exit_code=None, signal=9)
    s.ack_all()
    s.idle("noreplica", 3)  # the second exit widened the incident: the next attempt starts after the settle window
    s.ack_all()
    s.idle("noreplica", 5)
    s.train("noreplica", 2)
    return s



@scenario
def sharded_preemption() -> Scenario:
    """FSDP with no replica, four shards on two nodes: the platform preempts fs1; its ranks write shards 2 and 3 of
    a dying checkpoint at step 17 on the way out, the engine asks ranks 0 and 1 (live, at step 17) for shards 0 and
    1 meanwhile, and the job resumes at step 18 rather than at step 10, the newest step whole in memory."""
    s = Scenario()
    s.spare("fs-spare")
    s.submit("fsdp", ["fs0", "fs1"], ranks_per_node=2, dp=1, tp=4)
    s.train("fsdp", 10)
    for node, other in (("fs0", "fs1"), ("fs1", "fs0")):
        mine = [0, 1] if node == "fs0" else [2, 3]
        s.checkpoint("fsdp", 10, "memory", node, shards=mine)  # each rank's own copy
        s.checkpoint("fsdp", 10, "memory", other, shards=mine)  # ... and its buddy's, on the other node
    s.train("fsdp", 7)
    for rank in (2, 3):
        s.job_event("fsdp", "process.exited", rank=rank, exit_code=None, signal=15)
    s.advance(0.5)
    for rank in (2, 3):  # the exiting ranks' SIGTERM handlers
        s.checkpoint("fsdp", 17, "dying", "storage", shards=[rank])
    s.advance(4.5)
    for rank in (0, 1):  # the running ranks, asked: a shard of a large model takes seconds to write
        s.checkpoint("fsdp", 17, "dying", "storage", shards=[rank])
    s.ack_all()
    s.advance(5)
    s.ack_all()
    s.train("fsdp", 2)
    return s


@scenario
def memory_checkpoint() -> Scenario:
    """MindIO ACP: the in-memory checkpoint is preferred over storage while every shard has a live holder."""
    s = Scenario()
    s.submit("mem", ["m0", "m1"], ranks_per_node=2, dp=2, tp=2, policies=NO_DYING)
    s.train("mem", 10)
    s.checkpoint("mem", 10, "storage", "storage")
    s.train("mem", 10)
    s.checkpoint("mem", 20, "memory", "m0")  # each node keeps both shards in host memory
    s.checkpoint("mem", 20, "memory", "m1")
    s.train("mem", 3)
    s.job_event("mem", "process.exited", rank=1, exit_code=1)
    s.ack_all()
    s.idle("mem", 5)
    s.train("mem", 2)
    return s


@scenario
def memory_checkpoint_lost() -> Scenario:
    """When a shard's only in-memory copy dies with its node, the job resumes from storage."""
    s = Scenario()
    s.spare("spare0")
    s.submit("lost", ["l0", "l1"], ranks_per_node=2, dp=2, tp=2, policies=NO_DYING)
    s.train("lost", 10)
    s.checkpoint("lost", 10, "storage", "storage")
    s.train("lost", 10)
    s.checkpoint("lost", 20, "memory", "l0", shards=[0])  # each shard's memory copy on one node only
    s.checkpoint("lost", 20, "memory", "l1", shards=[1])
    s.train("lost", 3)
    s.node_event("l1", "node.not_ready", reason="kubelet stopped posting status")
    s.idle("lost", 25, ranks=[0, 1])
    s.ack_all()
    s.idle("lost", 5)
    s.train("lost", 2)
    return s


@scenario
def step_retry() -> Scenario:
    """A transient network fault (every member of a collective timed out together) is handled by a
    step retry: no process restarts."""
    s = Scenario()
    s.submit("net", ["t0", "t1"], ranks_per_node=4, dp=8)
    s.train("net", 10)
    s.checkpoint("net", 10, "storage", "storage")
    s.train("net", 2)
    s.advance(2)
    s.job_event("net", "network.collective_timeout", group="dp-all", members=list(range(8)),
                reporters=list(range(8)), operation="allreduce", timeout_s=2)
    s.ack_all()
    s.train("net", 2)
    return s


TIMED_OUT = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"


@scenario
def retry_new_generation() -> Scenario:
    """A rank's collective times out while every rank lives (its SDK's `process.collective_failed`): a retry, which
    is a new generation with no process restarted. Every rank forms generation 1's group in its own process and
    trains step 11 again; another rank's report of the old group's failure, arriving after, is old news."""
    s = Scenario()
    s.submit("coll", ["c0", "c1"], ranks_per_node=2, dp=4)
    s.train("coll", 10)
    s.advance(5)
    s.job_event("coll", "process.collective_failed", rank=1, step=11, attempt=0, timeout_s=5, error=TIMED_OUT)
    s.job_event("coll", "process.collective_failed", rank=3, step=11, attempt=0, timeout_s=5, error=TIMED_OUT)
    s.ack_all()
    s.train("coll", 2)
    return s


@scenario
def retry_fails_then_in_place() -> Scenario:
    """The retried step's collective times out again in the retry's generation: the retry failed, and the network
    ladder goes on to its next rung, every rank restarted in place."""
    s = Scenario()
    s.submit("coll2", ["c0", "c1"], ranks_per_node=2, dp=4)
    s.train("coll2", 10)
    s.checkpoint("coll2", 10, "storage", "storage")
    s.advance(5)
    s.job_event("coll2", "process.collective_failed", rank=0, step=11, attempt=0, timeout_s=5, error=TIMED_OUT)
    s.ack_all()
    s.advance(5)
    s.job_event("coll2", "process.collective_failed", rank=2, step=11, attempt=1, timeout_s=5, error=TIMED_OUT)
    s.ack_all()
    s.train("coll2", 2)
    return s


@scenario
def frequency_isolation() -> Scenario:
    """The same GPU reports a row-remap failure three times within the window: it is isolated and its
    ranks leave the node."""
    s = Scenario()
    s.spare("spare0")
    s.submit("freq", ["f0", "f1"], ranks_per_node=4, dp=8)
    s.train("freq", 10)
    s.checkpoint("freq", 10, "storage", "storage")
    for _ in range(3):
        s.train("freq", 5)
        s.node_event("f1", "device.fault", device=2, vendor="nvidia", code="63")
    s.ack_all()
    s.advance(20)
    s.train("freq", 2)
    return s


@scenario
def restart_budget() -> Scenario:
    """A rank that keeps crashing: the job's restart budget runs out and the job fails, naming it."""
    s = Scenario()
    s.submit("flaky", ["k0"], ranks_per_node=4, dp=4, max_restarts=2, policies=NO_DYING)
    s.train("flaky", 5)
    s.checkpoint("flaky", 5, "storage", "storage")
    for _ in range(3):
        s.train("flaky", 2)
        s.job_event("flaky", "process.exited", rank=1, exit_code=1, attempt=s.engine.jobs["flaky"].generation)
        s.ack_all()
        s.advance(10)
        s.train("flaky", 1)
    return s


@scenario
def sigterm_storm() -> Scenario:
    """A preemption: the platform SIGTERMs every rank and each reports its exit first; their handlers' dying
    checkpoint lands half a second later. The restart waits for it (bounded by the checkpoint policy's
    `dying_wait_s`) and resumes at the step the job had reached, from no checkpoint at all before it."""
    s = Scenario()
    s.submit("pre", ["p0", "p1"], ranks_per_node=4, dp=4, tp=2)
    s.train("pre", 12)
    for rank in range(8):
        s.job_event("pre", "process.exited", rank=rank, exit_code=None, signal=15)
    s.advance(0.5)
    for shard in range(2):  # replica 0 writes the two shards in its SIGTERM handler
        s.checkpoint("pre", 12, "dying", "storage", shards=[shard])
    s.ack_all()
    s.advance(20)
    s.train("pre", 2)
    return s


@scenario
def sigterm_no_handler() -> Scenario:
    """SIGTERM with nobody writing a dying checkpoint: the restart waits `dying_wait_s` (here 5 s), no longer, then
    resumes from the newest complete checkpoint."""
    s = Scenario()
    s.submit("bare", ["b0"], ranks_per_node=2, dp=2,
             policies={"checkpoint": {"name": "newest-complete", "params": {"dying_wait_s": 5.0}}})
    s.train("bare", 6)
    s.checkpoint("bare", 4, "storage", "storage")
    s.job_event("bare", "process.exited", rank=1, exit_code=None, signal=15)
    s.advance(6)
    s.ack_all()
    s.advance(20)
    s.train("bare", 2)
    return s


@scenario
def partial_restart_survivors() -> Scenario:
    """A GPU falls off the bus on n1: its ranks move to a spare (generation 1) while n0's ranks keep running. Their
    agent never tells n0's processes the new generation, so they go on reporting generation 0: alive and training,
    they are neither stale nor silent, and nothing is restarted again in the minutes after."""
    s = Scenario()
    s.spare("s0")
    s.submit("part", ["n0", "n1"], ranks_per_node=2, dp=4)
    s.train("part", 10)
    s.checkpoint("part", 10, "storage", "storage")
    s.node_event("n1", "device.fault", device=1, vendor="nvidia", code="79")
    s.ack_all()
    job = s.engine.jobs["part"]
    for _ in range(120):  # two minutes: far past the watchdog's silence and stall thresholds
        s.advance(1)
        step = max(job.steps) + 1
        for rank in range(4):
            s.job_event("part", "progress.step", rank=rank, step=step, attempt=job.rank_gen[rank])
    return s


@scenario
def move_skips_broken_spare() -> Scenario:
    """A GPU of the idle spare s0 falls off the bus (XID 79) while no job runs there; later a node of the job needs
    replacing. The move goes to the healthy spare s1, not to the first spare that joined."""
    s = Scenario()
    s.spare("s0")
    s.spare("s1")
    s.submit("llm", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("llm", 6)
    s.checkpoint("llm", 6, "storage", "storage")
    s.node_event("s0", "device.fault", device=3, vendor="nvidia", code="79")
    s.train("llm", 2)
    s.node_event("n1", "device.fault", device=0, vendor="nvidia", code="48")
    s.ack_all()
    s.train("llm", 2)
    return s


@scenario
def wait_ends_on_rejoin() -> Scenario:
    """A host of a job without spares goes down: the job waits for nodes, with a deadline in the log. The host is
    repaired and joins again before the deadline: the wait ends there, its deadline timer is cancelled and the job
    restarts on its own nodes."""
    s = Scenario()
    s.submit("host", ["h0", "h1"], ranks_per_node=4, dp=2, tp=4)
    s.train("host", 10)
    s.checkpoint("host", 10, "storage", "storage")
    s.train("host", 2)
    s.node_event("h1", "node.not_ready", reason="kernel panic")
    s.idle("host", 25, ranks=range(4))
    s.advance(600)
    s.node_event("h1", "node.joined", spare=False, devices=8)
    s.ack_all()
    s.advance(30)
    s.train("host", 2)
    return s


def dbe_until_reset() -> Scenario:
    """An XID 48 on d1 kills rank 5 of a job without spares; 301 s later the wait for a spare has run out and the
    ladder's reset-and-restart is outstanding."""
    s = Scenario()
    s.submit("dbe", ["d0", "d1"], ranks_per_node=4, dp=8)
    s.train("dbe", 10)
    s.checkpoint("dbe", 10, "storage", "storage")
    s.train("dbe", 2)
    s.node_event("d1", "device.fault", device=1, vendor="nvidia", code="48")
    s.advance(0.5)
    s.job_event("dbe", "process.exited", rank=5, exit_code=None, signal=6)
    s.ack_all()
    s.advance(301)
    return s


@scenario
def wait_deadline_reset() -> Scenario:
    """A double-bit ECC error (XID 48) on a job without spares: the ranks must leave the GPU, nowhere to go. The
    ladder waits at most `reset_after_s` (300 s) for a spare; none comes, the wait's deadline fires and it falls back
    to what clears an XID 48: reset the GPU and restart the rank in place."""
    s = dbe_until_reset()
    s.ack_all()
    s.advance(5)
    s.train("dbe", 2)
    return s


@scenario
def reset_fails_then_moves() -> Scenario:
    """The reset fallback of `wait_deadline_reset`, on a GPU the reset cannot clear: the node's agent says which
    device it could not reset, the engine counts it bad again (it had counted it usable when the restart began), so
    the ladder does not restart the job onto it; the job waits, bounded, and the next spare takes the rank's node."""
    s = dbe_until_reset()
    [restart] = s.outstanding()
    s.job_event("dbe", "command.ack", command_id=restart.id, status="accepted", result={"node": "d1"})
    s.job_event("dbe", "command.ack", command_id=restart.id, status="failed",
                reason="resetting GPU 1 failed (nvidia-smi --gpu-reset -i 1: exit status 3)",
                result={"node": "d1", "reset_failed": [1]})
    s.advance(60)
    s.node_event("s0", "node.joined", spare=True, devices=8)
    s.ack_all()
    s.advance(5)
    s.train("dbe", 2)
    return s


@scenario
def lemon_isolated_with_spare() -> Scenario:
    """A GPU that keeps raising double-bit ECC errors, across jobs: the cluster's history, not one job's, makes it a
    lemon. With no spare the job would lose a node by isolating it: it is reset and used again, and the decision
    says why it was not isolated. Once a spare has joined, its next error isolates it (with an expiry timer) and the
    ranks move to the spare."""
    s = Scenario()
    s.submit("prev", ["l1"], ranks_per_node=4, dp=4)  # an earlier job on the node sees its first error
    s.train("prev", 3)
    s.node_event("l1", "device.fault", device=2, vendor="nvidia", code="48")
    s.job_event("prev", "job.completed")
    s.node_event("l1", "device.recovered", device=2)
    s.submit("lem", ["l0", "l1"], ranks_per_node=4, dp=8)
    s.train("lem", 10)
    s.checkpoint("lem", 10, "storage", "storage")
    s.node_event("l1", "device.fault", device=2, vendor="nvidia", code="48")  # second: an ordinary fault
    s.node_event("l1", "device.fault", device=2, vendor="nvidia", code="63")  # its row remap: the third
    s.ack_all()
    s.advance(301)
    s.ack_all()
    s.advance(5)
    s.train("lem", 5)
    s.spare("s0")
    s.node_event("l1", "device.fault", device=2, vendor="nvidia", code="48")  # with a spare: isolated
    s.ack_all()
    s.advance(5)
    s.train("lem", 2)
    return s


for _build in (*scenarios_elastic.ALL, *scenarios_scripts.ALL, *scenarios_signals.ALL):
    scenario(_build)


def path(name: str) -> Path:
    return HERE / f"{name}.jsonl"


def write_all() -> None:
    for name, build in SCENARIOS.items():
        s = build()
        count = write_file(path(name), s.log.records())
        print(f"{path(name).relative_to(Path.cwd())}: {count} records, {len(s.decisions)} decisions, "
              f"{len(s.rejections)} rejections")


if __name__ == "__main__":
    write_all()
    sys.exit(0)

"""Golden scenarios of elastic jobs: a scale in when no spare is left and out when nodes come, the survivors' processes
kept, an FSDP job's state resharded, a job at its minimum waiting (registered by `tests.golden.scenarios`)."""

from __future__ import annotations

from recovery.testing.scenario import Scenario


def elastic_scale() -> Scenario:
    """Paddle-style elastic training: a node is lost with no spare, the job scales in by data-parallel
    replicas (min allows it); a node joins and it scales back out; then an operator asks for dp=2."""
    s = Scenario()
    s.submit("ela", ["e0", "e1", "e2", "e3"], ranks_per_node=2, dp=4, tp=2, elastic={"min_dp": 2, "max_dp": 4})
    s.train("ela", 10)
    s.checkpoint("ela", 10, "storage", "storage")
    s.train("ela", 4)
    s.node_event("e3", "node.not_ready", reason="NIC down")
    s.idle("ela", 25, ranks=range(6))
    s.ack_all()
    s.advance(10)
    s.train("ela", 3)
    s.spare("e4")
    s.ack_all()
    s.advance(10)
    s.train("ela", 3)
    s.job_event("ela", "operator.scale", dp=2)
    s.ack_all()
    s.advance(10)
    s.train("ela", 2)
    return s


def elastic_keeps_survivors() -> Scenario:
    """A node of an elastic job is lost and the only free spare is in the shared pool, which the job (`spare_pool`)
    may not take: it scales in, and its live processes keep running in the smaller world (`kept`), the peers its
    resume plan names. A node that joins the job's own pool makes it scale back out; the newcomers take their state
    from those peers."""
    s = Scenario()
    s.spare("shared0")
    s.submit("grow", ["g0", "g1"], ranks_per_node=2, dp=4, elastic={"min_dp": 2, "max_dp": 4}, spare_pool="grow")
    s.train("grow", 10)
    s.node_event("g1", "node.not_ready", reason="host down")
    s.idle("grow", 25, ranks=range(2))
    s.ack_all()
    s.advance(2)
    s.train("grow", 3)
    s.spare("g2", pool="grow")
    s.ack_all()
    s.advance(2)
    s.train("grow", 3)
    return s


def fsdp_scale_in() -> Scenario:
    """FSDP on a 1-D mesh (`fsdp`: every rank its own shard, no replica), elastic, its node f1 lost with no spare of
    its pool free: it scales in to the two ranks of f0, which keep their processes and reshard the newest step whole
    in the old world's four shards (f0's memory holds f1's as their buddy). The smaller world saves its own two
    shards; a late copy of an old shard is still taken for its old step.
    A rank's crash then resumes from the two-shard step, and a node joining the pool scales the job back out,
    resharding that step onto four ranks."""
    s = Scenario()
    s.spare("shared0")
    s.submit("shard", ["f0", "f1"], ranks_per_node=2, dp=4, fsdp=True, elastic={"min_dp": 2, "max_dp": 4},
             spare_pool="shard")
    s.train("shard", 8)
    s.checkpoint("shard", 8, "memory", "f0", shards=[0, 1, 2, 3])  # its own, and f1's held as their buddy
    s.checkpoint("shard", 8, "memory", "f1", shards=[0, 1, 2, 3])
    s.train("shard", 2)
    s.checkpoint("shard", 10, "memory", "f0", shards=[0, 1])  # f1's copies of step 10 never came
    s.node_event("f1", "node.not_ready", reason="host down")
    s.idle("shard", 25, ranks=range(2))
    s.ack_all()
    s.advance(2)
    s.train("shard", 4)
    s.checkpoint("shard", 6, "memory", "f0", shards=[3])  # late: an old shard of an old step, taken
    s.checkpoint("shard", 12, "memory", "f0", shards=[0, 1])
    s.job_event("shard", "process.exited", rank=1, exit_code=139, attempt=1)
    s.idle("shard", 5, ranks=[0])
    s.ack_all()
    s.advance(2)
    s.train("shard", 2)
    s.spare("f2", pool="shard")
    s.ack_all()
    s.advance(2)
    s.train("shard", 2)
    return s


def elastic_wait() -> Scenario:
    """A node lost with no spare and an elastic minimum that forbids shrinking: the job waits, then
    migrates to the node that joins."""
    s = Scenario()
    s.submit("big", ["b0", "b1"], ranks_per_node=4, dp=2, tp=4, elastic={"min_dp": 2, "max_dp": 2})
    s.train("big", 10)
    s.checkpoint("big", 10, "storage", "storage")
    s.train("big", 2)
    s.node_event("b1", "node.not_ready", reason="power supply")
    s.idle("big", 25, ranks=range(4))
    s.advance(120)
    s.spare("b2")
    s.ack_all()
    s.advance(30)
    s.train("big", 2)
    return s


ALL = (elastic_scale, elastic_keeps_survivors, fsdp_scale_in, elastic_wait)

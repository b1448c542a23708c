"""Elastic jobs resume at the size they can have; the spare pool is shared by the jobs' spare quotas."""

from __future__ import annotations

from pathlib import Path

import orjson

from events.values import Elastic, Tier
from recovery.log import iter_file
from recovery.log.recorder import replay
from recovery.log.verify import first_divergence
from recovery.testing.scenario import Scenario
from tests.golden.scenarios import SCENARIOS, path


def test_an_elastic_job_resumes_at_its_minimum_with_a_spare_instead_of_waiting() -> None:
    """Two of four nodes fail and one spare is free: four nodes are not to be had, three are, and three is the
    job's minimum. It scales in to dp=3 on the two healthy nodes and the spare."""
    s = Scenario()
    s.spare("s0")
    s.submit("e", ["n0", "n1", "n2", "n3"], ranks_per_node=1, dp=4,
             elastic=Elastic(min_dp=3, max_dp=4).model_dump())
    s.train("e", 5)
    s.checkpoint("e", 5, "storage", "storage")
    s.node_event("n2", "device.fault", device=0, vendor="nvidia", code="79")
    s.node_event("n3", "device.fault", device=0, vendor="nvidia", code="79")
    s.advance(3)
    s.ack_all()
    assert s.phase("e") != "waiting", s.kinds("e")
    [scale] = s.commands_of("scale_job")
    assert scale.dp == 3 and sorted(scale.nodes) == ["n0", "n1", "s0"]
    s.train("e", 2)
    assert s.state("e") == "running" and s.engine.jobs["e"].layout.dp == 3
    # Nodes come back: it grows to its size again.
    s.node_event("n2", "node.joined", spare=True)
    s.ack_all()
    s.train("e", 2)
    assert s.engine.jobs["e"].layout.dp == 4


def test_an_elastic_job_below_its_minimum_even_with_the_spares_waits() -> None:
    s = Scenario()
    s.submit("e", ["n0", "n1", "n2", "n3"], ranks_per_node=1, dp=4,
             elastic=Elastic(min_dp=3, max_dp=4).model_dump())
    s.train("e", 5)
    s.node_event("n2", "device.fault", device=0, vendor="nvidia", code="79")
    s.node_event("n3", "device.fault", device=0, vendor="nvidia", code="79")
    s.advance(3)
    assert s.phase("e") == "waiting"
    s.spare("s0")  # one node returns: three can run now
    s.ack_all()
    [scale] = s.commands_of("scale_job")
    assert scale.dp == 3


def test_a_jobs_spare_quota_leaves_the_rest_of_the_pool_to_other_jobs() -> None:
    """Two spares, two jobs. `a` (quota 1) loses two nodes: it may take one spare, not both, so when `b` loses a node
    the other spare is still there for it."""
    s = Scenario()
    s.spare("s0")
    s.spare("s1")
    s.submit("a", ["a0", "a1", "a2"], ranks_per_node=2, dp=6, spares=1)
    s.submit("b", ["b0", "b1"], ranks_per_node=2, dp=4)
    for job in ("a", "b"):
        s.train(job, 3)
        s.checkpoint(job, 3, "storage", "storage")
    s.node_event("a1", "device.fault", device=0, vendor="nvidia", code="79")
    s.node_event("a2", "device.fault", device=0, vendor="nvidia", code="79")
    s.advance(3)
    s.ack_all()
    assert s.phase("a") == "waiting"
    assert "2 node(s) to replace, 1 spare(s)" in s.find("attempt.waiting", "a")[-1].reason
    s.node_event("b1", "device.fault", device=0, vendor="nvidia", code="79")
    s.ack_all()
    s.train("b", 2)
    [move] = [c for c in s.commands_of("migrate_ranks") if c.job == "b"]
    assert move.to_node in ("s0", "s1") and s.state("b") == "running"


def test_a_quota_counts_the_spares_a_job_already_holds() -> None:
    s = Scenario()
    s.spare("s0")
    s.spare("s1")
    s.submit("a", ["a0", "a1"], ranks_per_node=2, dp=4, spares=1)
    s.train("a", 3)
    s.node_event("a1", "device.fault", device=0, vendor="nvidia", code="79")
    s.ack_all()
    s.train("a", 2)
    assert "s0" in s.engine.jobs["a"].nodes
    s.node_event("a0", "device.fault", device=0, vendor="nvidia", code="79")  # its quota is spent on s0
    s.advance(3)
    s.ack_all()
    assert s.phase("a") == "waiting" and "s1" not in s.engine.jobs["a"].nodes


def test_a_log_written_before_spares_was_a_quota_replays_as_it_ran(tmp_path: Path) -> None:
    """job.submitted v1 carried `spares: 0`, never read; the upcaster drops it, so such a log still verifies."""
    lines = []
    for line in path("pod_level_reschedule").read_bytes().splitlines():
        obj = orjson.loads(line)
        envelope = obj.get("envelope") or {}
        if envelope.get("type") == "job.submitted":
            envelope["schema"] = 1
            envelope["data"]["spec"]["spares"] = 0  # as v1 producers wrote it
        lines.append(orjson.dumps(obj))
    old = tmp_path / "v1.jsonl"
    old.write_bytes(b"\n".join(lines) + b"\n")
    result = replay(iter_file(old))
    assert first_divergence(result) is None and not result.rejections
    assert result.engine.jobs["llm"].spec.spares is None


def test_a_scale_in_keeps_the_live_processes_and_a_node_of_the_jobs_pool_scales_it_out() -> None:
    """The golden `elastic_keeps_survivors`: the shared spare is free but not the job's (`spare_pool`), so the lost node
    makes the job scale in; the live ranks are kept (no stop, no restart: `kept`) and are the peers of the plan. The
    node that joins the job's pool scales it out, and the shared spare is still free for other jobs."""
    s = SCENARIOS["elastic_keeps_survivors"]()
    scale_in, scale_out = s.commands_of("scale_job")
    assert (scale_in.dp, scale_in.nodes, scale_in.kept) == (2, ["g0"], [0, 1])
    assert (scale_out.dp, scale_out.nodes, scale_out.kept) == (4, ["g0", "g2"], [0, 1])
    assert {source.tier for c in (scale_in, scale_out) for source in c.plan.shards} == {Tier.PEER}
    assert not s.commands_of("stop_ranks")
    assert s.engine.cluster.free_spares() == ["shared0"]
    assert s.engine.jobs["grow"].layout.dp == 4 and s.state("grow") == "running"


def test_a_stock_script_scaled_in_starts_every_process_anew() -> None:
    """A script that never reported through the SDK cannot re-form its process group in-process: nothing is kept."""
    s = Scenario()
    s.submit("stock", ["n0", "n1"], ranks_per_node=2, dp=4, elastic=Elastic(min_dp=2, max_dp=4).model_dump())
    s.advance(5)
    s.node_event("n1", "device.fault", device=0, vendor="nvidia", code="79")
    s.advance(3)
    s.ack_all()
    [scale] = s.commands_of("scale_job")
    assert scale.dp == 2 and scale.kept == []
    assert "kept" not in scale.model_dump()  # written as before survivors were kept

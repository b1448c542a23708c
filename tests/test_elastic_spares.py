"""Elastic jobs resume at the size they can have; the spare pool is shared by the jobs' spare quotas."""

from __future__ import annotations

from events.values import Elastic
from recovery.scenario import Scenario


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
    assert s.state("e") != "waiting", s.kinds("e")
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
    assert s.state("e") == "waiting"
    s.spare("s0")  # one node returns: three can run now
    s.ack_all()
    [scale] = s.commands_of("scale_job")
    assert scale.dp == 3

"""Engine behaviours that a simulated cluster at scale exposed: large plans, switch outages, rebooted nodes,
crashes of restarted processes, and dead ranks outside a migration."""

from __future__ import annotations

from events.envelope import MAX_PAYLOAD_BYTES, RawRecord
from recovery.log.recorder import replay
from recovery.log.verify import first_divergence
from recovery.testing.scenario import Scenario


def test_a_restart_decision_at_16k_ranks_fits_in_a_log_message() -> None:
    s = Scenario()
    s.spare("spare0")
    nodes = [f"n{i:05d}" for i in range(2048)]
    s.submit("llm", nodes, ranks_per_node=8, dp=128, tp=8, pp=16, watchdog_interval_s=1e6)
    s.checkpoint("llm", 0, "storage", "storage")
    s.node_event("n00100", "device.fault", device=1, vendor="nvidia", code="79")
    s.ack_all()
    oversized = [r for r in s.log.records() if isinstance(r, RawRecord)]
    assert not oversized, f"{len(oversized)} record(s) over {MAX_PAYLOAD_BYTES} bytes: " \
                          f"{[(r.subject, len(r.data)) for r in oversized]}"
    assert first_divergence(replay(s.log.records())) is None


def test_an_incident_keeps_the_other_nodes_of_a_switch_outage() -> None:
    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1", "n2", "n3"], ranks_per_node=2, dp=4, tp=2)
    s.train("llm", 5)
    s.checkpoint("llm", 5, "storage", "storage")
    for node in ("n0", "n1"):  # both nodes behind the switch lose their link at once
        s.node_event(node, "network.link_down", link="ib0", switch="leaf0")
    s.idle("llm", 12, ranks=[4, 5, 6, 7])
    incident = s.engine.jobs["llm"].incident
    assert incident is not None
    nodes = {fault["node"] for fault in incident.faults}
    assert nodes == {"n0", "n1"}, f"the incident knows only {sorted(nodes)}"


def test_a_node_that_rejoins_no_longer_holds_memory_checkpoints() -> None:
    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1"], ranks_per_node=2, dp=2, tp=2,
             policies={"checkpoint": {"name": "newest-complete", "params": {"dying": False}}})
    s.train("llm", 10)
    s.checkpoint("llm", 5, "storage", "storage")
    s.checkpoint("llm", 10, "memory", "n0", shards=[0, 1])
    s.node_event("n0", "node.not_ready", reason="power supply")
    s.node_event("n0", "node.joined", spare=False, devices=2)  # back after a power cycle: host memory is empty
    s.job_event("llm", "process.exited", rank=3, exit_code=139)
    plans = [d for d in s.decisions if d.kind == "checkpoint.plan"]
    assert plans and plans[-1].detail["checkpoint_step"] == 5, plans[-1].detail


def test_a_crash_after_a_job_level_restart_starts_a_new_attempt() -> None:
    s = Scenario()
    s.submit("llm", ["n0", "n1"], ranks_per_node=2, dp=4,
             policies={"checkpoint": {"name": "newest-complete", "params": {"dying": False}}})
    s.train("llm", 5)
    s.checkpoint("llm", 5, "storage", "storage")
    s.job_event("llm", "operator.force", granularity="restart_job")
    s.ack_all()
    job = s.engine.jobs["llm"]
    assert job.phase == "restoring"
    s.advance(30)  # the restarted ranks are loading their checkpoint when one of them crashes
    s.job_event("llm", "process.exited", rank=1, exit_code=139, attempt=job.generation)
    assert s.kinds("llm")[-1] != "fault.absorbed", "the crash waits for the attempt's deadline"


def test_a_pod_level_move_also_restarts_dead_ranks_elsewhere() -> None:
    s = Scenario()
    s.spare("spare0")
    s.submit("llm", ["n0", "n1", "n2"], ranks_per_node=2, dp=6,
             policies={"checkpoint": {"name": "newest-complete", "params": {"dying": False}}})
    s.train("llm", 5)
    s.checkpoint("llm", 5, "storage", "storage")
    s.node_event("n2", "node.not_ready", reason="host down")  # suspected: confirmed after its grace period
    s.job_event("llm", "process.exited", rank=1, exit_code=139)  # meanwhile a rank on n0 crashes
    started = s.find("attempt.started", "llm")
    assert started and started[-1].detail["granularity"] == "migrate"
    assert 1 in started[-1].detail["ranks"], f"the attempt restarts ranks {started[-1].detail['ranks']} only"


def test_a_switch_outage_starts_one_attempt() -> None:
    s = Scenario()
    s.spare("spare0")
    nodes = [f"n{i}" for i in range(8)]
    s.submit("llm", nodes, ranks_per_node=2, dp=8, tp=2)
    s.train("llm", 5)
    s.checkpoint("llm", 5, "storage", "storage")
    for node in nodes[:4]:  # the four nodes behind one leaf switch lose their links at once
        s.node_event(node, "network.link_down", link="ib0", switch="leaf0")
    s.idle("llm", 12, ranks=range(8, 16))
    superseded = s.find("attempt.superseded", "llm")
    assert not superseded, f"{len(superseded)} attempts superseded: {[d.reason for d in superseded]}"

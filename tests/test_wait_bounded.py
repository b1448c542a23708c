"""No wait without an exit: under any stream of faults and repairs, a stretch of `waiting` for nodes ends by the
deadline of the policy's latest answer (armed in the log), and that deadline is never later than the shipped
ladder's longest wait after the stretch began. What ends it (a node back, a spare, the fallback, a failure, or the
deadline itself, after which the policy is asked again and may wait anew) is up to the stream; that it ends is not.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import NS
from policies.rescheduling import DEFAULT_LADDERS
from recovery.core.incidents import MAX_WAIT_NS
from recovery.testing.scenario import Scenario

JOB = "w"
NODES = ["w0", "w1", "w2", "w3"]
XIDS = ["48", "48", "79", "46", "62", "94", "13", "119"]
ADVANCE_S = [1.0, 15.0, 30.0, 120.0, 301.0, 900.0, 3600.0, 4 * 3600.0 + 1]
LONGEST_WAIT_NS = max(MAX_WAIT_NS, *(int(r.wait_s * NS) for rungs in DEFAULT_LADDERS.values() for r in rungs))

_fault = st.one_of(st.tuples(st.just("xid"), st.integers(0, 3), st.integers(0, 1), st.sampled_from(XIDS)),
                   st.tuples(st.just("host_down"), st.integers(0, 3)))
_time = st.tuples(st.just("advance"), st.sampled_from(ADVANCE_S))
ops = st.lists(st.one_of(  # faults and time weigh more: they are what makes a job wait, and what ends a wait
    _fault, _fault, _time, _time,
    st.tuples(st.just("repair"), st.integers(0, 3)),
    st.tuples(st.just("device_ok"), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("link_down"), st.integers(0, 3)),
    st.tuples(st.just("link_up"), st.integers(0, 3)),
    st.tuples(st.just("exit"), st.integers(0, 7)),
    st.tuples(st.just("spare")),
    st.tuples(st.just("executors")),
    st.tuples(st.just("advance"), st.sampled_from(ADVANCE_S)),
    st.tuples(st.just("train"), st.integers(1, 3)),
), min_size=1, max_size=40)


def play(stream: list[tuple[Any, ...]], spares: int, elastic: bool) -> Scenario:
    s = Scenario()
    for index in range(spares):
        s.spare(f"s{index}")
    s.submit(JOB, list(NODES), ranks_per_node=2, dp=4, tp=2,
             elastic={"min_dp": 2, "max_dp": 4} if elastic else None)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    joined = spares
    for op in stream:
        job = s.engine.jobs[JOB]
        if job.state in ("failed", "completed", "cancelled"):
            break
        kind = op[0]
        nodes = list(job.nodes)
        if kind == "xid":
            s.node_event(nodes[op[1] % len(nodes)], "device.fault", device=op[2], vendor="nvidia", code=op[3])
        elif kind == "host_down":
            s.node_event(nodes[op[1] % len(nodes)], "node.not_ready", reason="host down")
        elif kind == "repair":
            name = sorted(s.engine.cluster.nodes)[op[1] % len(s.engine.cluster.nodes)]
            owner = s.engine.cluster.nodes[name].job
            s.node_event(name, "node.joined", spare=owner is None, devices=8)
        elif kind == "device_ok":
            s.node_event(nodes[op[1] % len(nodes)], "device.recovered", device=op[2])
        elif kind == "link_down":
            s.node_event(nodes[op[1] % len(nodes)], "network.link_down", link="ib0")
        elif kind == "link_up":
            s.node_event(nodes[op[1] % len(nodes)], "network.link_up", link="ib0")
        elif kind == "exit":
            s.job_event(JOB, "process.exited", rank=op[1] % job.world, exit_code=1, signal=None,
                        attempt=job.rank_gen[op[1] % job.world])
        elif kind == "spare":
            s.spare(f"s{joined}")
            joined += 1
        elif kind == "executors":
            s.ack_all()
        elif kind == "advance":
            s.advance(op[1])
        elif job.state == "running":
            s.train(JOB, op[1])
    return s


def waiting_stretches(s: Scenario) -> list[tuple[int, int | None, int | None]]:
    """(start, end or None if still waiting, the deadline armed last) of every stretch of `waiting`."""
    stretches: list[tuple[int, int | None, int | None]] = []
    start: int | None = None
    deadline: int | None = None
    for record in s.log.records():
        envelope = record.envelope  # type: ignore[union-attr]
        if envelope.type != "decision":
            continue
        decision = envelope.data
        if decision.job != JOB:
            continue
        if decision.kind == "attempt.wait_expired" and start is not None:
            # The deadline's exit: the policy is asked again, and may begin a new stretch with a deadline of its own
            # (the ladder waits again for the nodes an infrastructure fault took, rather than fail the job).
            stretches.append((start, record.ts, deadline))
            start = None
            continue
        if decision.phase == "waiting" and start is None:
            start = record.ts
            due = [t.due for t in decision.timers if "/wait/" in t.id]
            deadline = due[0] if due else None
        elif decision.phase == "waiting":
            # a later answer of the policy may move the stretch's deadline: the one armed last is the one that holds
            deadline = next((t.due for t in decision.timers if "/wait/" in t.id), deadline)
        elif start is not None:
            stretches.append((start, record.ts, deadline))
            start = None
    if start is not None:
        stretches.append((start, None, deadline))
    return stretches


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(0, 2), st.booleans())
def test_no_stretch_of_waiting_outlasts_the_deadline_its_wait_armed(stream: list[tuple[Any, ...]], spares: int,
                                                                    elastic: bool) -> None:
    s = play(stream, spares, elastic)
    assert not [r for r in s.rejections if r.code == "internal_error"]
    now = s.now
    for start, end, deadline in waiting_stretches(s):
        assert deadline is not None, "a wait for nodes without a deadline in the log"
        assert deadline - start <= LONGEST_WAIT_NS
        assert (end if end is not None else now) <= deadline, orjson.dumps(stream).decode()


def test_a_crash_while_a_link_is_being_debounced_waits_instead_of_failing() -> None:
    """A job whose only rung is an in-place restart: a rank crashes while another node's link is down and its
    debounce runs. The restart cannot be placed now; the job waits (bounded) and restarts once the link is up."""
    s = Scenario()
    only_in_place = {"rescheduling": {"name": "ladder", "params": {"ladders": {
        "process": [{"granularity": "in_place", "budget": 3, "deadline_s": 120}]}}}}
    s.submit(JOB, ["w0", "w1"], ranks_per_node=2, dp=4, policies=only_in_place)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    s.node_event("w1", "network.link_down", link="ib0")
    s.job_event(JOB, "process.exited", rank=0, exit_code=1, signal=None, attempt=0)
    assert s.phase(JOB) == "waiting" and s.state(JOB) != "failed"
    [waiting] = s.find("attempt.waiting", JOB)
    assert "cannot run processes now" in waiting.reason and any("/wait/" in t.id for t in waiting.timers)
    s.advance(3)
    s.node_event("w1", "network.link_up", link="ib0")
    s.ack_all()
    assert [d.detail["granularity"] for d in s.find("attempt.started", JOB)] == ["in_place"]
    assert not s.find("job.failed", JOB)


def test_a_policy_that_waits_again_after_its_deadline_gets_a_new_deadline_not_a_loop() -> None:
    """torchelastic-like waits for nodes whatever happens: after the engine's deadline it is asked again and waits
    again; that second wait has a deadline of its own, a full one later."""
    s = Scenario()
    baseline = {"rescheduling": {"name": "torchelastic-like-rescheduling"}}
    s.submit(JOB, ["w0", "w1"], ranks_per_node=2, dp=4, policies=baseline)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    s.node_event("w1", "device.fault", device=0, vendor="nvidia", code="79")
    s.ack_all()
    s.advance(MAX_WAIT_NS / NS + 1)
    assert len(s.find("attempt.wait_expired", JOB)) == 1
    [first, again] = [t for d in s.find("attempt.waiting", JOB) for t in d.timers if "/wait/" in t.id]
    assert again.due - first.due == MAX_WAIT_NS


def test_a_lost_host_and_a_reset_class_gpu_with_one_spare_move_one_node_and_reset_the_other() -> None:
    """Two nodes to leave, one spare: all or nothing would wait for a second spare (or a repair, hours away). After
    `reset_after_s` the ladder takes the one spare for the host that is gone and resets the GPU of the other."""
    s = Scenario()
    s.spare("s0")
    s.submit(JOB, ["w0", "w1", "w2"], ranks_per_node=2, dp=6)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    s.node_event("w2", "device.fault", device=1, vendor="nvidia", code="48")
    s.node_event("w1", "device.fault", device=0, vendor="nvidia", code="79")  # the whole node must be left
    s.advance(3)  # the settle window after the second fault widened the incident
    s.ack_all()
    assert s.phase(JOB) == "waiting"
    s.advance(301)
    s.ack_all()
    [move] = s.commands_of("migrate_ranks")
    assert (move.from_node, move.to_node) == ("w1", "s0")
    [restart] = [c for c in s.commands_of("restart_ranks") if c.reset_devices]
    assert restart.reset_devices == {"w2": [1]} and 5 in restart.ranks
    assert s.phase(JOB) == "restoring" and not s.find("job.failed", JOB)


def test_a_lost_node_joining_a_short_reset_wait_moves_its_deadline_out() -> None:
    """An XID 48 alone waits 300 s for a spare before resetting; a GPU off the bus on another node joins, which no
    reset fixes: the stretch's deadline moves to the ladder's 4 h (from the start of the stretch), and nothing fails
    at 300 s."""
    s = Scenario()
    s.submit(JOB, ["w0", "w1", "w2"], ranks_per_node=2, dp=6)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    s.node_event("w2", "device.fault", device=1, vendor="nvidia", code="48")
    [short] = [t for t in s.find("attempt.waiting", JOB)[0].timers if "/wait/" in t.id]
    s.advance(10)
    s.node_event("w1", "device.fault", device=0, vendor="nvidia", code="79")
    [longer] = [t for d in s.find("attempt.waiting", JOB) for t in d.timers if "/wait/" in t.id and t.id != short.id]
    assert longer.due - short.due == 4 * 3600 * NS - 300 * NS
    s.advance(301)
    assert s.phase(JOB) == "waiting" and not s.find("attempt.wait_expired", JOB) and not s.find("job.failed", JOB)


def test_a_reset_never_answered_leaves_its_device_bad_not_counted_usable() -> None:
    """The in-place restart that resets an XID 48 device times out unanswered: the reset may never have run, so the
    device counts bad again (a reset may still clear it). Before, the engine counted it usable from the attempt's
    start, and each job-level restart after it put a rank on a device the executor refused until the job ended."""
    s = Scenario()
    s.submit(JOB, ["w0", "w1", "w2"], ranks_per_node=2, dp=6)
    s.train(JOB, 3)
    s.checkpoint(JOB, 3, "storage", "storage")
    s.node_event("w2", "device.fault", device=1, vendor="nvidia", code="48")
    s.advance(301)  # no spare comes: the ladder resets the device and restarts the rank where it is
    for _ in range(10):
        pending = [c for c in s.outstanding() if c.kind != "restart_ranks"]
        if not pending:
            break
        for command in pending:
            s.complete(command)
    [restart] = [c for c in s.outstanding("restart_ranks") if c.reset_devices]
    assert restart.reset_devices == {"w2": [1]}
    assert not s.engine.cluster.nodes["w2"].bad_devices  # counted usable while the reset is under way
    s.advance(restart.deadline_s + 1)  # the executor never answers
    assert s.find("attempt.timed_out", JOB)
    node = s.engine.cluster.nodes["w2"]
    assert node.bad_devices == {1} and 1 in node.resettable
    assert not s.find("job.failed", JOB)

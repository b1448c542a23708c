"""No input stops recovery: extreme but schema-valid specs and events, sent through NATS to a real daemon. After each
batch another job's fault is still recovered, the log replays to what the daemon decided, and a restarted daemon
comes up ready on the same log."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from events import subjects
from events.codec import encode_envelope
from events.envelope import Record, make_envelope
from events.values import (
    MAX_DEVICES,
    MAX_SAFE_INT,
    MAX_SECONDS,
    MAX_WATCHDOG_S,
    MIN_INTERVAL_S,
    MIN_WATCHDOG_S,
    Granularity,
    JobSpec,
    Tier,
)
from recovery.log import MSG_ID
from recovery.service import config as config_mod
from recovery.service.daemon import Daemon
from recovery.testing.nats import NatsServer
from tests.daemon_support import async_wait_for, check_log, connect, read_stream

POISON = "poison"
GOOD = "good"


def extreme(low: float, high: float) -> st.SearchStrategy[float]:
    return st.sampled_from([low, high, (low + high) / 2, low * 1.5])


durations = extreme(MIN_INTERVAL_S, MAX_SECONDS)
steps = st.sampled_from([0, 1, MAX_SAFE_INT, MAX_SAFE_INT - 1, 2**40])


@st.composite
def poison_specs(draw: st.DrawFn) -> dict[str, Any]:
    rung = {"granularity": draw(st.sampled_from(["retry", "in_place", "migrate", "restart_job", "scale_in",
                                                  "dump", "fail"])),
            "budget": draw(st.sampled_from([None, 0, MAX_SAFE_INT])), "deadline_s": draw(durations),
            "tries": draw(st.sampled_from([1, MAX_SAFE_INT]))}
    detection = {"frequency_window_s": draw(durations), "link_debounce_s": draw(st.sampled_from([0.0, MAX_SECONDS])),
                 "not_ready_grace_s": draw(st.sampled_from([0.0, MAX_SECONDS])), "hang_min_silence_s": draw(durations),
                 "stall_min_s": draw(durations), "frequency_threshold": draw(st.sampled_from([1, MAX_SAFE_INT]))}
    checkpoint = {"dying_wait_s": draw(st.sampled_from([0.0, 3600.0])), "peer": draw(st.booleans())}
    spec = JobSpec.model_validate({
        "nodes": ["p0", "p1"], "ranks_per_node": 2, "layout": {"dp": 4},
        "elastic": draw(st.sampled_from([None, {"min_dp": 1, "max_dp": 4}, {"min_dp": 2, "max_dp": 2**20}])),
        "max_restarts": draw(st.sampled_from([None, 0, MAX_SAFE_INT])),
        "watchdog_interval_s": draw(extreme(MIN_WATCHDOG_S, MAX_WATCHDOG_S)),
        "policies": {"detection": {"name": "default", "params": detection},
                     "rescheduling": {"name": "ladder", "params": {
                         "ladders": {draw(st.sampled_from(["process", "device", "node", "hang"])): [rung]},
                         "settle_s": draw(st.sampled_from([0.0, MAX_SECONDS]))}},
                     "checkpoint": {"name": "newest-complete", "params": checkpoint}},
    })
    return spec.model_dump(mode="json")


def job_events(rank: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    return st.one_of(
        st.tuples(st.just("job.started"), st.just({})),
        st.tuples(st.just("process.exited"), st.fixed_dictionaries({
            "rank": rank, "exit_code": st.sampled_from([None, 0, 1, -(2**31), 2**32 - 1]),
            "signal": st.sampled_from([None, 1, 9, 15, 127]), "attempt": st.sampled_from([0, 1])})),
        st.tuples(st.just("progress.step"), st.fixed_dictionaries({"rank": rank, "step": steps})),
        st.tuples(st.just("process.heartbeat"), st.fixed_dictionaries({"rank": rank, "step": steps})),
        st.tuples(st.just("process.hang"), st.fixed_dictionaries({"rank": rank,
                                                                   "seconds_without_progress": durations})),
        st.tuples(st.just("checkpoint.saved"), st.fixed_dictionaries({
            "step": steps, "tier": st.sampled_from([t.value for t in Tier if t is not Tier.PEER]),
            "shards": st.just([0]), "holder": st.sampled_from(["p0", "storage"])})),
        st.tuples(st.just("network.collective_timeout"), st.fixed_dictionaries({
            "group": st.just("dp0"), "members": st.just([0, 1, 2, 3]), "reporters": st.just([0, 1]),
            "timeout_s": durations})),
        st.tuples(st.just("operator.force"), st.fixed_dictionaries({
            "granularity": st.sampled_from([g.value for g in Granularity])})),
        st.tuples(st.just("operator.scale"), st.fixed_dictionaries({"dp": st.sampled_from([1, 2, 3, 4, 2**20])})),
        st.tuples(st.just("timer.fired"), st.fixed_dictionaries({
            "timer_id": st.sampled_from([f"{POISON}/watchdog/3", "nothing"]), "due": st.sampled_from([0, 2**63 - 1])})),
        st.tuples(st.just("operator.pause"), st.just({})),
        st.tuples(st.just("operator.resume"), st.just({})),
    )


def node_events() -> st.SearchStrategy[tuple[str, str, dict[str, Any]]]:
    node = st.sampled_from(["p0", "p1", "spare-0"])
    return st.one_of(
        st.tuples(st.just("device.fault"), node, st.fixed_dictionaries({
            "device": st.sampled_from([0, 1, MAX_DEVICES - 1]), "vendor": st.just("nvidia"),
            "code": st.sampled_from(["79", "48", "13", "999999"]), "ecc_dbe": st.sampled_from([0, MAX_SAFE_INT])})),
        st.tuples(st.just("node.not_ready"), node, st.just({})),
        st.tuples(st.just("node.joined"), node, st.fixed_dictionaries({"devices": st.sampled_from([1, MAX_DEVICES])})),
        st.tuples(st.just("network.link_down"), node, st.just({"link": "mlx5_0"})),
        st.tuples(st.just("node.drained"), node, st.just({})),
    )


async def run_batch(spec: dict[str, Any], batch: list[Any], workdir: Path) -> None:
    server = NatsServer(workdir / "nats")
    server.start()
    try:
        url = server.url

        def daemon() -> Daemon:
            cfg = config_mod.load(nats_url=url, http_port=0, data_dir=workdir / "data", timers_enabled=True,
                                  snapshot_every_s=0.2, lease_ttl_s=0)
            return Daemon(cfg)

        first = daemon()
        async with first.running():
            await async_wait_for(lambda: first.readiness()[0], 20, "the daemon to be ready")
            crash = await publish_batch(url, spec, batch)
            assert await first.wait_applied(crash, 30), "the daemon stopped applying the log"
            assert first.readiness()[0], first.readiness()
        # Its timer service may have appended firings it did not apply before it stopped: they are the next start's.
        applied = first.engine.last_seq
        records = [r for r in await read_stream(url) if subjects.is_output(r.subject) or r.seq <= applied]
        recovered = [r.envelope.data for r in records if isinstance(r, Record) and r.envelope.type == "decision"
                     and r.envelope.data.job == GOOD and r.envelope.data.cause_seq == crash]
        assert [d.kind for d in recovered][:2] == ["fault.confirmed", "attempt.started"], recovered
        assert not [r for r in records if r.subject == subjects.dead_letter("internal_error")]
        check_log(records)
        again = daemon()
        async with again.running():
            await async_wait_for(lambda: again.readiness()[0], 20, "the restarted daemon to be ready")
    finally:
        server.stop()


async def publish_batch(url: str, spec: dict[str, Any], batch: list[Any]) -> int:
    """The good job, the poison one and `batch`, then a crash of the good job (its sequence is returned)."""
    nc, js = await connect(url)
    counter = 0

    async def send(type_: str, data: dict[str, Any], job: str | None = None, node: str | None = None) -> int:
        nonlocal counter
        counter += 1
        envelope = make_envelope(type_, data, id=f"e{counter}", job=job, node=node)
        subject = subjects.job_event(job, type_) if job else subjects.node_event(node or "", type_)
        ack = await js.publish(subject, encode_envelope(envelope), headers={MSG_ID: envelope.id})
        return ack.seq

    try:
        await send("node.joined", {"spare": True}, node="spare-0")
        await send("job.submitted", {"spec": JobSpec.model_validate(
            {"nodes": ["g0", "g1"], "ranks_per_node": 2, "layout": {"dp": 4}}).model_dump(mode="json")}, job=GOOD)
        await send("job.started", {}, job=GOOD)
        await send("job.submitted", {"spec": spec}, job=POISON)
        for item in batch:
            if len(item) == 2:
                await send(item[0], item[1], job=POISON)
            else:
                await send(item[0], item[2], node=item[1])
        for rank in range(4):
            await send("progress.step", {"rank": rank, "step": 1}, job=GOOD)
        return await send("process.exited", {"rank": 1, "exit_code": 139}, job=GOOD)
    finally:
        await nc.close()


def longest_spec() -> dict[str, Any]:
    """Every duration at its maximum: timers due years after log time, which the timer service must hold."""
    rung = {"granularity": "in_place", "deadline_s": MAX_SECONDS}
    return JobSpec.model_validate({
        "nodes": ["p0", "p1"], "ranks_per_node": 2, "layout": {"dp": 4}, "watchdog_interval_s": MAX_WATCHDOG_S,
        "policies": {"rescheduling": {"name": "ladder", "params": {"ladders": {"process": [rung]},
                                                                   "settle_s": MAX_SECONDS}},
                     "detection": {"name": "default", "params": {"link_debounce_s": MAX_SECONDS}}},
    }).model_dump(mode="json")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(longest_spec(), [("job.started", {}), ("network.link_down", "p0", {"link": "mlx5_0"}),
                          ("process.exited", {"rank": 0, "exit_code": 1}),
                          ("timer.fired", {"timer_id": f"{POISON}/watchdog/5", "due": 2**63 - 1})])
@given(poison_specs(), st.lists(st.one_of(job_events(st.sampled_from([0, 3])), node_events()), min_size=5,
                                max_size=25))
def test_extreme_but_valid_input_never_stops_the_daemon(spec: dict[str, Any], batch: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(run_batch(spec, batch, Path(workdir)))

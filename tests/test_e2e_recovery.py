"""End to end on real processes: a nats-server, a `recovery-daemon`, three `recovery-agent`s (two nodes of two
ranks and a spare) and the 4-way data-parallel job of `examples/dp-training` on torch.distributed with gloo.

A rank's process that dies is restarted alone: the three others keep their processes, re-form the process group in
the new generation and hand the restarted rank their state, and the job ends with the parameters of a run without
faults, bit for bit (every rank sees the same gradients summed in the same order, and the interrupted step is
recomputed from the same data)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from events.envelope import Record
from recovery.agent.ranks import start_time
from tests.daemon_support import read_stream
from tests.e2e_cluster import (
    SPARES,
    STEPS,
    Cluster,
    assert_bitwise_equal,
    run_job,
    start_cluster,
)
from tests.e2e_support import JobWatch, kill_leftovers, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("e2e")) as state:
        yield state


@pytest.fixture(scope="module")
def fault_free(shared_fault_free: dict[str, Any]) -> dict[str, Any]:
    """The job's parameters after a run without faults: the same on any cluster (the world, the seed and the data
    are), so the session's shared run serves (its cluster is up for the other end-to-end modules already)."""
    return shared_fault_free


@pytest.mark.parametrize("victim", [2, 0])
async def test_a_sigkilled_rank_alone_restarts_and_the_job_ends_as_a_fault_free_run(
        cluster: Cluster, fault_free: dict[str, Any], victim: int) -> None:
    measured: dict[str, float] = {}

    async def sigkill(w: JobWatch, explain: Callable[[], str]) -> None:
        pid = w.pids()[victim][-1]
        step = max(w.step(r) for r in range(4))
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def recovered() -> bool:
            # the replacement completed a step past the one the job was on when its rank died
            return any(e["data"]["rank"] == victim and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                       and e["_seen"] > killed for e in w.of("progress.step"))

        await wait_until(recovered, 90, f"rank {victim} to be recovered", explain)
        measured["recovered_s"] = time.monotonic() - killed

    w, params = await run_job(cluster, f"sigkill-{victim}", sigkill)
    pids = w.pids()
    assert len(pids[victim]) == 2, pids  # restarted once
    assert all(len(pids[r]) == 1 for r in range(4) if r != victim), pids  # the others kept their processes
    assert w.kinds().count("incident.closed") == 1
    assert_bitwise_equal(params, fault_free)
    print(f"rank {victim}: SIGKILL to recovered {measured['recovered_s']:.2f}s; pids {pids}")


async def test_a_stopped_rank_is_found_by_its_silence_within_10s_and_recovered_alone(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    victim = 1
    measured: dict[str, float] = {}

    async def sigstop(w: JobWatch, explain: Callable[[], str]) -> None:
        pid = w.pids()[victim][-1]
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)  # alive but silent: the survivors block in the collective, gloo raises nothing
        await wait_until(lambda: bool(w.decided("fault.confirmed")), 10, f"rank {victim}'s silence to be a fault",
                         explain)
        measured["detected_s"] = w.decided("fault.confirmed")[0]["_seen"] - stopped
        await wait_until(lambda: len(w.pids()[victim]) == 2 and w.kinds().count("incident.closed") == 1, 90,
                         f"rank {victim} to be recovered", explain)
        measured["recovered_s"] = time.monotonic() - stopped

    # The engine's own watchdog would call the rank silent only after 30 s: within 10 s, only its agent (which
    # reports a rank whose SDK fell silent for rank_silence_s, 8 s) can find it.
    w, params = await run_job(cluster, "sigstop-1", sigstop, detection={"hang_min_silence_s": 30.0,
                                                                       "agent_silence_s": 3.0})
    pids = w.pids()
    assert all(len(pids[r]) == 1 for r in range(4) if r != victim), pids
    # found at the edge: the rank's agent saw its SDK fall silent and reported it (process.hang), before the
    # engine's own watchdog (10 s) would have
    [hang] = [e for e in w.of("process.hang") if e["data"]["rank"] == victim]
    assert 8 <= hang["data"]["seconds_without_progress"] < 10, hang
    assert "no progress" in w.decided("fault.confirmed")[0]["data"]["reason"]
    assert_bitwise_equal(params, fault_free)
    print(f"SIGSTOP of rank {victim}: detected {measured['detected_s']:.2f}s, recovered {measured['recovered_s']:.2f}s")


async def test_nats_away_for_10s_restarts_nothing_and_loses_no_event_and_no_step(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """The control plane's bus restarts mid-training: the SDK keeps training, the agents keep every event in their
    outboxes and publish them in order on its return, and the engine, which heard nothing of the job meanwhile, does
    not take that for silence."""
    outage_s = 10.0
    steps_at: dict[str, int] = {}

    async def nats_restart(w: JobWatch, explain: Callable[[], str]) -> None:
        steps_at["stop"] = min(w.step(r) for r in range(4))
        cluster.nats.stop()
        await asyncio.sleep(outage_s)  # the outage itself: how long the bus stays away, not a wait for anything
        cluster.nats.start()

    # Slow steps (the parameters do not depend on the pace): the job still trains when the bus returns.
    w, params = await run_job(cluster, "nats-restart", nats_restart, step_time=0.5)
    assert all(len(pids) == 1 for pids in w.pids().values()), w.pids()
    assert "fault.confirmed" not in w.kinds() and "incident.opened" not in w.kinds(), w.kinds()
    records = [r for r in await read_stream(cluster.nats.url) if isinstance(r, Record)
               and r.envelope.job == "nats-restart" and r.envelope.type in ("progress.step", "progress.report")]
    words = [w for r in records for w in (r.envelope.data.ranks if r.envelope.type == "progress.report"  # type: ignore[union-attr]
                                          else [r.envelope.data])]
    for rank in range(4):
        # folded by the agent, a rank's steps arrive as its newest of each period: in order, none twice, to the last
        reported = [w.step for w in words if w.rank == rank and w.step is not None]
        assert reported == sorted(set(reported)) and reported[-1] == STEPS, f"rank {rank}: {reported}"
    assert steps_at["stop"] < STEPS - outage_s / 0.5 / 2, "the job was nearly done before the bus went away"
    assert_bitwise_equal(params, fault_free)


def resumed_from(cluster: Cluster, job: str, step: int) -> list[str]:
    """The logs of the job's restarted processes that say they loaded the saved checkpoint of `step`."""
    said = f"resumed from the dying checkpoint of step {step}:"
    return sorted(str(p.relative_to(cluster.workdir)) for p in cluster.workdir.glob(f"*/{job}.rank*.gen*.log")
                  if not p.name.endswith(".gen0.log") and said in p.read_text(errors="replace"))


async def test_the_power_off_checkpoint_of_a_healthy_replica_resumes_a_restarted_rank_at_the_next_step(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """Without the peer tier (`peer: false`), a rank's death makes a healthy replica write a dying checkpoint while
    it waits for the next generation (MindIO TTP's power-off checkpoint); the restarted rank loads it and the job
    resumes at the step after it, losing none."""
    victim = 2

    async def sigkill(w: JobWatch, explain: Callable[[], str]) -> None:
        os.kill(w.pids()[victim][-1], signal.SIGKILL)
        await wait_until(lambda: w.kinds().count("incident.closed") == 1, 90, f"rank {victim} to be recovered",
                         explain)

    w, params = await run_job(cluster, "power-off", sigkill, checkpoint={"peer": False})
    pids = w.pids()
    assert len(pids[victim]) == 2 and all(len(pids[r]) == 1 for r in range(4) if r != victim), pids
    [dying] = w.decided("checkpoint.dying")
    savers, asked = dying["data"]["detail"]["savers"], dying["data"]["detail"]["step"]
    assert victim not in savers and "checkpoint.dying_done" in w.kinds(), w.kinds()
    # A replica saves the state of the step it stands at: the one the engine last heard of, or the next, if its
    # report of that step was still in its agent's period when the rank died.
    [step] = [e["data"]["step"] for e in w.of("checkpoint.saved") if e["data"]["tier"] == "dying"]
    assert step in (asked, asked + 1), (asked, step)
    assert resumed_from(cluster, "power-off", step) == [f"n1/power-off.rank{victim}.gen1.log"]
    assert w.decided("incident.closed")[0]["data"]["detail"]["lost_steps"] == 0
    assert_bitwise_equal(params, fault_free)


async def test_a_preempted_node_saves_a_dying_checkpoint_and_the_job_resumes_at_the_next_step(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """SIGTERM to a node's agent, as a preemption sends it: its ranks save a dying checkpoint at their step
    boundary and wait there, then get SIGTERM; the job restarts on spares from that checkpoint, every new process
    loading it, and resumes at the step after it with none lost. n1's agent is gone afterwards."""

    async def preempt(w: JobWatch, explain: Callable[[], str]) -> None:
        cluster.agent("n1").proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: w.kinds().count("incident.closed") == 1, 90, "the job to resume", explain)

    w, params = await run_job(cluster, "preempted", preempt)
    saved = [e["data"] for e in w.of("checkpoint.saved") if e["data"]["tier"] == "dying"]
    assert saved and {s["holder"] for s in saved} == {"n1"}, saved  # n1's own ranks wrote it
    step = saved[0]["step"]
    exited = [e["data"] for e in w.of("process.exited") if e["data"]["rank"] in (2, 3)]
    assert exited and all(e.get("signal") == signal.SIGTERM for e in exited[:2]), exited
    plans = [d["data"]["detail"] for d in w.decisions if d["data"]["kind"] == "checkpoint.plan"]
    assert plans[-1]["checkpoint_step"] == step and plans[-1]["tiers"] == {"dying": 1}, plans
    assert len(resumed_from(cluster, "preempted", step)) == 4  # every new process loaded it
    assert w.decided("incident.closed")[0]["data"]["detail"]["lost_steps"] == 0
    assert_bitwise_equal(params, fault_free)


def sources(w: JobWatch, rank: int) -> list[str]:
    """The agent that started each process of `rank`, in order."""
    return [e["source"] for e in w.of("process.started") if e["data"]["rank"] == rank]


async def test_a_lost_node_moves_its_ranks_to_a_spare_and_the_other_node_keeps_its_processes(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """An agent and its ranks SIGKILLed together (the host is gone). Its heartbeat stops, so the engine moves the
    node's ranks to a spare; the rendezvous store runs off the training nodes, so the survivors re-form the process
    group with the newcomers and hand them their state. Last in the module: n0 does not come back."""
    measured: dict[str, float] = {}

    async def node_loss(w: JobWatch, explain: Callable[[], str]) -> None:
        lost = cluster.agent("n0")
        ranks = [w.pids()[r][-1] for r in (0, 1)]
        step = max(w.step(r) for r in range(4))
        killed = time.monotonic()
        lost.proc.kill()
        kill_leftovers(ranks)

        def recovered() -> bool:
            return all(any(e["data"]["rank"] == r and e["data"]["attempt"] >= 1 and e["data"]["step"] > step
                           and e["_seen"] > killed for e in w.of("progress.step")) for r in (0, 1))

        await wait_until(lambda: bool(w.decided("fault.confirmed")), 15, "the lost node to be a fault", explain)
        measured["detected_s"] = w.decided("fault.confirmed")[0]["_seen"] - killed
        await wait_until(recovered, 90, "n0's ranks to train again on a spare", explain)
        measured["recovered_s"] = time.monotonic() - killed

    w, params = await run_job(cluster, "node-loss", node_loss, nodes=["n0", "n2"], rendezvous="external")
    pids = w.pids()
    assert all(len(pids[r]) == 1 for r in (2, 3)), pids  # n2's processes were not restarted
    assert all(len(pids[r]) == 2 for r in (0, 1)), pids
    moved_to = {sources(w, r)[-1] for r in (0, 1)}
    assert len(moved_to) == 1 and moved_to <= SPARES, moved_to
    confirmed = w.decided("fault.confirmed")[0]["data"]["reason"]
    # the survivors lost n0's connections: the daemon asked n0's agent at once, and nothing listened for it (its
    # silence past the bound is the way left when no probe is answered at all)
    assert confirmed.startswith(("agent of n0 unreachable", "agent of n0 silent")), confirmed
    assert "migrate" in [d["data"].get("detail", {}).get("granularity") for d in w.decided("attempt.started")]
    assert w.kinds().count("incident.closed") == 1
    assert_bitwise_equal(params, fault_free)
    print(f"node loss: detected {measured['detected_s']:.2f}s, recovered {measured['recovered_s']:.2f}s; {pids}")


async def test_an_agent_lost_alone_is_fenced_its_ranks_move_and_the_old_processes_never_join(
        cluster: Cluster, fault_free: dict[str, Any]) -> None:
    """Only n3's agent is SIGKILLed: its two ranks live on and keep training with n2's, but nothing reports them, so
    the engine takes the node for lost and starts its ranks on a spare in generation 1. n2's survivors see the new
    generation at their next step boundary (`group.check`) and re-form with the newcomers; the old processes see it
    too, but no agent answers their `join`, so they never join beside their replacements. Last in the module: n3's
    agent does not come back."""
    orphans: list[int] = []

    async def agent_loss(w: JobWatch, explain: Callable[[], str]) -> None:
        orphans.extend(w.pids()[r][-1] for r in (0, 1))
        cluster.agent("n3").proc.kill()
        await wait_until(lambda: bool(w.decided("fault.confirmed")), 20, "the silent agent to be a fault", explain)

    # slower steps: the old group trains on until the engine has found the silent agent (3 s), and must not finish
    w, params = await run_job(cluster, "agent-loss", agent_loss, nodes=["n3", "n2"], rendezvous="external",
                              step_time=0.3)
    pids = w.pids()
    assert all(len(pids[r]) == 1 for r in (2, 3)), pids  # n2's processes re-formed the group, not restarted
    assert all(len(pids[r]) == 2 for r in (0, 1)), pids
    assert {sources(w, r)[-1] for r in (0, 1)} <= SPARES
    assert "agent of n3 silent" in w.decided("fault.confirmed")[0]["data"]["reason"]
    # the old processes still run (nothing stopped them: their agent is gone) but trained no step in generation 1
    assert all(start_time(pid) is not None for pid in orphans)
    joined = [e for e in w.of("progress.step") if e["data"]["rank"] in (0, 1) and e["data"]["attempt"] >= 1]
    assert {e["source"] for e in joined} <= SPARES
    assert_bitwise_equal(params, fault_free)

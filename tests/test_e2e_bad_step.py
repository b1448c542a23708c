"""A bad step on real processes (the shared cluster of `tests/e2e_cluster.py`: a nats-server, a daemon, the agents,
the gloo job of `examples/dp-training`): rank 1's loss at step 23 is NaN in the job's first generation, its gradients
all-reduced into every replica. The loss travels with the step report, through the agent's fold, to the engine; the
job rolls back once, every rank restarted in place from the newest checkpoint before step 23 (20, of a checkpoint
every 5 steps), with a resume plan that names step 23 to skip; the script passes over that step's batch, trains to
the end, and its final parameters equal, bit for bit, those of the same script run without the NaN and told to skip
step 23 (`--skip-steps 23`), run at the same time on two other nodes."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.e2e_cluster import Cluster, assert_bitwise_equal, run_job

BAD_STEP = 23
NAN_RANK = 1
EVERY = 5
LENIENT = {"hang_min_silence_s": 30.0, "agent_silence_s": 10.0}  # a busy 2-core host must not look hung


async def test_a_nan_loss_rolls_the_job_back_before_it_once_and_it_ends_as_a_run_that_skips_that_step(
        shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    job, reference = "bad-step", "bad-step-reference"

    def args(name: str, *extra: str) -> list[str]:
        return ["--checkpoint-every", str(EVERY), "--checkpoint-dir", str(cluster.workdir / f"{name}-ckpt"), *extra]

    (w, params), (_, expected) = await asyncio.gather(
        run_job(cluster, job, detection=LENIENT,
                args=args(job, "--nan-at-step", str(BAD_STEP), "--nan-rank", str(NAN_RANK))),
        run_job(cluster, reference, nodes=["n2", "n3"], detection=LENIENT,
                args=args(reference, "--skip-steps", str(BAD_STEP))))

    def explain() -> str:
        return f"--- decisions of {job}: {[(d['data']['kind'], d['data']['reason']) for d in w.decisions]}"

    reasons = [d["data"]["reason"] for d in w.decided("fault.confirmed") + w.decided("fault.added")]
    assert f"loss nan at step {BAD_STEP} on rank {NAN_RANK}" in [r.split(":")[0] for r in reasons], explain()
    assert len(w.decided("fault.confirmed")) == 1, explain()
    [attempt] = w.decided("attempt.started")  # exactly one roll-back: every later NaN was its consequence
    assert attempt["data"]["detail"]["granularity"] == "in_place", explain()
    assert attempt["data"]["detail"]["ranks"] == [0, 1, 2, 3], explain()
    restarts: list[dict[str, Any]] = [c for d in w.decisions for c in d["data"]["commands"]
                                      if c["kind"] == "restart_ranks"]
    [restart] = restarts
    # The newest checkpoint before the bad step; one at 25 (if rank 0 saved it) holds the NaN.
    assert restart["plan"]["checkpoint_step"] == BAD_STEP // EVERY * EVERY, restart
    assert restart["plan"]["skip_steps"] == [BAD_STEP], restart
    [closed] = w.decided("incident.closed")
    assert closed["data"]["detail"]["granularity"] == "in_place", explain()

    # No step trained twice after the roll-back: in its generation each rank's progress starts past the checkpoint and
    # never goes back (a folded heartbeat may repeat the newest step: a word, not a step trained again); the
    # parameters below would differ from the reference's had a step been applied twice or the bad one kept.
    for rank in range(4):
        steps = [e["data"]["step"] for e in w.of("progress.step")
                 if e["data"]["rank"] == rank and e["data"].get("attempt") == 1]
        assert steps == sorted(steps) and steps[0] > restart["plan"]["checkpoint_step"], (rank, steps)
    assert "job.completed" in w.kinds(), explain()
    assert all(len(pids) == 2 for pids in w.pids().values()), w.pids()  # every rank restarted once
    assert_bitwise_equal(params, expected)
    heard = min(e["_seen"] for e in w.of("progress.step") if e["data"].get("loss") == "nan")
    detected = w.decided("fault.confirmed")[0]["_seen"] - heard
    print(f"bad step: {reasons}; decided {detected * 1000:.0f} ms after the first NaN report was published; resumed "
          f"from {restart['plan']['checkpoint_step']}, skipped {BAD_STEP}; incident closed "
          f"{closed['data']['detail']['mttr_ns'] / 1e9:.1f} s after it opened")

"""`python tools/bench.py fleet --only fleet`: case (b), a fleet of `--fleet-gpus` GPUs (200,000: 1,000 jobs of 25
nodes x 8) on three nats-servers routed as one JetStream cluster (streams and buckets at 3 replicas) and three
`recovery-daemon`s that share `--partitions` partitions of the jobs through their leases.

The agents are simulated in processes of their own (`tools/bench_fleet_agents.py`), each a slice of the jobs; every
node reports once per `--fleet-report-s`. Faults strike throughout, one every `--fleet-fault-every-s` on a job with no
incident open. A third of the way into the window the daemon that owns the most partitions is SIGKILLed; two thirds
of the way in, the nats-server that leads the log stream is SIGKILLed, and started again on its store
`--fleet-server-down-s` later.

What it reports:
- `fleet_start_settled_s`: from the agents' start until the partitions applied the fleet's first words (every
  node's mode and first report at once), which the window waits for;
- `fleet_steady_log_per_s`: records the log stored a second in `--fleet-steady-s` with no fault, before the window;
- `fleet_inputs_per_s`: messages the log stored a second over the window, and `fleet_lag_at_end` what the
  partitions had still to apply when it ended (the daemons keep up when it is near 0);
- `fleet_daemon_cpu_cores`: the three daemons' CPU seconds over the window's seconds (the control plane's share of the
  machine per second of fleet time), and `fleet_rss_mb_max` the largest daemon's RSS;
- `fleet_fault_to_command_p50_ms` / `_p99_ms`: from a fault's `process.exited` being sent to the first command of the
  job's next generation on the wire, for the faults no failover held up (those are `fleet_failover_held_faults`);
- `fleet_failover_s`: from the SIGKILL until the survivors own and serve every partition (each claimed, restored,
  active and caught up with the log in a survivor's `/status`), against `fleet_lease_ttl_s`: the goal is the TTL + 2 s
  or less;
- `fleet_server_failover_s`: from the log's leading server's SIGKILL until every partition is current again (each
  served, ready and within `SERVING_LAG` of the log's end); the faults struck in either failover are held, and so
  are those struck before a kill and not answered when it came (of the lost partitions, for the daemon's);
- `fleet_lost`: faults stored by JetStream that no command answered by the end, or that the log does not hold;
- `fleet_doubled`: commands stored twice (by message id), decisions stored twice (by their cause and index), and
  attempts started twice for one job.

Every process it starts (servers, daemons, agents) is stopped when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from bench_harness import Emit, note
from bench_harness_daemon import Daemon, publish_all
from bench_harness_fleet import (
    AGENTS,
    BENCH,
    CONTROL,
    NODES_PER_JOB,
    RPN,
    job_name,
    log_state,
    node_name,
    stream_messages,
)
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from events.values import JobSpec
from recovery.log import MSG_ID
from recovery.log.pull import PullReader
from recovery.testing.nats import NatsCluster, NatsServer

SERVING_LAG = 200
"""a partition's consumer this close to the log's end serves a fault at once (it reads the whole log: about a
second's records)"""


@dataclass
class Fault:
    job: str
    partition: int
    sent: float
    generation: int
    ident: str
    commanded: float | None = None
    held: bool = False
    """struck while its partition had no owner (the killed daemon's, before the failover ended), or while the log's
    leading server was lost (before every partition was current again), or struck before either kill and not yet
    answered when it came"""


@dataclass
class Watch:
    """What the bench sees on the wire: the first command of each (job, generation), and closed incidents."""

    first_command: dict[tuple[str, int], float] = field(default_factory=dict)
    open_jobs: set[str] = field(default_factory=set)

    async def on_command(self, msg: Any) -> None:
        _, job, _ = subjects.command_parts(msg.subject)
        attempt = int(orjson.loads(msg.data).get("attempt", 0))
        self.first_command.setdefault((job, attempt), time.monotonic())

    async def on_decision(self, msg: Any) -> None:
        if b'"incident.closed"' in msg.data:
            self.open_jobs.discard(msg.subject.rsplit(".", 1)[-1])


def submissions(jobs: int, report_s: float = 1.0) -> list[tuple[str, bytes, str]]:
    """The fleet's jobs, submitted and started; their silence bounds at least three of the agents' report periods (a
    node that reports every 10 s is not silent after 5)."""
    items = []
    bounds = {"agent_silence_s": max(5.0, 3 * report_s), "hang_min_silence_s": max(10.0, 3 * report_s)}
    for j in range(jobs):
        job = job_name(j)
        spec = JobSpec.model_validate({"nodes": [node_name(j * NODES_PER_JOB + i) for i in range(NODES_PER_JOB)],
                                       "ranks_per_node": RPN, "layout": {"dp": NODES_PER_JOB * RPN},
                                       "watchdog_interval_s": 5.0,
                                       "policies": {"detection": {"name": "default", "params": bounds}}})
        for type_, data in (("job.submitted", {"spec": spec.model_dump(mode="json")}), ("job.started", {})):
            env = make_envelope(type_, data, id=f"{job}-{type_}", job=job, source="bench")
            items.append((subjects.job_event(job, type_), encode_envelope(env), env.id))
    return items


def owned(daemon: Daemon) -> list[int]:
    """The partitions `daemon` serves now: claimed, restored, active and caught up with the log, so that a fault
    struck there is answered now, not after a backlog (empty when it does not answer)."""
    status = daemon.status()
    parts = status.get("partition_status") or {}
    return sorted(int(k) for k in status.get("owned", [])
                  if (parts.get(str(k)) or {}).get("role") == "active" and (parts.get(str(k)) or {}).get("ready"))


def coverage(daemons: list[Daemon]) -> list[int]:
    return sorted(k for d in daemons if d.proc is not None and d.proc.poll() is None for k in owned(d))


async def coverage_now(daemons: list[Daemon]) -> list[int]:
    """`coverage`, each daemon asked at once (a failover's end is when the last answers, not the sum of the
    answers' waits: a survivor busy catching up answers late)."""
    alive = [d for d in daemons if d.proc is not None and d.proc.poll() is None]
    return sorted(k for found in await asyncio.gather(*(asyncio.to_thread(owned, d) for d in alive)) for k in found)


def serving(daemons: list[Daemon], partitions: int) -> bool:
    """Every partition served and current: active, ready, and its consumer no more than `SERVING_LAG` behind the
    log (after a server's loss the consumers are made again, and catch up)."""
    if coverage(daemons) != list(range(partitions)):
        return False
    return all(int(part.get("lag") or 0) <= SERVING_LAG for d in daemons if d.proc is not None and d.proc.poll() is None
               for part in (d.status().get("partition_status") or {}).values() if part.get("role") == "active")


def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)  # polling interval of a deadline-bounded wait (each poll is a request a daemon serves)


async def stored(nc: Client, stream: str, subject: str) -> list[tuple[str, str, bytes]]:
    """(subject, message id, data) of every message of `stream` on `subject`, in stream order."""
    return [(subj, ident, data) for subj, ident, data, _ in await stored_at(nc, stream, subject)]


async def stored_at(nc: Client, stream: str, subject: str) -> list[tuple[str, str, bytes, int]]:
    """(subject, message id, data, stream sequence) of every message of `stream` on `subject`, in stream order."""
    js = nc.jetstream(timeout=30)
    reader = PullReader(nc, js, stream, ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True,
                                                       filter_subject=subject), batch=1000)
    out: list[tuple[str, str, bytes, int]] = []
    await reader.open(1)
    try:
        while not reader.caught_up or reader.lag:
            for msg in await reader.next_batch(reader.stall_s):
                out.append((msg.subject, (msg.headers or {}).get(MSG_ID, ""), msg.data, msg.seq))
    finally:
        await reader.close()
    return out


async def strike_faults(cluster: NatsCluster, daemons: list[Daemon], jobs: int, partitions: int, seconds: float,
                        every_s: float, seed: int, server_down_s: float
                        ) -> tuple[list[Fault], tuple[float, float], Daemon, list[int]]:
    """Faults throughout the window, the SIGKILL of the busiest daemon a third into it and of the log stream's
    leading nats-server two thirds into it: (faults, (the daemon's and the server's failover seconds), the daemon
    killed, its partitions)."""
    url = cluster.url
    import nats

    nc = await nats.connect(url.split(","), max_reconnect_attempts=-1)
    watch = Watch()
    await nc.subscribe(subjects.COMMANDS, cb=watch.on_command)
    await nc.subscribe(subjects.DECISIONS, cb=watch.on_decision)
    rng = random.Random(seed)
    faults: list[Fault] = []
    victim = max(daemons, key=lambda d: len(owned(d)))
    lost = owned(victim)
    failover_s = float("nan")
    killed_at: float | None = None
    server_killed: tuple[NatsServer, float] | None = None
    server_failover_s = float("nan")
    survivors = [d for d in daemons if d is not victim]

    async def failovers() -> None:
        """Each failover's end, looked for every 50 ms beside the faults (whose pace is not the measure's)."""
        nonlocal failover_s, server_failover_s
        while failover_s != failover_s or server_failover_s != server_failover_s:
            if (killed_at is not None and failover_s != failover_s  # still failing over
                    and await coverage_now(survivors) == list(range(partitions))):
                failover_s = time.monotonic() - killed_at
            if (server_killed is not None and server_failover_s != server_failover_s  # the log's leader lost
                    and await asyncio.to_thread(serving, survivors, partitions)):
                server_failover_s = time.monotonic() - server_killed[1]
            await asyncio.sleep(0.05)  # the measure's resolution

    measuring = asyncio.ensure_future(failovers())
    t0 = time.monotonic()
    try:
        while (now := time.monotonic()) - t0 < seconds:
            if killed_at is None and now - t0 >= seconds / 3:
                victim.stop(kill=True)
                killed_at = time.monotonic()
                # the wall time, to read the survivors' logs (`--keep-logs`) against: each takeover's steps are there
                note(f"the daemon owning partitions {lost} SIGKILLed at "
                     f"{datetime.now(UTC).strftime('%H:%M:%S.%f')[:-3]} UTC")
            if server_killed is None and now - t0 >= 2 * seconds / 3:
                leader = await asyncio.to_thread(cluster.leader_of, "RECOVERY")
                if leader is not None:
                    leader.kill()
                    server_killed = (leader, time.monotonic())
                    note(f"nats-server {cluster.names[cluster.servers.index(leader)]} (the log's leader) SIGKILLed")
            elif server_killed and not server_killed[0].running and now - server_killed[1] > server_down_s:
                await asyncio.to_thread(server_killed[0].start)
            choices = [j for j in range(jobs) if job_name(j) not in watch.open_jobs]
            if choices:
                j = rng.choice(choices)
                job = job_name(j)
                rank = rng.randrange(NODES_PER_JOB * RPN)
                node = node_name(j * NODES_PER_JOB + rank // RPN)
                # the node's agent process may be reconnecting (its server killed): no fault this time
                with contextlib.suppress(TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    reply = orjson.loads((await nc.request(f"{CONTROL}.fault.{node}", str(rank).encode(),
                                                           timeout=30)).data)
                    watch.open_jobs.add(job)
                    part = subjects.partition_of(job, partitions)
                    held = ((killed_at is not None and failover_s != failover_s and part in lost)
                            or (server_killed is not None and server_failover_s != server_failover_s))
                    faults.append(Fault(job, part, reply["sent"], reply["generation"], reply["id"], held=held))
            await asyncio.sleep(every_s)  # the pace of the faults
        # the last faults' commands, within a bound
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any((f.job, f.generation + 1) not in watch.first_command
                                                  for f in faults):
            await asyncio.sleep(0.05)  # polling the subscription's record, within the deadline
        for f in faults:
            f.commanded = watch.first_command.get((f.job, f.generation + 1))
            answered = f.commanded if f.commanded is not None else float("inf")
            # struck before a kill, and not answered when it came: that failover held it up as well
            f.held = f.held or (killed_at is not None and f.partition in lost and f.sent < killed_at < answered) or (
                server_killed is not None and f.sent < server_killed[1] < answered)
    finally:
        measuring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await measuring
        await nc.close()
    return faults, (failover_s, server_failover_s), victim, lost


async def read_back(url: str, faults: list[Fault]) -> tuple[int, int, str]:
    """(lost, doubled, what they are) from the log and the command stream."""
    import nats

    nc = await nats.connect(url.split(","))
    try:
        exit_seqs = {ident: seq for _, ident, _, seq in await stored_at(nc, "RECOVERY",
                                                                      "recovery.p.*.ev.job.*.process.exited")}
        exits = set(exit_seqs)
        decisions = await stored(nc, "RECOVERY", subjects.DECISIONS)
        dead_letters = await stored(nc, "RECOVERY", f"{subjects.PREFIX}.dlq.>")
        commands = await stored(nc, "RECOVERY_CMD", subjects.COMMANDS)
    finally:
        await nc.close()
    # Answered if the command stream holds the job's next generation's command: the bench's own live subscription
    # can miss one while the nats-server it is connected to is down, the stream cannot.
    stored_commands = {(subjects.command_parts(subject)[1], int(orjson.loads(data).get("attempt", 0)))
                       for subject, _, data in commands}
    unanswered = [f for f in faults if f.commanded is None and (f.job, f.generation + 1) not in stored_commands]
    unseen = sum(1 for f in faults if f.commanded is None) - len(unanswered)
    for f in unanswered:  # what the engine made of it, for the note
        seq = exit_seqs.get(f.ident)
        made = [f"{body.get('kind')}: {body.get('reason')}" for _, _, data in decisions
                if (body := orjson.loads(data).get("data", {})).get("cause_seq") == seq]
        made += [f"refused: {body.get('reason')}" for _, _, data in dead_letters
                 if (body := orjson.loads(data).get("data", {})).get("seq") == seq]
        note(f"unanswered {f.job} (partition {f.partition}, exit at seq {seq}, agent's generation {f.generation}): "
             + ("; ".join(made) or "no decision, no refusal"))
    missing = [f for f in faults if f.ident not in exits]
    causes: Counter[tuple[str, int, int]] = Counter()
    started: Counter[tuple[str, str, int]] = Counter()
    for _, _, data in decisions:
        body = orjson.loads(data).get("data", {})
        causes[(body.get("job"), body.get("cause_seq"), body.get("index"))] += 1
        if body.get("kind") == "attempt.started":
            started[(body.get("job"), body.get("incident"), int(body.get("detail", {}).get("attempt", 0)))] += 1
    doubled_decisions = sum(n - 1 for n in causes.values() if n > 1)
    doubled_attempts = sum(n - 1 for n in started.values() if n > 1)
    doubled_commands = sum(n - 1 for n in Counter(ident for _, ident, _ in commands).values() if n > 1)
    lost = len({f.ident for f in unanswered + missing})
    doubled = doubled_decisions + doubled_attempts + doubled_commands
    what = (f"{len(unanswered)} faults unanswered ({unseen} more answered in the command stream, unseen live), "
            f"{len(missing)} not in the log{_which(unanswered + missing)}; doubled: {doubled_decisions} "
            f"decisions, {doubled_attempts} attempts, {doubled_commands} commands (of {len(commands)})")
    return lost, doubled, what


def _which(faults: list[Fault]) -> str:
    return "" if not faults else " (" + ", ".join(f"{f.job} of partition {f.partition} in generation {f.generation}"
                                                   for f in faults[:5]) + ")"


def stream_mix(url: str, first: int, last: int) -> Counter[str]:
    """What the log stored from sequence `first` to `last`, by record type (a job's or node's event by its type, an
    output by its subject's head): what a steady window's records are."""
    async def read() -> Counter[str]:
        import nats

        nc = await nats.connect(url.split(","))
        mix: Counter[str] = Counter()
        reader = PullReader(nc, nc.jetstream(timeout=30), "RECOVERY", ConsumerConfig(
            ack_policy=AckPolicy.NONE, mem_storage=True), batch=1000, end_seq=last)
        try:
            await reader.open(first)
            while not reader.done and not (reader.caught_up and not reader.lag):
                for msg in await reader.next_batch(reader.stall_s):
                    tokens = msg.subject.split(".")
                    kind = next((".".join(tokens[k + 2:]) for k, t in enumerate(tokens) if t in ("job", "node")),
                                ".".join(tokens[:3]))
                    if kind == "timer.fired":  # which timer: a watchdog's tick, a deadline, a debounce
                        kind += f" ({orjson.loads(msg.data)['data']['timer_id'].split('/')[1]})"
                    mix[kind] += 1
        finally:
            await reader.close()
            await nc.close()
        return mix

    return asyncio.run(read())


def summarized_jobs(url: str, partitioned: bool) -> int:
    """How many jobs the log holds a progress summary of (the distinct subjects it stored them on)."""
    return len(log_state(url, subjects.stored_job_events("progress.summary", partitioned)).subjects or {})


def stream_last_seq(url: str) -> int:
    return int(log_state(url).last_seq)


def lag(daemons: list[Daemon]) -> int:
    """Inputs stored and not yet applied, over every partition the running daemons serve."""
    return sum(int(part.get("lag") or 0) for d in daemons if d.proc is not None and d.proc.poll() is None
               for part in (d.status().get("partition_status") or {}).values())


def run_fleet(args: argparse.Namespace, work: Path, emit: Emit) -> None:
    gpus = args.fleet_gpus or (20_000 if args.quick else 200_000)
    jobs = max(1, gpus // (NODES_PER_JOB * RPN))
    seconds = args.seconds or (30.0 if args.quick else 90.0)
    partitions, ttl = args.partitions, args.lease_ttl_s
    cluster = NatsCluster(work / "nats", size=3)
    daemons: list[Daemon] = []
    workers: list[subprocess.Popen[bytes]] = []
    try:  # every server is stopped however it ends, a failure in the window too
        try:
            cluster.start()
            settings = {"partitions": partitions, "lease_ttl_s": ttl, "replicas": 3,
                        "snapshot_every_s": args.fleet_snapshot_s,
                        "log_level": "INFO" if getattr(args, "keep_logs", None) else "WARNING"}
            daemons.extend(Daemon(work / f"daemon-{name}", cluster.url, instance=f"daemon-{name}", **settings)
                           for name in "abc")
            for daemon in daemons:
                daemon.start()
            wait(lambda: coverage(daemons) == list(range(partitions)) and all(owned(d) for d in daemons), 120,
                 "three daemons to share the partitions")

            async def submit() -> None:
                import nats

                nc = await nats.connect(cluster.url.split(","), max_reconnect_attempts=-1)
                await publish_all(nc.jetstream(timeout=30), submissions(jobs, args.fleet_report_s))
                await nc.close()

            asyncio.run(submit())
            per = -(-jobs // args.workers)
            started = time.monotonic()
            for w in range(args.workers):
                mine = [[job_name(j), j * NODES_PER_JOB, j * NODES_PER_JOB, NODES_PER_JOB]
                        for j in range(w * per, min(jobs, (w + 1) * per))]
                if mine:
                    spec = {"url": cluster.url, "jobs": mine, "report_s": args.fleet_report_s, "step_s": args.step_s,
                            "seconds": seconds + args.warmup_s + args.fleet_settle_s + args.fleet_steady_s + 90,
                            "liveness": args.fleet_liveness,
                            "progress": args.fleet_progress}
                    workers.append(subprocess.Popen([sys.executable, str(AGENTS), orjson.dumps(spec).decode()],
                                                    stdin=subprocess.DEVNULL, start_new_session=True))
            time.sleep(args.warmup_s)  # the agents' first reports, before the window is measured
            # The whole fleet's first words at once (every node's mode, every rank's first report, each node event
            # read by every partition) are a start's burst, not the steady state the window measures: it is timed on
            # its own, and the window starts once the partitions have applied it (or after --fleet-settle-s).
            settle = time.monotonic() + args.fleet_settle_s
            while not serving(daemons, partitions) and time.monotonic() < settle:
                time.sleep(1.0)  # the partitions' progress through the start's burst
            emit(BENCH, "fleet_start_settled_s", round(time.monotonic() - started, 1),
                 f"s from the agents' start until the partitions had applied its burst (at most "
                 f"{args.fleet_settle_s:g} s + the warm-up)")
            # The healthy fleet first: what the log stores a second with no fault (three servers, R3), once every job
            # had its first summary (a summary period after its first report heard): until then a job's watchdog
            # ticks every interval, as at any job's start.
            while (args.fleet_progress == "summary" and time.monotonic() < settle
                   and summarized_jobs(cluster.url, partitions > 1) < jobs):
                time.sleep(1.0)  # the jobs' first summaries
            quiet0, q0, first = stream_messages(cluster.url), time.monotonic(), stream_last_seq(cluster.url) + 1
            time.sleep(args.fleet_steady_s)  # the steady window, nothing struck
            emit(BENCH, "fleet_steady_log_per_s", round((stream_messages(cluster.url) - quiet0)
                                                        / (time.monotonic() - q0), 1),
                 f"records the log stored a second in {args.fleet_steady_s:g} s with no fault")
            mix = stream_mix(cluster.url, first, stream_last_seq(cluster.url))
            note("the steady window's records: " + ", ".join(f"{kind} {n:,}" for kind, n in mix.most_common()))
            stored0 = stream_messages(cluster.url)
            cpu0 = [d.cpu_s() for d in daemons]
            t0 = time.monotonic()
            faults, (failover_s, server_failover_s), victim, lost_parts = asyncio.run(strike_faults(
                cluster, daemons, jobs, partitions, seconds, args.fleet_fault_every_s, args.seed,
                args.fleet_server_down_s))
            wall = time.monotonic() - t0
            survivors = [d for d in daemons if d is not victim]
            # the victim's CPU counts until it died: it is a daemon of the fleet for that part of the window
            cpu = sum(d.cpu_s() - c for d, c in zip(daemons, cpu0, strict=True) if d is not victim)
            behind = lag(survivors)
            stored = (stream_messages(cluster.url) - stored0) / wall
            rss = max(d.rss_mb() for d in survivors)
        finally:
            for proc in workers:
                proc.kill()
                proc.wait()
            for daemon in daemons:
                daemon.close()
        lost, doubled, what = asyncio.run(read_back(cluster.url, faults))
    finally:
        cluster.stop()
    served = sorted(f.commanded - f.sent for f in faults if f.commanded is not None and not f.held)
    for which, among in (("slowest", faults), ("slowest not held", [f for f in faults if not f.held])):
        slowest = sorted((f for f in among if f.commanded is not None), key=lambda f: f.sent - f.commanded)[:5]
        note(f"{which}: " + "; ".join(f"{f.job} (partition {f.partition}, {f.sent - t0:.1f} s into the window): "
                                      f"{(f.commanded or 0) - f.sent:.2f} s" for f in slowest))
    held = [f for f in faults if f.held]
    note(f"fleet of {jobs * NODES_PER_JOB * RPN:,} GPUs in {jobs:,} jobs, {partitions} partitions over 3 daemons "
         f"and 3 nats-servers: {len(faults)} faults, {len(held)} of them held up by the failover of partitions "
         f"{lost_parts}; {what}")
    emit(BENCH, "fleet_gpus", jobs * NODES_PER_JOB * RPN, "GPUs")
    emit(BENCH, "fleet_jobs", jobs, "jobs")
    emit(BENCH, "fleet_inputs_per_s", round(stored, 1), "messages the log stored a second over the window")
    emit(BENCH, "fleet_lag_at_end", behind, "inputs the partitions had not applied when the window ended (a node's "
         "event counts once per partition: every partition reads it)")
    emit(BENCH, "fleet_daemon_cpu_cores", round(cpu / wall, 3), "cores (the survivors' CPU s / wall s)")
    emit(BENCH, "fleet_rss_mb_max", round(rss, 1), "MB (the largest daemon)")
    if served:
        emit(BENCH, "fleet_fault_to_command_p50_ms", round(statistics.median(served) * 1000, 2), "ms")
        emit(BENCH, "fleet_fault_to_command_p99_ms",
             round(served[min(len(served) - 1, int(0.99 * len(served)))] * 1000, 2), f"ms ({len(served)} faults)")
    emit(BENCH, "fleet_failover_held_faults", len(held), "faults struck in a partition being failed over, or while "
         "the log's leading server was lost")
    emit(BENCH, "fleet_lease_ttl_s", ttl, "s")
    emit(BENCH, "fleet_snapshot_every_s", args.fleet_snapshot_s, "s (a takeover replays up to this much log)")
    emit(BENCH, "fleet_failover_s", round(failover_s, 3), f"s (goal: lease TTL + 2 = {ttl + 2:g} s or less)")
    emit(BENCH, "fleet_server_failover_s", round(server_failover_s, 3), "s from the log's leading server's SIGKILL "
         "until every partition was current again")
    emit(BENCH, "fleet_lost", lost, "faults (goal 0)")
    emit(BENCH, "fleet_doubled", doubled, "decisions, attempts or commands (goal 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-gpus", type=int, default=0, help="GPUs of the fleet, in jobs of 25 nodes x 8 "
                        "(default 200,000; --quick 20,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions the three daemons share")
    parser.add_argument("--lease-ttl-s", type=float, default=5.0, help="the daemons' lease TTL")
    parser.add_argument("--fleet-snapshot-s", type=float, default=20.0, help="the daemons' snapshot_every_s: a "
                        "takeover replays up to this much of the log after the TTL")
    parser.add_argument("--fleet-report-s", type=float, default=1.0, help="each node's report period")
    parser.add_argument("--fleet-fault-every-s", type=float, default=0.25, help="the pace of the faults")
    parser.add_argument("--fleet-steady-s", type=float, default=20.0, help="the window before the faults in which "
                        "the log's steady rate is measured (fleet_steady_log_per_s)")
    parser.add_argument("--fleet-settle-s", type=float, default=180.0, help="how long the window waits at most "
                        "for the partitions to apply the fleet's first words")
    parser.add_argument("--fleet-liveness", choices=("log", "live"), default="live", help="the agents' liveness")
    parser.add_argument("--fleet-progress", choices=("log", "summary"), default="summary",
                        help="where the agents' periodic reports go")
    parser.add_argument("--fleet-server-down-s", type=float, default=5.0,
                        help="how long the killed nats-server stays down")

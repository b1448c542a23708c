"""The fleet bench's simulated agents: one process (`python tools/bench_fleet_agents.py '<spec json>'`) plays the
`recovery-agent` of every node of a slice of the fleet, over real NATS, never inside a daemon's process.

For each of its nodes it does what the agent does: it folds the node's 8 ranks' heartbeats and steps into one
`progress.report` per `report_s` (the engine also takes a report for the agent's sign of life, so a `node.heartbeat`
goes only in a period without one) and, as the agent's outbox, sends again what JetStream did not acknowledge, it acks
the commands addressed to the node, and its ranks report in the newest
generation a command of their job names. The bench strikes a fault by asking on `bench.fleet.fault.<node>` (core
NATS, the bench's own control subject): the agent publishes that rank's `process.exited` through JetStream and,
once it is stored, answers with the monotonic time it was sent and the job's generation then.

The spec: `{"url": ..., "jobs": [[job, its first node, the first node here, nodes here], ...], "report_s": s,
"step_s": s, "seconds": s, "acked": bool, "idle": [first node, nodes], "liveness": "log" | "live",
"progress": "log" | "summary"}` (`acked` false:
reports and heartbeats fire and forget, for one healthy server, where nothing is lost and the acknowledgements would
only load the two cores the daemon is measured on; `idle`: nodes of no job, spares or between jobs, which only say
they live, every `report_s`; `liveness` as the agent's setting: `log`, a `node.heartbeat` in the log in each period
without a report, `live`, the mode stated once in the log and a beat on core NATS every period), nodes as indices:
node names are global (`f00000` ...), and a job's ranks are numbered from 0 on its own first node (a process may
play a slice of a job).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import nats
import orjson
from bench_harness_fleet import CONTROL, RPN, node_name

from events import subjects
from recovery.log import MSG_ID
from recovery.log.jetstream import publish_with_retry


@dataclass
class SimJob:
    name: str
    generation: int = 0
    dead: set[int] = field(default_factory=set)


def envelope(type_: str, data: dict[str, Any], ident: str, node: str, job: str | None) -> bytes:
    # The wire's JSON as an agent writes it, without a model per message: thousands a second per process.
    head: dict[str, Any] = {"id": ident, "type": type_, "source": "bench-agent", "node": node}
    if job is not None:
        head["job"] = job
    return orjson.dumps({**head, "data": data})


async def agents(spec: dict[str, Any]) -> None:
    """The nodes of `spec["jobs"]` for `spec["seconds"]`: reports, heartbeats, acks and the faults asked for."""
    nc = await nats.connect(spec["url"].split(","), max_reconnect_attempts=-1, pending_size=256 * 1024 * 1024)
    js = nc.jetstream(timeout=30)
    report_s, step_s, seconds = float(spec["report_s"]), float(spec["step_s"]), float(spec["seconds"])
    acked = bool(spec.get("acked", True))
    live = spec.get("liveness", "log") == "live"
    summary = spec.get("progress", "log") == "summary"  # the periodic reports to the daemon, on core NATS
    idle_first, idle_count = spec.get("idle", (0, 0))
    idle = [node_name(i) for i in range(idle_first, idle_first + idle_count)]
    jobs: dict[str, SimJob] = {}
    nodes: dict[str, tuple[SimJob, int]] = {}  # node -> (its job, its index in the job)
    for name, job_first, first, count in spec["jobs"]:
        job = jobs.setdefault(name, SimJob(name))
        for index in range(first, first + count):
            nodes[node_name(index)] = (job, index - job_first)
    start = time.monotonic()

    async def on_command(msg: Any) -> None:
        node, job_id, kind = subjects.command_parts(msg.subject)
        job = jobs.get(job_id)
        if job is None:
            return
        command = orjson.loads(msg.data)
        # every node of the job learns the generation (its ranks rejoin in it), not only those the command names
        job.generation = max(job.generation, int(command.get("attempt", 0)))
        if node not in nodes:
            return
        if kind in ("restart_ranks", "migrate_ranks"):
            job.dead.difference_update(command["ranks"])  # started again, in the command's generation
        elif kind == "restart_job":
            job.dead.clear()
        ident = f"{command['id']}@{node}:done"
        ack = {"command_id": command["id"], "status": "done", "reason": "", "result": {"node": node}}
        # as the agent's outbox: kept and sent again through an outage of its server
        await publish_with_retry(js, subjects.job_event(job_id, "command.ack"),
                                 envelope("command.ack", ack, ident, node, job_id), headers={MSG_ID: ident},
                                 retry_for=60)

    async def on_fault(msg: Any) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        job, _ = nodes[node]
        rank = int(msg.data)
        job.dead.add(rank)
        data = {"rank": rank, "exit_code": 1, "attempt": job.generation}
        ident = f"{job.name}-exit-{rank}-{time.monotonic_ns()}"
        sent = time.monotonic()
        generation = job.generation
        ack = await publish_with_retry(js, subjects.job_event(job.name, "process.exited"),
                                       envelope("process.exited", data, ident, node, job.name),
                                       headers={MSG_ID: ident}, retry_for=60)
        await msg.respond(orjson.dumps({"sent": sent, "generation": generation, "id": ident, "seq": ack.seq}))

    await nc.subscribe(subjects.COMMANDS, cb=on_command)
    for node in nodes:
        await nc.subscribe(f"{CONTROL}.fault.{node}", cb=on_fault)
    await nc.flush()
    tick = 0
    told: dict[str, int] = {}  # node -> the generation its ranks' first report in went into the log
    slot = report_s / max(1, len(nodes))  # agents tick on their own clocks: spread the nodes' reports over the period
    while (now := time.monotonic()) - start < seconds:
        step = int((now - start) / step_s) + 1
        # As the agent's outbox: each event acknowledged by JetStream, and sent again (same id) when it was not, in
        # order per node (a period's unacknowledged ones go again before the node's next). Acknowledged in bulk: a
        # process plays thousands of agents.
        sent: list[tuple[str, bytes, str, asyncio.Future[Any]]] = []

        async def send(subject: str, data: bytes, ident: str,
                       sent: list[tuple[str, bytes, str, asyncio.Future[Any]]] = sent) -> None:
            if not acked:  # fire and forget: a healthy single server loses nothing, and costs half as much
                await nc.publish(subject, data, headers={MSG_ID: ident})
                return
            future = await js.publish_async(subject, data, headers={MSG_ID: ident}, wait_stall=60)
            sent.append((subject, data, ident, future))

        async def alive(node: str, tick: int, reported: bool, send: Any = send) -> None:
            """As the agent's `_beat`: logged in a period without a report, or live (the mode logged once)."""
            if live:
                await nc.publish(subjects.live(node), b"")
            if tick == 0 or (not live and not reported):  # a period it reported in needs no heartbeat besides
                ident = f"{node}-h{tick}"
                data = {"interval_s": report_s, "live_s": report_s} if live else {}
                await send(subjects.node_event(node, "node.heartbeat"),
                           envelope("node.heartbeat", data, ident, node, None), ident)

        for n, (node, (job, index)) in enumerate(nodes.items()):
            if n % 64 == 0:
                due = start + tick * report_s + n * slot - time.monotonic()
                if due > 0:
                    await asyncio.sleep(due)  # this node's place in the period
            ranks = [{"rank": r, "step": step, "attempt": job.generation}
                     for r in range(index * RPN, (index + 1) * RPN) if r not in job.dead]
            ident = f"{node}-r{tick}"
            report = envelope("progress.report", {"ranks": ranks}, ident, node, job.name)
            if summary and told.get(node) == job.generation and ranks:
                # a period's report; a generation's first (its ranks' first word there) is news, into the log
                await nc.publish(subjects.reports(node), report)
                await alive(node, tick, reported=False)
                continue
            await send(subjects.job_event(job.name, "progress.report"), report, ident)
            told[node] = job.generation
            await alive(node, tick, reported=bool(ranks))
        for node in idle:
            await alive(node, tick, reported=False)
        await nc.flush(timeout=60)
        acks = await asyncio.gather(*(asyncio.wait_for(future, 5) for *_, future in sent), return_exceptions=True)
        for (subject, data, ident, _), ack in zip(sent, acks, strict=True):
            if isinstance(ack, BaseException):  # lost in a server's outage or a leader's election: again
                await publish_with_retry(js, subject, data, headers={MSG_ID: ident}, retry_for=60)
        tick += 1
        delay = start + tick * report_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the reporting period
    await nc.close()


if __name__ == "__main__":
    asyncio.run(agents(orjson.loads(sys.argv[1])))

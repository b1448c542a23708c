"""The on-call engineer's tools on a partitioned control plane: two daemons sharing four partitions (real nats-server,
real daemon processes), six jobs spread over every partition, faults in two of them and a node fault that crosses
partitions. `recovery-ctl` reaches each job's partition and merges the fleet-wide queries; the postmortem commands
read the exported partitioned log as they read a log of one partition; a partition whose daemon is gone (frozen,
then killed) is named rather than waited for.

Timers are off, so that the live states stay put between the answers of the daemons and the export.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from events.subjects import partition_of
from events.values import JobSpec
from recovery.cli.ctl import EXIT_NO_DAEMON, EXIT_PARTIAL, request
from recovery.cli.ctl_routes import merge, targets
from recovery.service.control import partition_subject
from recovery.testing.nats import NatsServer
from tests.daemon_support import ROOT, DaemonProcess, async_wait_for
from tests.test_partitions import P, coverage, drain_partitions, owned

JOBS = [f"job{i}" for i in range(6)]  # partitions 0, 3, 2, 1, 0, 3 of 4: every partition holds a job
TTL_S = 30.0
"""long: a daemon frozen or killed keeps its partitions for the whole test, so that they are seen unanswered"""


@dataclass
class Plane:
    server: NatsServer
    daemons: list[DaemonProcess]
    log: Path

    @property
    def url(self) -> str:
        return self.server.url


def spec(nodes: list[str]) -> dict[str, Any]:
    return JobSpec.model_validate({"nodes": nodes, "ranks_per_node": 2, "layout": {"dp": len(nodes) * 2}}
                                  ).model_dump(mode="json")


def ctl(plane: Plane, verb: str, **body: Any) -> dict[str, Any]:
    return asyncio.run(request(plane.url, verb, body, timeout=20))


def cli(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, check=False)


def export(plane: Plane) -> Path:
    """The whole log, once every partition has applied every input."""
    asyncio.run(drain_partitions(plane.url, plane.daemons))
    done = cli("recovery.cli.replay", "export", "--nats", plane.url, "-o", str(plane.log))
    assert done.returncode == 0, done.stderr
    return plane.log


def test_a_jobs_request_goes_to_its_partition_and_a_fleet_query_to_every_one() -> None:
    assert targets("pause", {"job": "job1"}, P) == [partition_of("job1", P)] == [3]
    assert targets("inject", {"type": "device.fault", "node": "n3"}, P) == [partition_of("n3", P)]
    assert targets("jobs", {}, P) == targets("status", {}, P) == targets("incidents", {"all": True}, P) == [0, 1, 2, 3]
    merged = merge("jobs", P, {0: {"jobs": [{"job": "b"}]}, 2: {"jobs": [{"job": "a"}, {"job": "c"}]}},
                   {1: "none is subscribed", 3: "no answer within 5s"})
    assert merged["jobs"] == [{"job": "a", "partition": 2}, {"job": "b", "partition": 0}, {"job": "c", "partition": 2}]
    assert merged["answered"] == [0, 2] and [m["partition"] for m in merged["missing"]] == [1, 3]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("parttools")
    server = NatsServer(tmp / "nats")
    server.start()
    daemons = [DaemonProcess(tmp / name, server.url, instance=f"daemon-{name}", partitions=P, lease_ttl_s=TTL_S,
                             timers_enabled=False) for name in "ab"]
    try:
        for daemon in daemons:
            daemon.start()
        asyncio.run(async_wait_for(lambda: coverage(daemons) == list(range(P)) and all(owned(d) for d in daemons),
                                   60, "two daemons to share the partitions"))
        plane = Plane(server, daemons, tmp / "log.jsonl")
        for i, job in enumerate(JOBS):
            submitted = ctl(plane, "submit", job=job, spec=spec([f"n{2 * i}", f"n{2 * i + 1}"]), id=f"submit-{job}")
            assert submitted["ok"] and submitted["applied"], submitted
            assert ctl(plane, "inject", type="job.started", job=job)["decisions"][0]["state"] == "running"
        for job in ("job0", "job1"):
            failed = ctl(plane, "inject", type="process.exited", job=job, data={"rank": 1, "exit_code": 1})
            assert failed["decisions"][0]["kind"] == "fault.confirmed", failed
        # a device of n3 (job1's node) fails: partition 2 owns n3 and answers; job1's partition 3 reads it too
        crossing = ctl(plane, "inject", type="device.fault", node="n3",
                       data={"device": 0, "vendor": "nvidia", "code": "79"})
        assert crossing["ok"] and crossing["partition"] == partition_of("n3", P) != partition_of("job1", P)
        yield plane
    finally:
        for daemon in daemons:
            daemon.close()
        server.stop()


def test_ctl_routes_each_job_to_its_partition_and_merges_the_fleet(plane: Plane) -> None:
    started = time.monotonic()
    jobs = ctl(plane, "jobs")
    assert jobs["ok"] and jobs["partitions"] == P and jobs["answered"] == list(range(P)) and jobs["missing"] == []
    assert [(row["job"], row["partition"]) for row in jobs["jobs"]] == [(j, partition_of(j, P)) for j in JOBS]
    before = {row["job"]: row for row in jobs["jobs"]}
    assert {j for j, row in before.items() if row["state"] == "recovering"} == {"job0", "job1"}
    for job in JOBS:
        answer = ctl(plane, "job", job=job)
        assert answer["partition"] == partition_of(job, P) and answer["job"]["job"] == job
    incidents = ctl(plane, "incidents")
    assert sorted((row["job"], row["partition"]) for row in incidents["incidents"]) == [
        ("job0", partition_of("job0", P)), ("job1", partition_of("job1", P))]
    status = ctl(plane, "status")
    assert sorted(status["status"]) == [str(k) for k in range(P)]
    assert all(s["partition"] == f"default-{k}" and s["role"] == "active" for k, s in
               ((int(k), s) for k, s in status["status"].items()))

    # pause job5: its partition decides, and no other job changes
    paused = ctl(plane, "pause", job="job5", reason="maintenance")
    assert paused["ok"] and paused["partition"] == partition_of("job5", P)
    assert {d["job"] for d in paused["decisions"]} == {"job5"}
    after = {row["job"]: row for row in ctl(plane, "jobs")["jobs"]}
    assert after["job5"]["incident"] is not None and after["job5"] != before["job5"]
    assert {j: r for j, r in after.items() if j != "job5"} == {j: r for j, r in before.items() if j != "job5"}

    # another partition refuses a job that is not its own, naming the job's
    async def misrouted() -> dict[str, Any]:
        nc = await nats.connect(plane.url)
        try:
            wrong = (partition_of("job5", P) + 1) % P
            msg = await nc.request(partition_subject(wrong, "job"), orjson.dumps({"job": "job5"}), timeout=10)
            return dict(orjson.loads(msg.data))
        finally:
            await nc.close()

    refused = asyncio.run(misrouted())
    assert not refused["ok"] and f"belongs to partition {partition_of('job5', P)} of {P}" in refused["error"]
    # the CLI: the daemons say how many partitions there are; the table says where each job lives
    table = cli("recovery.cli.ctl", "--nats", plane.url, "jobs", "--wide")
    assert table.returncode == 0, table.stderr
    assert "partition" in table.stdout and all(job in table.stdout for job in JOBS)
    told = cli("recovery.cli.ctl", "--nats", plane.url, "--json", "partitions")
    assert told.returncode == 0 and orjson.loads(told.stdout)["partitions"] == P
    print(f"ctl checks took {time.monotonic() - started:.1f}s")

    async def latencies(verb: str, body: dict[str, Any], partitions: int | None) -> float:
        """The median of 20 requests, connection included (as one recovery-ctl run makes one), in ms."""
        took = []
        for _ in range(20):
            begun = time.perf_counter()
            assert (await request(plane.url, verb, body, timeout=20, partitions=partitions))["ok"]
            took.append((time.perf_counter() - begun) * 1000)
        return sorted(took)[len(took) // 2]

    for verb, body in (("jobs", {}), ("job", {"job": "job1"})):
        asked, given = (asyncio.run(latencies(verb, body, count)) for count in (None, P))
        print(f"recovery-ctl {verb} over {P} partitions: median {asked:.1f} ms asking the count, {given:.1f} ms "
              f"with --partitions {P}")


def test_the_postmortem_tools_read_the_exported_partitioned_log(plane: Plane) -> None:
    log = str(export(plane))
    live = {job: ctl(plane, "job", job=job)["job"] for job in JOBS}
    run = cli("recovery.cli.replay", "run", log, "--json")
    assert run.returncode == 0, run.stderr
    replayed = orjson.loads(run.stdout)
    assert replayed["partitions"] == P and sorted(replayed["jobs"]) == JOBS
    for job in JOBS:
        state = dict(replayed["jobs"][job])
        assert state.pop("partition") == partition_of(job, P)
        assert state == live[job], f"{job}: the replay's state is not the live daemon's"
    kinds = [d["kind"] for d in replayed["decisions"]]
    assert kinds.count("job.accepted") == len(JOBS) and kinds.count("fault.confirmed") == 2
    text = cli("recovery.cli.replay", "run", log)
    assert text.returncode == 0 and f"in {P} partitions" in text.stdout and "note:" not in text.stdout, text.stdout
    assert f"job job1 (partition {partition_of('job1', P)}): recovering" in text.stdout

    timeline = cli("recovery.cli.replay", "timeline", log, "--job", "job1", "--json")
    rows = orjson.loads(timeline.stdout)
    whats = [row["what"] for row in rows]
    assert "process.exited" in whats and "decision fault.confirmed" in whats, whats
    assert "device.fault" in whats  # node n3's event, stored once, read by job1's partition
    live_rows = cli("recovery.cli.replay", "timeline", "--nats", plane.url, "--job", "job1", "--json")
    assert orjson.loads(live_rows.stdout) == rows

    report = orjson.loads(cli("recovery.cli.replay", "report", log, "--json").stdout)
    assert report["summary"]["jobs"] == len(JOBS)
    assert report["summary"]["incidents"] == 3  # job0's and job1's faults, and job5's pause
    live_report = orjson.loads(cli("recovery.cli.replay", "report", "--nats", plane.url, "--job", "job1",
                                   "--json").stdout)
    assert [job["job"] for job in live_report["jobs"]] == ["job1"] and len(live_report["jobs"][0]["incidents"]) == 1

    whatif = cli("recovery.cli.replay", "whatif", log, "--job", "job1", "--json",
                 "--policy", "rescheduling=torchelastic-like-rescheduling")
    answer = orjson.loads(whatif.stdout)
    assert whatif.returncode == 0 and answer["job"] == "job1", whatif.stderr
    assert answer["cluster"]["partition"] == {"index": partition_of("job1", P), "count": P}
    assert answer["inputs"]["kept"]["process.exited"] == 1  # job1's fault, found under its partition's subjects

    same = cli("recovery.cli.replay", "diff", log, log, "--json")
    assert same.returncode == 0 and orjson.loads(same.stdout)["same"], same.stdout[-2000:]
    verified = cli("recovery.cli.replay", "verify", "--nats", plane.url, "--json")
    answer = orjson.loads(verified.stdout)
    assert verified.returncode == 0 and answer["ok"] and all(r["exact"] for r in answer["results"]), answer
    # an incident's export (`export --job`): its job's partition is verified, and its timeline is the job's
    incident = plane.log.with_name("job1.jsonl")
    exported = cli("recovery.cli.replay", "export", "--nats", plane.url, "--job", "job1", "-o", str(incident))
    assert exported.returncode == 0, exported.stderr
    verified = cli("recovery.cli.replay", "verify", str(incident), "--json")
    answer = orjson.loads(verified.stdout)
    assert verified.returncode == 0 and [r["partition"] for r in answer["results"]] == [partition_of("job1", P)]
    assert orjson.loads(cli("recovery.cli.replay", "timeline", str(incident), "--job", "job1", "--json").stdout) == rows


def test_a_partition_whose_daemon_is_gone_is_named_not_waited_for(plane: Plane) -> None:
    victim = plane.daemons[1]
    gone = owned(victim)
    kept = [job for job in JOBS if partition_of(job, P) not in gone]
    assert gone and victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)  # frozen: subscribed, but it never answers
    try:
        started = time.monotonic()
        frozen = cli("recovery.cli.ctl", "--nats", plane.url, "--timeout", "3", "--json", "jobs")
        took = time.monotonic() - started
        assert frozen.returncode == EXIT_PARTIAL, frozen.stderr
        answer = orjson.loads(frozen.stdout)
        assert [m["partition"] for m in answer["missing"]] == gone and [row["job"] for row in answer["jobs"]] == kept
        assert all(m["why"] == "no answer within 3s" for m in answer["missing"])
        assert took < 3 + 10, f"took {took:.1f}s"  # the timeout and a start-up, not a hang
        assert f"partition(s) {gone[0]} (no answer within 3s)" in frozen.stderr
    finally:
        victim.kill()  # SIGKILL ends a stopped process too
    killed = cli("recovery.cli.ctl", "--nats", plane.url, "--json", "jobs")
    assert killed.returncode == EXIT_PARTIAL
    assert [m["why"] for m in orjson.loads(killed.stdout)["missing"]] == ["none is subscribed"] * len(gone)
    lost = next(job for job in JOBS if partition_of(job, P) in gone)
    refused = cli("recovery.cli.ctl", "--nats", plane.url, "job", lost)
    assert refused.returncode == EXIT_NO_DAEMON
    assert f"partition {partition_of(lost, P)} of {P}: no daemon serves it now" in refused.stderr

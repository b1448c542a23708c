"""A stock torchrun script (`examples/ddp-tutorial/stock.py`: DDP, a DistributedSampler, `init_process_group("gloo")`
from env://, rank 0's snapshot every epoch; nothing of `recovery` in it) run unmodified under `recovery-run`, on
this host (`--standalone`) and on a cluster's daemon (`--nats-url`, two agents of one rank each, the job store off
the agents): it completes with the parameters of a run without faults, bit for bit, and a rank SIGKILLed mid-run
makes the job restart whole from the script's own snapshot, each formation on a fresh torch store, and still end
with those parameters. World size 2: gloo's sum of two gradients is the same whichever order DDP's buckets take."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess
from tests.e2e_support import (
    AgentProcess,
    JobWatch,
    RendezvousProcess,
    connect,
    environment,
    kill_leftovers,
    wait_until,
    watch,
)

ROOT = Path(__file__).resolve().parents[1]
STOCK = ROOT / "examples" / "ddp-tutorial" / "stock.py"
DOC = ROOT / "docs" / "recovery-run.md"
EPOCHS = 6
STEP_TIME_S = 0.15
RUN_TIMEOUT_S = 180


@dataclass
class Cluster:
    nats: NatsServer
    daemon: DaemonProcess
    store: RendezvousProcess
    agents: list[AgentProcess]
    workdir: Path

    def explain(self) -> str:
        return "\n".join(f"--- agent {a.node}:\n{a.log_tail()}" for a in self.agents) + \
            f"\n--- daemon:\n{self.daemon.log_tail()}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("stock")
    server = NatsServer(workdir / "nats")
    server.start()
    daemon = DaemonProcess(workdir / "daemon", server.url, lease_ttl_s=0, snapshot_fork=False)
    store = RendezvousProcess(workdir / "rendezvous")
    agents: list[AgentProcess] = []
    state = Cluster(server, daemon, store, agents, workdir)
    try:
        daemon.start(PYTHONPATH=str(ROOT))
        daemon.wait_ready()
        store.wait_ready()

        async def start_agents() -> None:
            nc = await connect(server.url)
            ready: set[str] = set()

            async def on_node(msg: Any) -> None:
                ready.add(msg.subject.split(".")[3])

            await nc.subscribe("recovery.ev.node.>", cb=on_node)
            agents.extend(AgentProcess(workdir, node, server.url) for node in ("n0", "n1"))
            # a spare for the node-loss case, which runs last (it kills n1's agent for good)
            agents.append(AgentProcess(workdir, "spare0", server.url, spare=True))
            await wait_until(lambda: ready >= {"n0", "n1", "spare0"}, 30, "the agents to report their nodes",
                             state.explain)
            await nc.close()

        asyncio.run(start_agents())
        yield state
    finally:
        for agent in agents:
            agent.stop()
        store.stop()
        daemon.close()
        server.stop()


def recovery_run(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    out = (cwd / "recovery-run.out").open("ab")
    return subprocess.Popen([sys.executable, "-m", "recovery.cli.run", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=subprocess.STDOUT, env=environment(), start_new_session=True)


def finish(proc: subprocess.Popen[bytes], cwd: Path, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # recovery-run stops what it started
        proc.wait(timeout=60)
        raise
    return code, (cwd / "recovery-run.out").read_text(errors="replace")


def cluster_args(cluster: Cluster, job: str, out: Path, snapshot: Path) -> list[str]:
    """A run of the stock script on the cluster's two agents, one rank each, as the reference's world. Each rank
    computes on one intra-op thread, as the reference's two ranks sharing a node do (`one_thread_each`): a CPU
    product split over two threads may end in other bits than on one, and a math library that shares its work out
    among threads may differ from run to run (MKL documents it, outside its reproducibility mode)."""
    return ["--nats-url", cluster.nats.url, "--nodes", "n0,n1", "--nproc-per-node", "1", "--max-restarts", "5",
            "--env", "OMP_NUM_THREADS=1",
            "--rdzv-endpoint", f"127.0.0.1:{cluster.store.port}", "--rdzv-id", job, str(STOCK), "--epochs",
            str(EPOCHS), "--step-time", str(STEP_TIME_S), "--snapshot", str(snapshot), "--out", str(out)]


def params(path: Path) -> dict[str, Any]:
    import torch

    loaded: dict[str, Any] = torch.load(path)
    return loaded


def assert_bitwise_equal(found: dict[str, Any], reference: dict[str, Any]) -> None:
    import torch

    assert found.keys() == reference.keys()
    for name in found:
        assert torch.equal(found[name], reference[name]), f"{name} differs from the run without faults"


def rank_logs(cluster: Cluster, job: str) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in sorted(cluster.workdir.glob(f"n*/{job}.rank*.gen*.log"))}


@dataclass
class Standalone:
    """The documented `recovery-run --standalone` run of the stock script, nothing going wrong."""

    code: int
    output: str
    data: Path
    params: dict[str, Any]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Standalone:
    """docs/recovery-run.md's first standalone command, run once: what it must do is the test's own to judge below,
    and its parameters are every stock-script case's reference (`fault_free`)."""
    cwd = tmp_path_factory.mktemp("standalone")
    command = documented_standalone_command()
    assert command[:2] == ["recovery-run", "--standalone"] and "--nproc-per-node" in command
    args = [str(ROOT / a) if a.startswith("examples/") else a for a in command[1:]]
    data = cwd / "data"
    code, output = finish(recovery_run(["--data-dir", str(data), *args], cwd), cwd)
    final = cwd / "final.pt"
    return Standalone(code, output, data, params(final) if code == 0 and final.exists() else {})


@pytest.fixture(scope="module")
def fault_free(standalone: Standalone) -> dict[str, Any]:
    """The stock script's parameters after a run without faults: the reference of every recovered run. The same
    world, seed, data and thread settings as theirs (`cluster_args`), so the same bits on any processor."""
    assert standalone.code == 0 and standalone.params, standalone.output
    return standalone.params


ENV_DUMP = """
import json, os, sys
keep = [k for k in os.environ if k.startswith(("RANK", "LOCAL_", "WORLD", "GROUP_", "ROLE_", "MASTER_", "TORCH",
                                                "RECOVERY_STORE", "OMP_"))]
with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as out:
    json.dump({k: os.environ[k] for k in keep}, out)
"""


def test_the_ranks_get_torchruns_environment_and_a_torch_store_apart_from_the_job_store(
        cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "env_dump.py"
    script.write_text(ENV_DUMP)
    proc = recovery_run(["--nats-url", cluster.nats.url, "--nodes", "n0,n1", "--nproc_per_node", "1",
                         "--rdzv_endpoint", f"127.0.0.1:{cluster.store.port}", "--rdzv_id", "stock-env",
                         str(script), str(tmp_path / "env")], tmp_path)
    code, output = finish(proc, tmp_path)
    assert code == 0, output
    envs = [json.loads((tmp_path / f"env.{rank}.json").read_text()) for rank in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
        assert env["GROUP_RANK"] == str(rank) and env["GROUP_WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_RUN_ID"] == "stock-env"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert (env["RECOVERY_STORE_ADDR"], env["RECOVERY_STORE_PORT"]) == ("127.0.0.1", str(cluster.store.port))
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != str(cluster.store.port)
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]  # both agents were given the same torch store


def documented_standalone_command() -> list[str]:
    """The first `recovery-run --standalone` command of docs/recovery-run.md."""
    block = re.search(r"```(?:sh)?\n(recovery-run --standalone [^\n]*)\n```", DOC.read_text())
    assert block, "docs/recovery-run.md shows no standalone command"
    return shlex.split(block.group(1))


def test_the_documented_standalone_run_of_the_stock_script_completes_with_no_incident_and_its_log_replays(
        standalone: Standalone) -> None:
    output, data = standalone.output, standalone.data
    assert standalone.code == 0, output
    assert re.search(r"completed", output) and "[rank0]: [rank 0] Epoch 0" in output and "[rank1]:" in output
    assert standalone.params, "the run wrote no final parameters"
    # After the run nothing serves its log: the last line names the command that reads it from the data directory.
    last = output.strip().splitlines()[-1]
    assert last.endswith(f"postmortem: recovery-replay report {data}"), output
    assert (data / "daemon.log").read_text().strip(), "the daemon's log lines are in daemon.log"
    replay = [sys.executable, "-m", "recovery.cli.replay"]
    report = subprocess.run([*replay, "report", str(data), "--json"], capture_output=True, text=True, timeout=120,
                            env=environment(), check=False)
    assert report.returncode == 0, report.stderr
    [job] = json.loads(report.stdout)["jobs"]
    # an incident in a fault-free run says what the daemon saw (its detection under a busy host, or a real fault)
    assert job["state"] == "completed" and not job["incidents"], json.dumps(job["incidents"], indent=1)[:4000]
    assert not json.loads(report.stdout)["never_ran"]
    verify = subprocess.run([*replay, "verify", str(data)], capture_output=True, text=True, timeout=120,
                            env=environment(), check=False)
    assert verify.returncode == 0 and verify.stdout.startswith("ok:"), verify.stdout + verify.stderr


@dataclass
class Killed:
    """A run on the cluster whose rank 1 was SIGKILLed in its third epoch: how it ended, and what was seen."""

    code: int
    output: str
    watch: JobWatch
    steps: list[int]  # the steps the ranks had printed at the kill
    regained_s: float  # from the kill until a process of a later formation trained past them


async def kill_rank_1_at_epoch_2(cluster: Cluster, job: str, spec: dict[str, Any], tmp_path: Path,
                                 script: Path = STOCK) -> Killed:
    nc = await connect(cluster.nats.url)
    w: JobWatch = await watch(nc, job)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    args = cluster_args(cluster, job, tmp_path / "final.pt", tmp_path / "snap.pt")
    args[args.index(str(STOCK))] = str(script)
    proc = recovery_run(["--spec", str(tmp_path / "spec.json"), *args], tmp_path)
    victim = cluster.workdir / "n1" / f"{job}.rank1.json"
    try:
        def at_epoch_2() -> bool:
            return any("Epoch 2 | Batchsize" in text for text in rank_logs(cluster, job).values())

        await wait_until(at_epoch_2, RUN_TIMEOUT_S, "the job to reach its third epoch", cluster.explain)
        steps = [int(s) for text in rank_logs(cluster, job).values() for s in re.findall(r"\] step (\d+)", text)]
        killed = time.monotonic()
        os.kill(json.loads(victim.read_text())["pid"], signal.SIGKILL)

        def regained() -> bool:
            # a process of a later formation trained past the step the job was on
            return any(".gen0." not in p.name and any(int(s) > max(steps) for s in re.findall(r"\] step (\d+)", t))
                       for p, t in rank_logs(cluster, job).items())

        await wait_until(regained, RUN_TIMEOUT_S, "the job to train past the step it was on", cluster.explain)
        regained_s = time.monotonic() - killed
        code, output = await asyncio.to_thread(finish, proc, tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # recovery-run cancels the job and stops
            proc.wait(timeout=90)
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()
    return Killed(code, output, w, steps, regained_s)


async def test_a_sigkilled_rank_restarts_the_job_from_the_scripts_own_snapshot_and_ends_as_the_fault_free_run(
        cluster: Cluster, fault_free: dict[str, Any], tmp_path: Path) -> None:
    job = "stock-kill"
    # Watchdog thresholds a stock script would trip within a second if its lack of heartbeats counted, and a grace
    # period longer than the run: the incident closes at the first optimizer step the step hook counts.
    run = await kill_rank_1_at_epoch_2(cluster, job, {"watchdog_interval_s": 0.5, "policies": {
        "detection": {"name": "default", "params": {"hang_min_silence_s": 1, "stall_min_s": 1, "first_steps_s": 1}},
        "rescheduling": {"name": "ladder", "params": {"running_grace_s": 600}}}}, tmp_path)
    code, output, w, steps, regained_s = run.code, run.output, run.watch, run.steps, run.regained_s
    assert code == 0, f"{output}\n{cluster.explain()}"
    granularities = [d["data"]["detail"].get("granularity") for d in w.decided("attempt.started")]
    # the one fault is the kill: the script's silence is none, and one job-level restart recovers it
    [fault] = w.decided("fault.confirmed")
    assert fault["data"]["reason"].startswith("rank 1: SIGKILL"), fault
    assert granularities == ["restart_job"]
    [closed] = w.decided("incident.closed")
    assert "optimizer step(s) counted in the restarted processes" in closed["data"]["reason"], closed
    assert closed["data"]["detail"]["lost_steps"] is None  # counted steps name no resume point
    last = max(e["data"]["attempt"] for e in w.of("process.started"))
    # the job restarted whole: every rank of the last generation is a new process (whatever rung the engine chose:
    # restart_job, or restarts in place that ended up restarting every rank), each on the fresh torch store
    assert sorted(e["data"]["rank"] for e in w.of("process.started") if e["data"]["attempt"] == last) == [0, 1]
    resumed = [p for p, text in rank_logs(cluster, job).items()
               if p.name.endswith(f".gen{last}.log") and "Resuming training from snapshot at Epoch 2" in text]
    assert len(resumed) == 2, rank_logs(cluster, job).keys()  # both ranks of the job-level restart loaded it
    assert_bitwise_equal(params(tmp_path / "final.pt"), fault_free)
    # What recovery-run and the report say of it is measured: the restart to a restarted rank's first optimizer step
    # (the step hook counts them; the script reports none), never its first output nor a grace; no dying checkpoint
    # was possible.
    assert [e for e in w.of("process.output") if e["data"]["attempt"] == last], "the restarted ranks' first output"
    assert output.count("running again") == 1 and "first optimizer step" in output, output
    assert "recovered in" not in output, output
    assert "checkpoint.dying_failed" not in output and "step 0" not in output, output
    assert output.strip().splitlines()[-1].endswith(f"postmortem: recovery-replay report --nats {cluster.nats.url} "
                                                    f"--job {job}"), output
    report = subprocess.run([sys.executable, "-m", "recovery.cli.replay", "report", "--nats", cluster.nats.url,
                             "--job", job, "--json"], capture_output=True, text=True, timeout=120, env=environment(),
                            check=False)
    assert report.returncode == 0, report.stderr
    [incident] = json.loads(report.stdout)["jobs"][0]["incidents"]
    assert incident["ttr_basis"].startswith("first optimizer step of a restarted process"), incident["ttr_basis"]
    assert incident["checkpoint"]["source"] == "the script's own" and incident["ttr_s"] < regained_s + 5
    print(f"stock script, SIGKILL of rank 1: trained past step {max(steps)} again {regained_s:.2f}s later "
          f"(report: running again {incident['ttr_s']:.2f}s after its first signal); attempts {granularities}")


def with_step_reports(path: Path) -> Path:
    """The stock script with the SDK's step reports added (`report_step` after every step), nothing else: the
    partial use the docs show first."""
    text = STOCK.read_text()
    printed = 'print(f"[rank {self.rank}] step {epoch * steps + index + 1}", flush=True)'
    assert printed in text and "import torch\n" in text
    sdk = "import recovery.client as recovery\nimport torch\n\nCLIENT = recovery.connect()\n"
    text = text.replace("import torch\n", sdk, 1)
    text = text.replace(printed, f"{printed}\n            CLIENT.report_step(epoch * steps + index + 1)")
    path.write_text(text)
    return path


async def test_step_reports_alone_recover_a_killed_rank_as_the_stock_script_does(
        cluster: Cluster, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """Reporting steps says nothing of whether the survivors can take a restarted peer: the job restarts whole, as
    the script without them does, and no dying checkpoint is asked of a script that registered no save."""
    run = await kill_rank_1_at_epoch_2(cluster, "stock-steps", {"policies": {
        "rescheduling": {"name": "ladder", "params": {"running_grace_s": 2}}}}, tmp_path,
        with_step_reports(tmp_path / "stock_with_steps.py"))
    w = run.watch
    assert run.code == 0, f"{run.output}\n{cluster.explain()}"
    announced = {tuple(e["data"]["caps"]) for e in w.of("process.capabilities")}
    assert announced == {("steps",)}, announced  # what the script wired up, as the SDK said it
    [fault] = w.decided("fault.confirmed")
    assert fault["data"]["reason"].startswith("rank 1: SIGKILL"), fault
    assert [d["data"]["detail"].get("granularity") for d in w.decided("attempt.started")] == ["restart_job"]
    asked = [k for k in w.kinds() if k.startswith("checkpoint.") and k != "checkpoint.plan"]
    assert not asked, asked  # no dying checkpoint asked, none awaited, none failed
    assert_bitwise_equal(params(tmp_path / "final.pt"), fault_free)
    print(f"stock script with step reports, SIGKILL of rank 1: trained past step {max(run.steps)} again "
          f"{run.regained_s:.2f}s later")


SAVES_ON_THE_WAY_OUT = """
import os, signal, sys, time
rank = os.environ["RANK"]


def on_term(signum, frame):
    raise KeyboardInterrupt  # as a framework turns SIGTERM into the path its checkpoint on an exception takes


signal.signal(signal.SIGTERM, on_term)
print(f"[rank {rank}] training", flush=True)
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    time.sleep(1.0)  # writing a checkpoint takes a while
    with open(f"{sys.argv[1]}.{rank}", "w") as out:
        out.write("saved")
    print(f"[rank {rank}] saved on the way out", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_gives_the_ranks_the_signal_and_time_to_save_then_stops_every_process_it_started(
        tmp_path: Path, signum: signal.Signals) -> None:
    """As torchrun: Ctrl-C reaches the ranks as SIGINT (SIGTERM as SIGTERM), and they get the stop grace to end by
    themselves, so a script's own handler (Lightning's checkpoint on an interrupt) writes its checkpoint."""
    data = tmp_path / "data"
    script = tmp_path / "interruptible.py"
    script.write_text(SAVES_ON_THE_WAY_OUT)
    job = f"stock-{signum.name.lower()}"
    proc = recovery_run(["--standalone", "--nproc-per-node", "2", "--data-dir", str(data), "--rdzv-id", job,
                         "--stop-grace", "20", str(script), str(tmp_path / "checkpoint")], tmp_path)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while (tmp_path / "recovery-run.out").read_text(errors="replace").count("training") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "recovery-run.out").read_text()
            time.sleep(0.05)  # polling interval of a deadline-bounded wait
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)  # it stops nothing it started then: its data directory's pids are ended
        proc.wait(timeout=60)
        kill_started_under(data)
        raise
    proc.send_signal(signum)
    code, output = finish(proc, tmp_path, 90)
    assert code == 128 + signum, output
    assert f"cancelling {job}" in output and output.count(f"{job} cancelled") == 1, output  # the verdict once
    saved = sorted(p.name for p in tmp_path.glob("checkpoint.*"))
    assert saved == ["checkpoint.0", "checkpoint.1"], output
    left = started_under(data) + started_under(script)
    assert not left, f"processes left running: {left}"


def started_under(path: Path) -> list[int]:
    """The processes whose command line names `path`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def kill_started_under(path: Path) -> None:
    for pid in started_under(path):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


async def test_a_sigstopped_rank_of_the_stock_script_is_found_from_outside_and_the_job_restarts_and_completes(
        cluster: Cluster, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """No heartbeat tells of a stock script's hang: its agent sees the stopped process (state T) and reports it."""
    job = "stock-stop"
    nc = await connect(cluster.nats.url)
    w: JobWatch = await watch(nc, job)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"policies": {"rescheduling": {"name": "ladder", "params": {"running_grace_s": 2}}}}))
    proc = recovery_run(["--spec", str(spec), *cluster_args(cluster, job, tmp_path / "final.pt", tmp_path / "snap.pt")],
                        tmp_path)
    victim = cluster.workdir / "n1" / f"{job}.rank1.json"
    stopped_pid = None
    try:
        def at_epoch_2() -> bool:
            return any("Epoch 2 | Batchsize" in text for text in rank_logs(cluster, job).values())

        await wait_until(at_epoch_2, RUN_TIMEOUT_S, "the job to reach its third epoch", cluster.explain)
        stopped_pid = json.loads(victim.read_text())["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await wait_until(lambda: bool(w.decided("fault.confirmed")), 60 + 30, "the stopped rank to be found",
                         cluster.explain)  # 60 s is the promise; the rest is a busy host's slack
        found_s = w.decided("fault.confirmed")[0]["_seen"] - stopped
        code, output = await asyncio.to_thread(finish, proc, tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        if stopped_pid is not None:
            kill_leftovers([stopped_pid])
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()
    assert code == 0, f"{output}\n{cluster.explain()}"
    [fault] = w.decided("fault.confirmed")
    assert fault["data"]["reason"].startswith("rank 1 hangs: stopped (state T: SIGSTOP)"), fault
    assert [d["data"]["detail"].get("granularity") for d in w.decided("attempt.started")] == ["restart_job"]
    assert_bitwise_equal(params(tmp_path / "final.pt"), fault_free)
    print(f"stock script, SIGSTOP of rank 1: found {found_s:.1f}s later")


RAISES_IN_MAIN = """
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError("lr must be positive, got -0.1")


main()
"""


def test_a_script_failing_on_every_rank_before_its_first_step_fails_after_one_retry_quoting_its_error(
        cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "bad_lr.py"
    script.write_text(RAISES_IN_MAIN)
    started = time.monotonic()
    proc = recovery_run(["--nats-url", cluster.nats.url, "--nodes", "n0,n1", "--nproc-per-node", "1",
                         "--rdzv-endpoint", f"127.0.0.1:{cluster.store.port}", "--rdzv-id", "stock-bad-lr",
                         str(script)], tmp_path)
    code, output = finish(proc, tmp_path)
    took = time.monotonic() - started
    assert code == 1, output
    verdict, last = output.strip().splitlines()[-2:]
    assert last.endswith("postmortem: recovery-replay report --nats " + cluster.nats.url + " --job stock-bad-lr")
    assert "stock-bad-lr failed: deterministic error" in verdict, output
    assert "ValueError: lr must be positive, got -0.1 (bad_lr.py:7 in main)" in verdict, output
    logs = cluster.workdir.glob("n*/stock-bad-lr.rank*.log")
    generations = {int(p.name.split(".gen")[1].split(".")[0]) for p in logs}
    assert generations <= {0, 1}, f"at most one retry: {sorted(generations)}"
    # whichever rank raised first is the one whose error file exists: a peer stopped by the restart while still
    # importing torch never reaches `main`, so no one rank's file is certain on a busy host
    written = sorted(cluster.workdir.glob("n*/stock-bad-lr.rank*.gen*.error.json"))
    assert written, "@record wrote its error file"
    assert all("lr must be positive" in p.read_text() for p in written), [p.read_text() for p in written]
    print(f"a script raising before its first step: recovery-run failed it in {took:.1f}s")


async def test_a_lost_node_moves_the_job_to_the_spare_and_it_ends_as_the_fault_free_run(
        cluster: Cluster, fault_free: dict[str, Any], tmp_path: Path) -> None:
    """n1's agent and rank are SIGKILLed together (the host is gone): with gloo the survivor on n0 exits at once
    (`Connection reset by peer`), which opens a process-fault incident before n1's silence is seen. The job-level
    restart it starts must not wait for n1's agent: the agent's silence is found while the job recovers, and the job
    restarts whole on n0 and the spare from the script's own snapshot. Last in the module: n1 stays dead."""
    job = "stock-nodeloss"
    nc = await connect(cluster.nats.url)
    w: JobWatch = await watch(nc, job)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"watchdog_interval_s": 0.5, "spares": 1, "policies": {
        "rescheduling": {"name": "ladder", "params": {"running_grace_s": 2}}}}))
    args = cluster_args(cluster, job, tmp_path / "final.pt", tmp_path / "snap.pt")
    args[args.index("--max-restarts") + 1] = "3"  # as the run: the budget three unanswered stops used up
    proc = recovery_run(["--spec", str(spec), *args], tmp_path)
    n1 = next(a for a in cluster.agents if a.node == "n1")
    try:
        def at_epoch_2() -> bool:
            return any("Epoch 2 | Batchsize" in text for text in rank_logs(cluster, job).values())

        await wait_until(at_epoch_2, RUN_TIMEOUT_S, "the job to reach its third epoch", cluster.explain)
        rank1 = json.loads((cluster.workdir / "n1" / f"{job}.rank1.json").read_text())["pid"]
        killed = time.monotonic()
        n1.proc.kill()  # the agent first: no exit of the rank is reported
        os.killpg(rank1, signal.SIGKILL)

        def on_spare() -> bool:  # the spare's agent started a rank of the job
            return any((cluster.workdir / "spare0").glob(f"{job}.rank*.gen*.log"))

        await wait_until(on_spare, RUN_TIMEOUT_S, "the job to start on the spare", cluster.explain)
        on_spare_s = time.monotonic() - killed
        code, output = await asyncio.to_thread(finish, proc, tmp_path)
        completed_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # recovery-run cancels the job and stops
            proc.wait(timeout=60)
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()
    assert code == 0, f"{output}\n{cluster.explain()}"
    assert "job.failed" not in w.kinds() and not w.decided("attempt.timed_out"), w.kinds()
    # found when the survivors' exit began the incident: the daemon asked n1's agent, and nothing listened for it
    # (its silence past the bound is the way left when no probe is answered at all)
    reasons = [d["data"].get("reason", "") for d in w.decisions]
    assert any(r.startswith(("agent of n1 unreachable", "agent of n1 silent")) for r in reasons), reasons
    restarts = w.decided("ranks.rescheduling")
    assert restarts[-1]["data"]["detail"]["nodes"] == ["n0", "spare0"], restarts[-1]
    assert_bitwise_equal(params(tmp_path / "final.pt"), fault_free)
    print(f"stock script, n1's agent and rank killed: running on the spare {on_spare_s:.2f}s later, completed "
          f"{completed_s:.2f}s later; decisions {w.kinds()}")


LIGHTNING = ROOT / "examples" / "lightning" / "train.py"  # a stock Lightning Trainer script (strategy="ddp")


def test_ctrl_c_reaches_a_stock_lightning_script_and_its_exception_checkpoint_is_written(tmp_path: Path) -> None:
    """The stock script (`strategy="ddp"`, `OnExceptionCheckpoint`) under `recovery-run --standalone`: SIGINT to
    `recovery-run`, as a terminal's Ctrl-C sends it, gives every rank SIGINT and the grace to save."""
    checkpoints = tmp_path / "checkpoints"
    log = tmp_path / "recovery-run.out"
    args = [sys.executable, "-m", "recovery.cli.run", "--standalone", "--nproc-per-node", "2", "--data-dir",
            str(tmp_path / "data"), "--env", "OMP_NUM_THREADS=1", str(LIGHTNING), "--epochs", "50", "--samples",
            "256", "--step-time", "0.1", "--checkpoints", str(checkpoints)]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=environment(), start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "trained step 6" not in log.read_text(errors="replace"):  # training, past its first checkpoints
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)  # polling a file the run writes, within the deadline
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # it stops nothing it started then: end what runs under its data
            proc.wait(timeout=30)
        kill_started_under(tmp_path / "data")
    output = log.read_text(errors="replace")
    assert code == 128 + signal.SIGINT and "cancelled" in output, output[-4000:]
    assert (checkpoints / "on_exception.ckpt").exists(), output[-4000:]  # Lightning saved on the interrupt
    assert not started_under(tmp_path / "data") + started_under(checkpoints), "processes left running"

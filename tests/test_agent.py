"""The agent as a real process against a real nats-server, with a small training stand-in that uses the SDK (no
torch): it launches the ranks of its node, relays their reports, reports how each ended from its wait status, and
carries out its node's commands with acks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from events import subjects
from events.envelope import make_envelope
from recovery.agent.config import ConfigError, load
from recovery.agent.exits import ENDED_WITHOUT_A_WORD
from recovery.agent.ranks import RankProcess, in_session, start_time
from recovery.agent.reset import ResetFailed, reset_device
from recovery.log.jetstream import JetStreamLog, ensure_stream, stream_config
from recovery.testing.nats import NatsServer, free_port
from tests.e2e_support import (
    STAND_IN,
    AgentProcess,
    JobWatch,
    accept,
    connect,
    environment,
    kill_leftovers,
    node_heard,
    submit,
    wait_until,
    watch,
)


@pytest.fixture(autouse=True)
def no_job_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's ranks on a node other than its first (whose agent serves the job store) start after half a second's
    wait for the store, not the default minute: these tests run no agent of that node."""
    monkeypatch.setenv("RECOVERY_AGENT_STORE_WAIT_S", "0.5")


def test_a_bad_setting_is_named_with_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVERY_AGENT_HEARTBEAT_S", "-1")
    with pytest.raises(ConfigError, match=r"heartbeat_s.*environment variable RECOVERY_AGENT_HEARTBEAT_S"):
        load(node="n0")
    monkeypatch.delenv("RECOVERY_AGENT_HEARTBEAT_S")
    with pytest.raises(ConfigError, match="node: required"):
        load()
    with pytest.raises(ConfigError, match=r"node.*cannot be a subject token"):
        load(node="a.b")


async def test_following_a_stream_delivers_what_comes_after_it_started_on_one_subject(
        nats_server: NatsServer) -> None:
    log = await JetStreamLog.connect(nats_server.url)
    try:
        start = await log.last_seq() + 1
        got: list[str] = []

        async def follow() -> None:
            async for record in log.follow(start, "recovery.ev.node.n1.>"):
                got.append(record.subject)

        task = asyncio.create_task(follow())
        for node in ("n0", "n1", "n0", "n1"):
            envelope = make_envelope("node.ready", {}, id=f"{node}-{len(got)}-{os.urandom(4).hex()}", node=node)
            await log.append(subjects.node_event(node, "node.ready"), envelope)
        await wait_until(lambda: len(got) == 2, 10, "two records of n1")
        task.cancel()
        assert got == ["recovery.ev.node.n1.node.ready"] * 2
    finally:
        await log.close()


@pytest.fixture
async def streams(nats_server: NatsServer) -> AsyncIterator[NatsServer]:
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    await ensure_stream(js, stream_config())
    await ensure_stream(js, stream_config("RECOVERY_CMD", [subjects.COMMANDS]))
    await nc.close()
    yield nats_server


async def command(nc: Any, node: str, body: dict[str, Any]) -> None:
    await nc.jetstream().publish(subjects.command(node, body["job"], body["kind"]), orjson.dumps(body),
                                 headers={"Nats-Msg-Id": subjects.command_msg_id(body["id"], node)})


def acks(w: JobWatch, command_id: str) -> list[str]:
    return [e["data"]["status"] for e in w.of("command.ack") if e["data"]["command_id"] == command_id]


def stand_in_job(tmp_path: Path, nodes: list[str], ranks_per_node: int, dp: int) -> dict[str, Any]:
    """A job spec whose ranks run the SDK stand-in script."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return {"nodes": nodes, "ranks_per_node": ranks_per_node, "layout": {"dp": dp},
            "entrypoint": {"command": sys.executable, "args": [str(script)], "cwd": str(tmp_path),
                           "env": {"MASTER_PORT": str(free_port())}}}


async def test_the_agent_runs_its_ranks_relays_them_and_carries_out_its_commands(
        streams: NatsServer, tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path, "n1", streams.url)
    nc = await connect(streams.url)
    w = await watch(nc, "j")
    ready = await node_heard(nc, "recovery.ev.node.n1.>")
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        spec = stand_in_job(tmp_path, ["elsewhere", "n1"], 2, 4)
        await submit(nc, "j", spec, accepted=True)
        await wait_until(lambda: set(w.pids()) == {2, 3} and w.step(2) >= 3 and w.step(3) >= 3, 30,
                         "ranks 2 and 3 to run and report steps", agent.log_tail)
        # heartbeats and steps travel folded, one report per period, of only the agent's own ranks
        assert w.of("progress.report") and not [e for e in w.events if e["type"] == "progress.step"
                                                and not e.get("_folded")]
        assert {r["rank"] for e in w.of("progress.report") for r in e["data"]["ranks"]} == {2, 3}

        os.kill(w.pids()[2][0], signal.SIGKILL)
        await wait_until(lambda: bool(w.of("process.exited")), 10, "the exit of rank 2")
        assert w.of("process.exited")[0]["data"] == {"rank": 2, "exit_code": None, "signal": 9, "attempt": 0}

        plan = {"checkpoint_step": 3, "next_step": 4, "shards": [{"shard": 0, "tier": "peer", "holders": ["n1"]}]}
        await command(nc, "n1", {"id": "j:10:0", "job": "j", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [2], "plan": plan})
        await wait_until(lambda: acks(w, "j:10:0") == ["accepted", "done"], 30, "the restart's acks", agent.log_tail)
        started = w.of("process.started")[-1]["data"]
        assert (started["rank"], started["attempt"]) == (2, 1) and len(w.pids()[3]) == 1
        await wait_until(lambda: any(e["data"]["rank"] == 2 and e["data"]["attempt"] == 1
                                     for e in w.of("progress.step")), 30, "the restarted rank's first step")

        await command(nc, "n1", {"id": "j:11:0", "job": "j", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "stop_ranks", "ranks": [2, 3], "mode": "graceful", "grace_s": 10.0})
        await wait_until(lambda: acks(w, "j:11:0") == ["accepted", "done"], 30, "the stop's acks", agent.log_tail)
        exits = {e["data"]["rank"]: e["data"] for e in w.of("process.exited")[1:]}
        assert exits[2]["exit_code"] == 0 and exits[3]["exit_code"] == 0  # the SDK's stop: a clean end of step
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


SAVER = STAND_IN.replace("client = recovery.connect()\n", """client = recovery.connect()
import os
if os.environ["RANK"] == "3":
    def save(step):
        raise OSError(f"disk full at step {step}")
    client.on_save(save)
""")


async def test_a_dying_save_that_the_sdk_could_not_write_is_acked_failed_with_its_reason(
        streams: NatsServer, tmp_path: Path) -> None:
    """Rank 2 registered no save function, rank 3's raises: the SDK answers `save_failed` for both, and the command
    is acked failed with their reasons, never done (the engine would count a checkpoint that was never written)."""
    agent = AgentProcess(tmp_path, "n7", streams.url)
    nc = await connect(streams.url)
    w = await watch(nc, "saves")
    ready = await node_heard(nc, "recovery.ev.node.n7.>")
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        spec = stand_in_job(tmp_path, ["elsewhere", "n7"], 2, 4)
        (tmp_path / "stand_in.py").write_text(SAVER)
        await submit(nc, "saves", spec, accepted=True)
        await wait_until(lambda: w.step(2) >= 3 and w.step(3) >= 3, 30, "both ranks to report steps", agent.log_tail)
        await command(nc, "n7", {"id": "saves:9:0", "job": "saves", "attempt": 0, "deadline_s": 30.0,
                                 "kind": "save_checkpoint", "ranks": [2, 3], "step": 3})
        await wait_until(lambda: acks(w, "saves:9:0") == ["accepted", "failed"], 30, "the save's acks",
                         agent.log_tail)
        [ack] = [e["data"] for e in w.of("command.ack") if e["data"]["status"] == "failed"]
        assert "rank 2: no save function registered" in ack["reason"], ack
        assert "rank 3: OSError: disk full at step" in ack["reason"], ack
        assert ack["result"]["failed"] == [2, 3] and ack["result"]["saved"] == [], ack
        assert not w.of("checkpoint.saved")
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


REPORTS_ONLY = """
import time
import recovery.client as recovery
client = recovery.connect()
for step in range(1, 100000):
    client.report_step(step)
    time.sleep(0.1)
"""


@pytest.mark.parametrize("script", ["import time\ntime.sleep(600)\n", REPORTS_ONLY], ids=["stock", "reports-only"])
async def test_a_graceful_stop_of_a_rank_that_does_not_read_the_sdks_stop_sends_sigterm_at_once(
        streams: NatsServer, tmp_path: Path, script: str) -> None:
    """A stock script has no SDK connection to receive the stop, and one that only reports steps never reads it: it
    gets SIGTERM at once, as torchrun sends it, not after half the grace period spent waiting for a clean end of step
    that cannot come."""
    agent = AgentProcess(tmp_path, "n8", streams.url)
    nc = await connect(streams.url)
    job = "stock" if script != REPORTS_ONLY else "reports-only"
    w = await watch(nc, job)
    ready = await node_heard(nc, "recovery.ev.node.n8.>")
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        spec = stand_in_job(tmp_path, ["elsewhere", "n8"], 1, 2)
        (tmp_path / "stand_in.py").write_text(script)
        await submit(nc, job, spec, accepted=True)
        await wait_until(lambda: 1 in w.pids(), 30, "rank 1 to start", agent.log_tail)
        if script == REPORTS_ONLY:
            await wait_until(lambda: w.step(1) >= 2, 30, "rank 1 to report steps", agent.log_tail)
        stopped = time.monotonic()
        await command(nc, "n8", {"id": f"{job}:3:0", "job": job, "attempt": 0, "deadline_s": 60.0,
                                 "kind": "stop_ranks", "ranks": [1], "mode": "graceful", "grace_s": 30.0})
        await wait_until(lambda: acks(w, f"{job}:3:0") == ["accepted", "done"], 30, "the stop's acks", agent.log_tail)
        assert time.monotonic() - stopped < 10.0  # not the 15 s of half the grace
        assert w.of("process.exited")[0]["data"]["signal"] == signal.SIGTERM
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


SLOW_EXIT = """
import atexit, os, sys, time
def teardown():  # as torch's on a loaded host: seconds in which no other thread of the process runs
    sys.setswitchinterval(60.0)
    end = time.monotonic() + float(os.environ["TEARDOWN_S"])
    while time.monotonic() < end:
        pass
atexit.register(teardown)  # before the SDK's exit handler, so it runs after it
import recovery.client as recovery
client = recovery.connect()
for step in range(1, 4):
    client.report_step(step)
    time.sleep(0.05)
"""


async def test_a_rank_whose_interpreter_takes_long_to_exit_is_not_taken_for_a_hung_one(
        streams: NatsServer, tmp_path: Path) -> None:
    """A script that ends without a word to the SDK (most do) and whose interpreter then takes longer to exit than
    the agent's silence bound, no heartbeat sent meanwhile: the SDK says at exit that the process is ending, so the
    agent neither reports it hung nor counts its exit as anything but what its status says."""
    agent = AgentProcess(tmp_path, "n9", streams.url, env={"RECOVERY_AGENT_RANK_SILENCE_S": "1.5"})
    nc = await connect(streams.url)
    w = await watch(nc, "slowexit")
    ready = await node_heard(nc, "recovery.ev.node.n9.>")
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        spec = stand_in_job(tmp_path, ["elsewhere", "n9"], 1, 2)
        spec["entrypoint"]["env"]["TEARDOWN_S"] = "4"
        (tmp_path / "stand_in.py").write_text(SLOW_EXIT)
        await submit(nc, "slowexit", spec, accepted=True)
        await wait_until(lambda: bool(w.of("process.exited")), 60, "rank 1 to exit", agent.log_tail)
        assert w.step(1) == 3
        assert w.of("process.exited")[0]["data"] == {"rank": 1, "exit_code": 0, "signal": None, "attempt": 0}
        assert not w.of("process.hang"), w.of("process.hang")
        # and its agent said it lived while it ended, as its heartbeats would have
        named = [r for e in w.of("progress.report") for r in e["data"]["ranks"] if r["rank"] == 1]
        assert sum(r["step"] is None for r in named[named.index(next(r for r in named if r["step"] == 3)):]) >= 2
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


async def test_an_agent_started_after_a_job_was_submitted_knows_it_and_carries_out_its_commands(
        streams: NatsServer, tmp_path: Path) -> None:
    """As a restarted agent does: the job is read back from the stream, nothing is launched for it, and a restart
    addressed to the node starts the rank."""
    nc = await connect(streams.url)
    w = await watch(nc, "old")
    spec = stand_in_job(tmp_path, ["elsewhere", "n4"], 1, 2)
    await accept(nc, "old", await submit(nc, "old", spec), state="running")  # started before this agent
    ready = await node_heard(nc, "recovery.ev.node.n4.>")
    agent = AgentProcess(tmp_path, "n4", streams.url)
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        plan = {"checkpoint_step": None, "next_step": 0, "shards": []}
        await command(nc, "n4", {"id": "old:5:0", "job": "old", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [1], "plan": plan})
        await wait_until(lambda: acks(w, "old:5:0") == ["accepted", "done"], 30, "the restart's acks",
                         agent.log_tail)
        assert [(e["data"]["rank"], e["data"]["attempt"]) for e in w.of("process.started")] == [(1, 1)]
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


RESET = '''
import os, sys
device, marker, pids = sys.argv[1], sys.argv[2], sys.argv[3]
alive = []
for pid in open(pids).read().split():
    try:
        os.kill(int(pid), 0)
        alive.append(pid)
    except ProcessLookupError:
        pass
with open(marker, "a") as out:
    out.write(f"{device} alive={','.join(alive) or 'none'}\\n")
if device == "3":
    print("Unable to reset GPU 00000000:3B:00.0: it is in use by another client")
    sys.exit(3)
'''


async def test_a_restart_in_place_resets_its_devices_between_the_kill_and_the_start(
        streams: NatsServer, tmp_path: Path) -> None:
    reset = tmp_path / "reset.py"
    reset.write_text(RESET)
    marker, pids = tmp_path / "resets.txt", tmp_path / "pids.txt"
    agent = AgentProcess(tmp_path, "n1", streams.url, False, "--device-reset-command",
                         f"{sys.executable} {reset} {{device}} {marker} {pids}")
    nc = await connect(streams.url)
    w = await watch(nc, "r")
    ready = await node_heard(nc, "recovery.ev.node.n1.>")
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", agent.log_tail)
        spec = stand_in_job(tmp_path, ["elsewhere", "n1"], 2, 4)
        await submit(nc, "r", spec, accepted=True)
        await wait_until(lambda: set(w.pids()) == {2, 3} and w.step(2) >= 2 and w.step(3) >= 2, 30,
                         "ranks 2 and 3 to run", agent.log_tail)
        old = w.pids()[2][0]
        pids.write_text(f"{old}\n")
        plan = {"checkpoint_step": None, "next_step": 0, "shards": []}
        await command(nc, "n1", {"id": "r:7:0", "job": "r", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [2], "plan": plan,
                                 "reset_devices": {"n1": [0], "elsewhere": [5]}})
        await wait_until(lambda: acks(w, "r:7:0") == ["accepted", "done"], 30, "the restart's acks", agent.log_tail)
        done = [e["data"] for e in w.of("command.ack") if e["data"]["command_id"] == "r:7:0"][-1]
        assert done["result"]["reset"] == [0]  # only this node's devices
        assert marker.read_text() == "0 alive=none\n"  # reset once the rank was gone, and before its new start
        await wait_until(lambda: len(w.pids().get(2, [])) == 2, 30, "rank 2 started again", agent.log_tail)

        pids.write_text(f"{w.pids()[3][0]}\n")
        await command(nc, "n1", {"id": "r:8:0", "job": "r", "attempt": 2, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [3], "plan": plan, "reset_devices": {"n1": [3]}})
        await wait_until(lambda: acks(w, "r:8:0") == ["accepted", "failed"], 30, "the failed reset's acks",
                         agent.log_tail)
        failed = [e["data"] for e in w.of("command.ack") if e["data"]["command_id"] == "r:8:0"][-1]
        assert "resetting GPU 3 failed" in failed["reason"] and "exit status 3" in failed["reason"]
        assert "in use by another client" in failed["reason"]
        assert failed["result"] == {"node": "n1", "reset_failed": [3]}  # what the engine counts bad again
        assert len(w.pids()[3]) == 1  # not started again on a GPU that was not reset: the policy moves it instead
    finally:
        agent.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


async def test_a_reset_that_hangs_or_cannot_run_fails_with_why() -> None:
    with pytest.raises(ResetFailed, match=r"took more than 0.2 s"):
        await reset_device(f"{sys.executable} -c 'import time; time.sleep(30)' {{device}}", 1, 0.2)
    with pytest.raises(ResetFailed, match="no-such-smi not found"):
        await reset_device("no-such-smi -r -i {device}", 1, 5)
    with pytest.raises(ResetFailed, match="empty"):
        await reset_device("  ", 1, 5)
    await reset_device(f"{sys.executable} -c 'import sys; sys.exit(int(sys.argv[1]))' {{device}}", 0, 10)


async def test_a_restarted_agent_adopts_the_ranks_that_outlived_the_old_one(streams: NatsServer,
                                                                            tmp_path: Path) -> None:
    """An agent upgraded or crashed under running training: the new one finds the ranks the old one started (by
    the records it left, checked against the processes' start times), ends those a command it missed would have
    ended, reports their exits and, told to restart one, replaces it rather than starting a second copy beside it."""
    nc = await connect(streams.url)
    w = await watch(nc, "ad")
    ready = await node_heard(nc, "recovery.ev.node.n6.node.ready")
    said: list[dict[str, Any]] = []  # each node.ready's data: the new agent says how the old one ended

    async def on_ready(msg: Any) -> None:
        said.append(orjson.loads(msg.data)["data"])

    await nc.subscribe("recovery.ev.node.n6.node.ready", cb=on_ready)
    old = AgentProcess(tmp_path, "n6", streams.url)
    new: AgentProcess | None = None
    plan = {"checkpoint_step": None, "next_step": 0, "shards": []}
    try:
        await wait_until(lambda: bool(ready), 30, "the agent's node.ready", old.log_tail)
        spec = stand_in_job(tmp_path, ["n6"], 4, 4)
        await submit(nc, "ad", spec, accepted=True)
        await wait_until(lambda: set(w.pids()) == {0, 1, 2, 3} and min(w.step(r) for r in range(4)) >= 2, 30,
                         "four ranks to run", old.log_tail)
        pids = {rank: p[0] for rank, p in w.pids().items()}
        old.proc.kill()  # the agent alone: its ranks run in sessions of their own and go on
        old.proc.wait(timeout=10)
        assert all(start_time(pid) is not None for pid in pids.values())
        # the engine restarts rank 2 while no agent runs here: no ack comes, it gives up on the command
        await command(nc, "n6", {"id": "ad:5:0", "job": "ad", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [2], "plan": plan})
        ready.clear()
        new = AgentProcess(tmp_path, "n6", streams.url)
        await wait_until(lambda: bool(ready), 30, "the new agent's node.ready", new.log_tail)
        await wait_until(lambda: len(said) == 2, 10, "both node.ready's data", new.log_tail)
        # a first start, then the SIGKILL it could not say; each announcing the health checks that follow
        assert said == [{"checks": True}, {"last_exit": ENDED_WITHOUT_A_WORD, "checks": True}]
        await wait_until(lambda: new.log_tail(50).count("outlived the previous agent") == 4, 30, "the four adoptions",
                         new.log_tail)
        # the missed restart ends rank 2's old process (a replacement may run elsewhere) and starts nothing
        await wait_until(lambda: start_time(pids[2]) is None, 15, "the missed restart to end rank 2", new.log_tail)
        assert acks(w, "ad:5:0") == [] and len(w.of("process.started")) == 4
        assert start_time(pids[0]) is not None and start_time(pids[1]) is not None

        os.kill(pids[0], signal.SIGKILL)  # a crash the new agent did not see start
        await wait_until(lambda: {e["data"]["rank"] for e in w.of("process.exited")} == {0, 2}, 15,
                         "the exits of ranks 0 and 2", new.log_tail)
        # not its child: the status is unknown, which the engine takes as a process fault
        exits = {e["data"]["rank"]: e["data"] for e in w.of("process.exited")}
        assert exits[0] == {"rank": 0, "exit_code": None, "signal": None, "attempt": 0}

        await command(nc, "n6", {"id": "ad:9:0", "job": "ad", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "restart_ranks", "ranks": [1], "plan": plan})
        await wait_until(lambda: acks(w, "ad:9:0") == ["accepted", "done"], 30, "the restart's acks", new.log_tail)
        assert start_time(pids[1]) is None  # replaced, not doubled (ended; a zombie where nothing reaps orphans)
        assert [(e["data"]["rank"], e["data"]["attempt"]) for e in w.of("process.started")][-1] == (1, 1)

        await command(nc, "n6", {"id": "ad:10:0", "job": "ad", "attempt": 1, "deadline_s": 60.0,
                                 "kind": "stop_ranks", "ranks": [3], "mode": "graceful", "grace_s": 10.0})
        await wait_until(lambda: acks(w, "ad:10:0") == ["accepted", "done"], 30, "the stop's acks", new.log_tail)
        exits = {e["data"]["rank"]: e["data"] for e in w.of("process.exited")}
        assert exits[3]["exit_code"] == 0  # its SDK said it was closing: the script's own end

        # a process claiming rank 1 that the agent does not run (its replacement does) may not join a generation
        ask = "import recovery.client as r; print(r.connect().may_join(2, 10))"
        asked = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", ask], capture_output=True, text=True, timeout=30, check=True,
            env={**environment(), "RECOVERY_AGENT_SOCKET": str(new.workdir / "ad.sock"), "RANK": "1",
                 "RECOVERY_GENERATION": "1"})
        assert asked.stdout.strip() == "False", asked.stderr
    finally:
        old.stop()
        if new is not None:
            new.stop()
        kill_leftovers([pid for pids in w.pids().values() for pid in pids])
        await nc.close()


def test_a_process_a_launcher_started_in_the_ranks_session_counts_as_the_rank() -> None:
    """An entrypoint that is a shell script running python: the SDK's pid is the launcher's child, in the session
    the agent started the rank in; a process outside that session is not the rank."""
    launcher = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' & wait"],
                                start_new_session=True)
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
        deadline = time.monotonic() + 10
        while not children.read_text().split():
            assert time.monotonic() < deadline, "the launcher started no child"
            time.sleep(0.01)  # polling for the child within the deadline above
        child = int(children.read_text().split()[0])
        rank = RankProcess("j", 0, 0, None, launcher.pid)
        assert in_session(launcher.pid, rank) and in_session(child, rank)
        assert not in_session(os.getpid(), rank) and not in_session(None, rank) and not in_session(True, rank)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)

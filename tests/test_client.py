"""The SDK against a stand-in agent on a real Unix socket: what it sends, when it saves, and that it never stops
training when no agent listens."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery.client import Client, ResumePlan, connect


class StandInAgent:
    """Accepts one connection and records every line it receives."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.received: list[dict[str, Any]] = []
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.conn, _ = self.server.accept()
        buffer = b""
        while chunk := self.conn.recv(65536):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.received.append(json.loads(line))

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [m for m in list(self.received) if m["op"] == op]

    def send(self, message: dict[str, Any]) -> None:
        assert self.conn is not None
        self.conn.sendall(json.dumps(message).encode() + b"\n")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)  # polling interval of a deadline-bounded wait


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StandInAgent]:
    stand_in = StandInAgent(tmp_path / "agent.sock")
    yield stand_in
    stand_in.close()


def test_the_client_says_hello_then_reports_steps_and_heartbeats_with_its_generation(
        agent: StandInAgent, tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=3, generation=2, heartbeat_s=0.05)
    client.report_step(7)
    wait_for(lambda: len(agent.ops("heartbeat")) >= 3)
    client.close()
    assert agent.received[0]["op"] == "hello" and agent.received[0]["rank"] == 3
    assert agent.ops("step") == [{"op": "step", "step": 7, "rank": 3, "attempt": 2}]
    assert agent.ops("heartbeat")[-1]["step"] == 7


def test_a_save_request_runs_the_save_function_at_the_next_step_boundary(agent: StandInAgent, tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=1, heartbeat_s=0.05)
    saved: list[int] = []
    client.on_save(lambda step: saved.append(step) or {"tier": "dying", "shards": [0], "location": "/ckpt"})
    client.report_step(4)
    wait_for(lambda: agent.conn is not None)
    agent.send({"op": "save", "id": "j:9:0/1", "step": 4})
    wait_for(lambda: client._save_requested is not None)
    assert saved == []  # not from the heartbeat thread, in the middle of a step
    client.report_step(5)
    assert saved == [5]
    wait_for(lambda: agent.ops("saved"))
    assert agent.ops("saved")[0] | {"attempt": 0} == {"op": "saved", "id": "j:9:0/1", "step": 5, "tier": "dying",
                                                       "shards": [0], "location": "/ckpt", "shared": False, "rank": 1,
                                                       "attempt": 0}
    client.close()


def test_a_stop_request_is_seen_by_should_stop(agent: StandInAgent, tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=0, heartbeat_s=0.05)
    client.report_step(1)
    wait_for(lambda: agent.conn is not None)
    agent.send({"op": "stop"})
    wait_for(client.should_stop)
    client.close()


def test_without_an_agent_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RECOVERY_AGENT_SOCKET", raising=False)
    client = connect()
    client.report_step(1)
    client.checkpoint_saved(1, "storage", [0], "/ckpt")
    assert client.resume_plan() is None and not client.should_stop()
    client.close()


def test_an_agent_that_is_gone_never_blocks_training(tmp_path: Path) -> None:
    client = Client(str(tmp_path / "nobody.sock"), rank=0, heartbeat_s=0.05)
    started = time.monotonic()
    for step in range(100):
        client.report_step(step)
    assert time.monotonic() - started < 1.0
    client.close()


def test_the_resume_plan_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOVERY_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("RECOVERY_RESUME_PLAN", json.dumps(
        {"checkpoint_step": 15, "next_step": 16, "shards": [{"shard": 0, "tier": "peer", "holders": ["n0", "n1"]}]}))
    monkeypatch.setenv("RECOVERY_GENERATION", "1")
    monkeypatch.setenv("RANK", "2")
    client = connect()
    plan = client.resume_plan()
    assert isinstance(plan, ResumePlan) and plan.next_step == 16 and plan.source_of(2).tier == "peer"  # type: ignore[union-attr]
    assert (client.rank, client.generation) == (2, 1)


def test_may_join_asks_the_agent_and_waits_for_its_answer(agent: StandInAgent, tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=2, generation=1, heartbeat_s=0.05)
    answers: list[bool | None] = []
    asking = threading.Thread(target=lambda: answers.append(client.may_join(2, 10.0)))
    asking.start()
    wait_for(lambda: agent.ops("join"))
    assert agent.ops("join")[0]["generation"] == 2 and agent.ops("join")[0]["pid"] > 0
    assert not answers  # it waits for the agent
    agent.send({"op": "join_refused", "generation": 2})
    asking.join(5)
    assert answers == [False]
    agent.send({"op": "join_ok", "generation": 3})
    assert client.may_join(3, 5.0) is True
    client.close()


def test_may_join_without_an_answer_is_none_and_without_an_agent_true(tmp_path: Path) -> None:
    # a socket path where no agent listens any more: the agent died, the process lives on
    orphan = Client(str(tmp_path / "gone.sock"), rank=1, generation=4, heartbeat_s=0.05)
    assert orphan.may_join(5, 0.3) is None
    orphan.close()
    assert Client(None, rank=1).may_join(5, 0.3) is True


def test_the_sdk_reads_the_torch_store_key_the_job_store_writes() -> None:
    from recovery.agent.rendezvous import torch_store_key
    from recovery.client.torch import TORCH_STORE_KEY

    assert TORCH_STORE_KEY.format(run_id="job-7", generation=3) == torch_store_key("job-7", 3)


def test_a_step_carries_its_loss_non_finite_as_a_word_and_the_data_it_names(agent: StandInAgent,
                                                                           tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=1, heartbeat_s=0.05)
    client.report_step(22, loss=0.25)
    client.report_step(23, loss=float("nan"), skip=["shard-3/batch-22", "sample-9"])
    client.report_step(24, loss=float("-inf"))
    wait_for(lambda: len(agent.ops("step")) == 3)
    client.close()
    assert [(m["step"], m["loss"], m.get("skip")) for m in agent.ops("step")] == [
        (22, 0.25, None), (23, "nan", ["shard-3/batch-22", "sample-9"]), (24, "-inf", None)]


def test_the_plan_names_the_data_a_roll_back_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOVERY_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("RECOVERY_RESUME_PLAN", json.dumps(
        {"checkpoint_step": 20, "next_step": 21, "shards": [{"shard": 0, "tier": "storage", "holders": ["storage"]}],
         "skip_steps": [23], "skip_data": ["sample-9"]}))
    client = connect()
    assert client.skip_steps == {23} and client.skip_data == {"sample-9"}
    assert client.skips(23) and client.skips(30, ["sample-1", "sample-9"]) and not client.skips(24, ["sample-1"])
    monkeypatch.delenv("RECOVERY_RESUME_PLAN")
    assert not connect().skips(23)  # a first start skips nothing


def test_a_collective_timeout_is_reported_with_the_step_it_interrupted_and_the_groups_generation(
        agent: StandInAgent, tmp_path: Path) -> None:
    client = Client(str(tmp_path / "agent.sock"), rank=2, generation=1, heartbeat_s=0.05)
    client.report_step(15)
    client.collective_failed(1, "Timed out waiting 4000ms for recv operation to complete", timeout_s=4.0)
    wait_for(lambda: agent.ops("collective_failed"))
    client.close()
    assert agent.ops("collective_failed") == [{
        "op": "collective_failed", "generation": 1, "step": 16, "operation": "allreduce", "timeout_s": 4.0,
        "error": "Timed out waiting 4000ms for recv operation to complete", "rank": 2, "attempt": 1}]


def test_only_a_collective_that_timed_out_with_its_group_intact_is_a_timeout_to_report() -> None:
    from recovery.client.torch import ProcessGroupRecovery

    group = ProcessGroupRecovery.__new__(ProcessGroupRecovery)  # no group formed: what `recover` judges by
    group._aborted = False
    timed_out = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for "
                 "recv operation to complete")
    assert group.timed_out(timed_out)
    # gloo closes this process's pairs on its own timeout first: an operation under them says so (a timeout still)
    assert group.timed_out("[gloo/transport/tcp/pair.cc:446] Application timeout caused pair closure")
    # a dead peer: its exit is the fault, not the group's timeout
    assert not group.timed_out("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16781")
    group._aborted = True  # the watcher shut the group: a peer failed first, or a newer generation began
    assert not group.timed_out(timed_out)


class _RacedJobStore:
    """The job store (a real TCPStore, under a job's prefix) as one process sees it while another announces
    `newer` right after this one first reads the generation: two replacements started by two faults a few
    milliseconds apart. It serves no torch-store keys (a job store that writes none: only the announcement tells
    the survivors which generation is the newest)."""

    def __init__(self, newer: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from recovery.client.torch import GENERATION_KEY

        self.key = GENERATION_KEY
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=10))
        self.inner = dist.PrefixStore("job-7/", self.master)
        self.scoped = self  # what ProcessGroupRecovery reads and writes: the SDK's keys under the run id
        self.newer: int | None = newer

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def get(self, key: str) -> bytes:
        value = bytes(self.inner.get(key))
        if key == self.key and self.newer is not None:
            self.inner.set(key, str(self.newer))  # the other process's announcement lands after this read
            self.newer = None
        return value

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def torch_store_asked(self, generation: int) -> bool:
        return False


def test_a_process_of_an_abandoned_generation_never_hides_the_newer_one_it_announces_beside() -> None:
    pytest.importorskip("torch")
    from recovery.client.torch import ProcessGroupRecovery

    store = _RacedJobStore(newer=2)
    store.set(store.key, "0")
    started_in_1 = ProcessGroupRecovery.__new__(ProcessGroupRecovery)  # the first fault's replacement
    started_in_1.client, started_in_1._store = Client(None, rank=2, generation=1), store
    started_in_1._announce(1)
    survivor = ProcessGroupRecovery.__new__(ProcessGroupRecovery)
    survivor.client, survivor._store = Client(None, rank=0, generation=0), store
    # The survivor moves on to generation 2, where the second fault's replacement waits, not to the abandoned 1.
    assert store.check([store.key]) and int(store.inner.get(store.key)) == 2
    assert survivor.newest() == 2
    started_in_1._announce(1)  # said again: still no step back
    assert survivor.newest() == 2


def test_a_forked_child_that_exits_says_nothing_for_the_rank(agent: StandInAgent, tmp_path: Path) -> None:
    """A process the rank forks inherits its client and its exit handlers; its exit is no word of the rank's (it
    would tell the agent that the rank, still training, is ending)."""
    import os
    import subprocess
    import sys

    script = ("import os, sys\nfrom recovery.client import Client\n"
              f"client = Client({str(tmp_path / 'agent.sock')!r}, rank=0)\n"
              "child = os.fork()\n"
              "if child == 0:\n    sys.exit(0)  # the child's exit handlers run here\n"
              "os.waitpid(child, 0)\nclient.report_step(1)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    wait_for(lambda: bool(agent.ops("exiting")))  # the rank's own, at its end
    [hello] = agent.ops("hello")
    assert [m["pid"] for m in agent.ops("exiting")] == [hello["pid"]]
    assert agent.ops("step")[0]["step"] == 1

"""The step hook (`recovery.client.steps`) in real interpreters started as the agent starts a rank (its start-up
directory first on PYTHONPATH, RECOVERY_STEP_HOOK=1), against a stand-in agent on a Unix socket: an unmodified
script's optimizer steps are counted and reported; nothing connects where the hook must stay quiet."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recovery.agent import ranks, stephook
from tests.e2e_support import ROOT

TRAIN = """
import torch
model = torch.nn.Linear(4, 1)
critic = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
other = torch.optim.Adam(critic.parameters())
for _ in range({steps}):
    for net, o in ((model, opt), (critic, other)):  # two optimizers stepped once each an iteration
        o.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        o.step()
print("trained", flush=True)
"""


class Listener:
    """A stand-in agent: accepts every connection and records each one's lines, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(8)
        self.connections: list[list[dict[str, Any]]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            lines: list[dict[str, Any]] = []
            self.connections.append(lines)
            threading.Thread(target=self._read, args=(conn, lines), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, lines: list[dict[str, Any]]) -> None:
        buffer = b""
        with conn:
            while chunk := conn.recv(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    lines.append(json.loads(line))


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    stand_in = Listener(tmp_path / "agent.sock")
    yield stand_in
    stand_in.server.close()


def run_rank(tmp_path: Path, listener: Listener, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`script` run as the agent runs a rank: its environment with the step hook, then `env`."""
    path = tmp_path / "script.py"
    path.write_text(script)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_")}
    full = {**base, "PYTHONPATH": str(ROOT), "RANK": "0", "RECOVERY_AGENT_SOCKET": str(listener.path)}
    full.pop(stephook.OWNER_ENV, None)
    full.update({stephook.HOOK_ENV: "1",
                 "PYTHONPATH": f"{stephook.STARTUP}{os.pathsep}{ROOT}"})
    full.update(env)
    done = subprocess.run([sys.executable, str(path)], env=full, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done


def test_an_unmodified_script_reports_its_optimizer_steps_counted_from_one(tmp_path: Path,
                                                                           listener: Listener) -> None:
    done = run_rank(tmp_path, listener, TRAIN.format(steps=5))
    assert "trained" in done.stdout
    [lines] = listener.connections
    ops = [m["op"] for m in lines]
    assert ops[:2] == ["hello", "caps"] and lines[1]["caps"] == ["counts"], ops  # said before any heartbeat
    assert [m["step"] for m in lines if m["op"] == "step"] == [1, 2, 3, 4, 5]  # two optimizers: one count each
    assert ops[-1] == "exiting" and lines[-1]["pid"] == lines[0]["pid"]


def test_the_hook_stays_quiet_where_the_rank_is_not_its_script_alone(tmp_path: Path, listener: Listener) -> None:
    # turned off by the job
    run_rank(tmp_path, listener, TRAIN.format(steps=2), RECOVERY_STEP_HOOK="0")
    assert listener.connections == []
    # a script that uses the SDK speaks for itself: its own client only, no counts
    run_rank(tmp_path, listener, "import recovery.client as r\nclient = r.connect()\n" + TRAIN.format(steps=2))
    [own] = listener.connections
    assert not [m for m in own if m["op"] in ("caps", "step")], own
    # an interpreter the rank starts (a worker) inherits the environment, yet it is not the rank
    child = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {TRAIN.format(steps=2)!r}], check=True)\n"
    run_rank(tmp_path, listener, child)
    assert len(listener.connections) == 1, listener.connections[1:]


def test_a_failure_of_the_hook_never_reaches_the_script(tmp_path: Path, listener: Listener) -> None:
    """Its client cannot be made (a resume plan it cannot read): the script trains on as a stock one."""
    done = run_rank(tmp_path, listener, TRAIN.format(steps=2), RECOVERY_RESUME_PLAN="{not json")
    assert "trained" in done.stdout and not [m for c in listener.connections for m in c if m["op"] == "step"]


def test_a_sitecustomize_the_hook_hides_still_runs(tmp_path: Path, listener: Listener) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_WAS_HERE = True\n")
    done = run_rank(tmp_path, listener, "print(SITE_WAS_HERE)\n" + TRAIN.format(steps=1),
                    PYTHONPATH=f"{stephook.STARTUP}{os.pathsep}{site}{os.pathsep}{ROOT}")
    assert done.stdout.startswith("True")
    assert [m["step"] for m in listener.connections[0] if m["op"] == "step"] == [1]


def test_the_agent_starts_ranks_with_the_hook_unless_told_not_to(tmp_path: Path) -> None:
    from events.values import Entrypoint

    placement = ranks.Placement(0, 1, 0, 1, 0, 1)
    common: dict[str, Any] = {"job": "j", "node": "n0", "attempt": 0, "plan": None, "store_addr": "127.0.0.1",
                              "store_port": 1, "torch_port": None, "socket": tmp_path / "s", "heartbeat_s": 1.0}
    on = ranks.environment(Entrypoint(command="python", env={"PYTHONPATH": "/mine"}), placement, **common)
    assert on["PYTHONPATH"] == f"{stephook.STARTUP}{os.pathsep}/mine" and on["RECOVERY_STEP_HOOK"] == "1"
    off = ranks.environment(Entrypoint(command="python", env={"RECOVERY_STEP_HOOK": "0"}), placement, **common)
    assert stephook.STARTUP not in off.get("PYTHONPATH", "") and off["RECOVERY_STEP_HOOK"] == "0"
    agent_off = ranks.environment(Entrypoint(command="python"), placement, **common, step_hook=False)
    assert stephook.STARTUP not in agent_off.get("PYTHONPATH", "")


async def test_a_rank_handed_to_a_warm_standby_counts_its_steps_as_a_cold_one(tmp_path: Path,
                                                                              listener: Listener) -> None:
    """The standby installed the hook at its start (its environment the ranks' own), before torch was imported:
    the rank it becomes counts from its first optimizer step, its pid the hook's."""
    import anyio

    from events.values import Entrypoint
    from recovery.agent.standby import StandbyPool

    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(steps=3))
    base = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_")}
    entrypoint = Entrypoint(command=sys.executable, args=[str(script)], cwd=str(tmp_path),
                            env={"PYTHONPATH": str(ROOT)})
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    pool = StandbyPool(runtime, enabled=True, preload="torch", delay_s=0, step_hook=True)
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(base)  # the agent's environment, which the standby starts from
    try:
        async with anyio.create_task_group() as tg:
            try:
                with anyio.fail_after(90):
                    await pool.keep("job", entrypoint)
                standby = pool.take("job", dict(os.environ))
                assert standby is not None
                env = stephook.with_step_hook({**base, "PYTHONPATH": str(ROOT), "RANK": "0",
                                               "RECOVERY_AGENT_SOCKET": str(listener.path)}, True)
                proc = await ranks.start(entrypoint, env, tmp_path / "rank0.log", job="job", rank=0, attempt=1,
                                         standby=standby)
                tg.start_soon(ranks.reap, proc)
                with anyio.fail_after(90):
                    await proc.ended.wait()
            finally:
                await pool.close()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert proc.status() == (0, None), (tmp_path / "rank0.log").read_text()
    [lines] = listener.connections
    assert lines[0] == {"op": "hello", "pid": proc.pid, "rank": 0, "attempt": 0}
    assert [m["step"] for m in lines if m["op"] == "step"] == [1, 2, 3]


class _Counts:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def count_step(self, count: int) -> None:
        self.sent.append(count)


def test_the_count_is_of_iterations_whatever_optimizers_take_the_steps() -> None:
    from recovery.client.steps import StepCounter

    def counted(pattern: list[object]) -> list[int]:
        counter = StepCounter(os.getpid())
        counter.client = _Counts()
        for optimizer in pattern:
            counter(optimizer)
        return counter.client.sent

    generator, critic = object(), object()
    assert counted([generator, critic] * 3) == [1, 2, 3]  # a GAN: one count an iteration
    epochs = [object() for _ in range(3)]  # an optimizer made again every epoch, 4 steps each
    assert counted([o for o in epochs for _ in range(4)]) == list(range(1, 11))  # on, one step missed at a switch
    assert counted([critic, critic, generator] * 2) == [1, 2, 3, 4]  # two critic steps an iteration: the critic's

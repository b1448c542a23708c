"""Compiled code survives a restart (`recovery/agent/compilecache.py`): each job's compile caches in a directory of
its own that outlives its ranks, copied to the shared directory once the ranks stepped and fetched by a node that
lacks them; a real `torch.compile` in a new process then finds its graphs compiled, on the same node and on a spare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio

from recovery.agent.compilecache import CACHES, SHARED_NAME, CompileCaches, copy_new
from tests.e2e_support import environment

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "compile_probe.py"


def test_a_file_is_copied_once_whole_and_a_vanished_one_passed_over(tmp_path: Path) -> None:
    source, target = tmp_path / "a", tmp_path / "b"
    (source / "fx" / "x1").mkdir(parents=True)
    (source / "fx" / "x1" / "entry").write_bytes(b"graph")
    (source / "kernel.so").write_bytes(b"\x7fELF")
    assert copy_new(source, target) == 2 and copy_new(source, target) == 0  # the same sizes: not copied again
    assert (target / "fx" / "x1" / "entry").read_bytes() == b"graph"
    (source / "kernel.so").write_bytes(b"\x7fELF, rebuilt")
    assert copy_new(source, target) == 1 and (target / "kernel.so").read_bytes() == b"\x7fELF, rebuilt"
    assert not list(target.rglob("*.partial"))  # written beside its place, renamed into it
    assert copy_new(tmp_path / "none", target) == 0


def test_each_job_gets_its_own_caches_unless_it_names_them(tmp_path: Path) -> None:
    caches = CompileCaches(tmp_path / "cc", None)
    env = caches.environment("j1", {})
    assert env == {var: str(tmp_path / "cc" / "j1" / name) for var, name in CACHES.items()}
    assert caches.environment("j1", {"TRITON_CACHE_DIR": "/mine"}) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cc" / "j1" / "inductor")}
    assert CompileCaches(tmp_path / "cc", None, enabled=False).environment("j1", {}) == {}


async def test_a_nodes_caches_go_to_the_shared_copy_and_a_spare_fetches_them(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    node, spare = CompileCaches(tmp_path / "n0", shared), CompileCaches(tmp_path / "s0", shared)
    compiled = node.job_dir("j") / "inductor" / "fxgraph" / "entry"
    compiled.parent.mkdir(parents=True)
    compiled.write_bytes(b"compiled")
    stepped = anyio.Event()
    scope = node.to_follow("j")
    assert scope is not None and node.to_follow("j") is None  # one follower per job on a node
    async with anyio.create_task_group() as tg:
        tg.start_soon(node.follow, "j", stepped, scope, 0.05)
        await anyio.wait_all_tasks_blocked()
        assert not shared.exists()  # nothing copied before the ranks stepped
        stepped.set()
        with anyio.fail_after(10):
            while not (shared / "j" / SHARED_NAME / "inductor" / "fxgraph" / "entry").exists():
                await anyio.sleep(0.01)  # polling the copy, within the deadline above
        assert await spare.fetch("j") == 1
        assert (spare.job_dir("j") / "inductor" / "fxgraph" / "entry").read_bytes() == b"compiled"
        assert await spare.fetch("j") == 0  # fetched moments ago: the node's other ranks share it
        await node.end("j", completed=True)  # the job completed on its first node: its caches go, shared too
    assert not node.job_dir("j").exists() and not (shared / "j").exists()


def probe(cache: Path, tmp_path: Path) -> dict[str, float]:
    """A new process's first compiled step with `cache` as its compile caches (`tools/compile_probe.py`)."""
    out = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*.json')))}.json"
    env = {**environment(), **{var: str(cache / name) for var, name in CACHES.items()}, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(PROBE), "--out", str(out)], env=env, check=True, timeout=600)
    result: dict[str, float] = json.loads(out.read_text())
    return result


async def test_a_restarted_rank_and_a_spares_rank_find_the_graphs_compiled(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    node, spare = CompileCaches(tmp_path / "n0", shared), CompileCaches(tmp_path / "s0", shared)
    first = await anyio.to_thread.run_sync(probe, node.job_dir("j"), tmp_path)
    assert first["cache_hits"] == 0 and first["cache_misses"] > 0, first  # compiled
    again = await anyio.to_thread.run_sync(probe, node.job_dir("j"), tmp_path)
    assert again["cache_misses"] == 0 and again["cache_hits"] > 0, again  # restarted on its node: nothing compiled
    assert await node.publish("j") > 0 and await spare.fetch("j") > 0
    moved = await anyio.to_thread.run_sync(probe, spare.job_dir("j"), tmp_path)
    assert moved["cache_misses"] == 0 and moved["cache_hits"] > 0, moved  # on the spare: nothing compiled either
    assert moved["loss"] == first["loss"] == again["loss"]  # the same code, the same result

"""Steps without code: an unmodified script's optimizer steps, counted and reported to its agent.

The agent starts a rank with `recovery/client/startup` first on its `PYTHONPATH` (and `RECOVERY_STEP_HOOK=1`): that
directory's `sitecustomize` calls `install_from_environment()` before the script runs. Nothing is imported then but
this module: once the script imports `torch.optim`, PyTorch's global optimizer step hook is registered, and at the
first optimizer step of the process a client connects to the agent and says `counts`. From then on each step that
takes the process past its highest count so far is reported (`op: step`, its count since the process started), so
that a stock script, a Lightning or an Accelerate job is measured to its first optimizer step after a restart. Counts
are no steps of the job's own numbering (a restarted process counts from 1 again): the engine takes them for
progress and time, never for a resume point or lost steps.

A process that runs no optimizer never connects; a script that connects through the SDK itself speaks for itself
and the hook stays quiet; a process started by the rank (a DataLoader worker, a compile worker) is not the rank and
stays quiet too. `RECOVERY_STEP_HOOK=0` in the job's environment turns it off (docs/recovery-run.md).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType
from typing import Any

HOOK_ENV = "RECOVERY_STEP_HOOK"
OWNER_ENV = "RECOVERY_STEP_HOOK_PID"
"""the pid of the process that installed the hook: a child interpreter inherits the environment, not the rank"""
TARGET = "torch.optim.optimizer"

_lock = threading.Lock()
_installed = False
_counter: StepCounter | None = None


class StepCounter:
    """Counts the process's training iterations from its optimizer steps: an iteration begins when an optimizer
    steps that has stepped already in the current one (two optimizers stepped once each per iteration, a GAN's,
    count one iteration; an optimizer made again every epoch goes on counting, missing one step at the switch).
    Reports each new count."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.count = 0
        self.iteration: set[int] = set()  # the optimizers (their ids) stepped in the current iteration
        self.client: Any = None
        self.off = False

    def __call__(self, optimizer: object, args: Any = None, kwargs: Any = None) -> None:
        if self.off:
            return
        if os.getpid() != self.pid:  # a forked child stepping an optimizer is not the rank
            self.off = True
            return
        key = id(optimizer)
        if self.iteration and key not in self.iteration:
            self.iteration.add(key)  # another optimizer of the same iteration
            return
        self.iteration = {key}
        self.count += 1
        try:
            if self.client is None and not self._connect():
                return
            self.client.count_step(self.count)
        except Exception:  # the hook never stops training: without it, the script is a stock one again
            self.off = True

    def _connect(self) -> bool:
        from recovery.client import _client

        if _client.live_client() is not None or not os.environ.get("RECOVERY_AGENT_SOCKET"):
            self.off = True  # the script speaks through the SDK itself, or no agent runs it
            return False
        self.client = _client.connect(counts=True)
        return True


def _register(module: ModuleType) -> None:
    global _counter
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None or _counter is not None:
        return  # a torch without the global hook (before 2.0): nothing counted
    _counter = StepCounter(os.getpid())
    register(_counter)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the hook once `torch.optim.optimizer` has executed, whoever imported it: Python has no post-import
    hook, so the module's loader is wrapped for that one import."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            with contextlib.suppress(Exception):  # training goes on without counts rather than fail to import torch
                _register(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Count this process's optimizer steps from its first (torch imported now or later)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        os.environ[OWNER_ENV] = str(os.getpid())
        module = sys.modules.get(TARGET)
        if module is not None:
            _register(module)
        else:
            sys.meta_path.insert(0, _AfterImport())


def adopt() -> None:
    """Count this process's steps from now on: a fork of the process the hook was installed in that is to become the
    rank (a warm standby forked from its job's parent interpreter), unlike a process a rank forks, which counts
    nothing."""
    if _counter is not None:
        _counter.pid = os.getpid()
    if os.environ.get(OWNER_ENV):
        os.environ[OWNER_ENV] = str(os.getpid())


def install_from_environment() -> None:
    """`install()` where the agent asked for it, in the rank's own process only."""
    if os.environ.get(HOOK_ENV) != "1":
        return
    owner = os.environ.get(OWNER_ENV)
    if owner and owner != str(os.getpid()):
        return  # an interpreter the rank started: its environment came from the rank
    install()

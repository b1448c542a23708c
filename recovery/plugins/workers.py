"""Third-party policies run where their host can walk away from them: one worker process per plugin.

A call goes to the plugin's worker and waits at most `budget_s` for the answer. Past it, the worker is killed (a
Python thread running `while True:` cannot be stopped, and would keep a core and the GIL busy for ever), the call
raises `Abandoned`, and the next call starts a fresh worker. The host loses only the budget: the daemon keeps
answering `/healthz`, `recovery-ctl` and SIGTERM between calls, and the job gets the built-in's answer
(`recovery.core.overruns`).

A policy that cannot be pickled (a class defined inside a function, as tests write them) cannot be sent to a worker:
it runs in a thread instead, abandoned, not killed, when it overruns. The policy kit checks that a plugin pickles
(the daemon's snapshots hold policies), so a plugin that passes it always gets a process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from recovery.core.overruns import Abandoned, PolicyRaised, raised_problem
from recovery.plugins.frames import HEADER, dumps, frame

DEFAULT_BUDGET_S = 2.0
"""how long one call of a plugin may take: the policy kit's `CALL_BUDGET_S`, so that a plugin that passes the kit's
budget on a test machine is not abandoned in production"""
START_BUDGET_S = 60.0
"""how long a worker may take to start and load its policy (a busy host): not counted against any call"""


class _Worker:
    """One plugin's worker process, started on first use and again after it was killed."""

    def __init__(self, policy_bytes: bytes, label: str) -> None:
        self.policy_bytes = policy_bytes
        self.label = label
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False  # the process said it loaded the policy

    def launch(self) -> None:
        """Start the process and send it the policy, without waiting for it to be ready: it loads while its host
        goes on, and the first call finds it ready (a host that waits on a call waits on nothing else)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        # The worker imports the plugin as this process does: the same module search path.
        path = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen([sys.executable, "-m", "recovery.plugins.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path}, close_fds=True)
        assert proc.stdin is not None
        self.proc, self.ready = proc, False
        with contextlib.suppress(BrokenPipeError):  # an early exit is found by the first call
            proc.stdin.write(HEADER.pack(len(self.policy_bytes)) + self.policy_bytes)
            proc.stdin.flush()

    def _start(self) -> subprocess.Popen[bytes]:
        self.launch()
        proc = self.proc
        assert proc is not None
        if self.ready:
            return proc
        try:
            kind, detail = self._read(START_BUDGET_S)
        except Abandoned:
            self.close()
            raise PolicyRaised(f"did not start in its worker within {START_BUDGET_S:g} s") from None
        except BrokenPipeError:
            self.close()
            raise PolicyRaised("its worker exited as it started") from None
        if kind != "ready":
            self.close()
            raise PolicyRaised(str(detail))
        self.ready = True
        return proc

    def call(self, method: str, argument: Any, budget_s: float) -> Any:
        proc = self.proc if self.ready and self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(frame((method, argument)))
            proc.stdin.flush()
            kind, value = self._read(budget_s)
        except Abandoned:
            self.close()  # killed: a fresh worker answers the next call
            raise
        except BrokenPipeError:
            code = self.close()
            raise PolicyRaised(f"ended its worker (exit {code})") from None
        if kind == "raised":
            raise PolicyRaised(str(value))
        return value

    def _read(self, budget_s: float) -> tuple[str, Any]:
        """One reply within `budget_s`, read straight from the pipe (a buffered reader could hold half of it)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + budget_s
        data = b""
        need = HEADER.size
        header_read = False
        while True:
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise Abandoned(budget_s)
                chunk = os.read(fd, need - len(data))
                if not chunk:
                    code = self.close()
                    raise PolicyRaised(f"ended its worker (exit {code})")
                data += chunk
            if header_read:
                reply: tuple[str, Any] = pickle.loads(data)
                return reply
            (size,) = HEADER.unpack(data[:HEADER.size])
            data, need, header_read = data[HEADER.size:], size, True

    def close(self) -> int | None:
        proc, self.proc, self.ready = self.proc, None, False
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return proc.returncode


def _in_thread(policy: Any, method: str, argument: Any, budget_s: float) -> Any:
    """For a policy that cannot go to a worker: a thread, abandoned (it cannot be killed) past the budget."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("answer", getattr(policy, method)(argument)))
        except Exception as exc:  # third-party code: its error is named as it would be in-process
            outcome.append(("raised", raised_problem(exc)))

    thread = threading.Thread(target=run, name=f"policy-call-{type(policy).__name__}", daemon=True)
    thread.start()
    thread.join(budget_s)
    if not outcome:
        raise Abandoned(budget_s)
    kind, value = outcome[0]
    if kind == "raised":
        raise PolicyRaised(str(value))
    return value


class PolicyWorkers:
    """The host's `recovery.core.overruns.PolicyCalls`: each third-party policy's calls in its own worker process,
    each within `budget_s`. Workers are killed by `close`, or when this object is collected."""

    def __init__(self, budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._workers: dict[int, tuple[Any, _Worker | None]] = {}  # id(policy) -> (the policy, kept alive; worker)
        self._finalizer = weakref.finalize(self, _close_all, self._workers)

    def _worker(self, policy: Any) -> _Worker | None:
        entry = self._workers.get(id(policy))
        if entry is None:
            try:
                worker: _Worker | None = _Worker(dumps(policy), type(policy).__qualname__)
            except Exception:  # cannot be pickled (a class made inside a function): a thread, not a process
                worker = None
            entry = self._workers[id(policy)] = (policy, worker)
        return entry[1]

    def prepare(self, policy: Any) -> None:
        """Start `policy`'s worker now, not at its first call (a job that names it was accepted)."""
        worker = self._worker(policy)
        if worker is not None:
            worker.launch()

    def call(self, policy: Any, method: str, argument: Any) -> Any:
        worker = self._worker(policy)
        if worker is None:
            return _in_thread(policy, method, argument, self.budget_s)
        return worker.call(method, argument, self.budget_s)

    def workers(self) -> int:
        """Worker processes running now."""
        return sum(1 for _, w in self._workers.values() if w is not None and w.proc is not None
                   and w.proc.poll() is None)

    def close(self) -> None:
        self._finalizer()


def _close_all(workers: dict[int, tuple[Any, _Worker | None]]) -> None:
    for _, worker in workers.values():
        if worker is not None:
            worker.close()
    workers.clear()

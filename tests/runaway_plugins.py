"""Third-party policies that misbehave in ways the policy kit does not catch, for the tests of what the engine and
its hosts do around them. Importable (a worker process loads them by their module), and registered under the
`recovery.policies` entry points by `install_runaway_plugins` for a daemon or a simulator that selects them by name."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from events.values import Granularity
from policies import NS, Reschedule, RescheduleContext, ReschedulingPolicyBase, StartRung

LOOPING = "runaway-looping"
RESTART_EVERY_FAULT = "runaway-restart-every-fault"


class Looping(ReschedulingPolicyBase):
    """`while True:` in `decide`: the call never returns."""

    name: ClassVar[str] = LOOPING
    version: ClassVar[str] = "1"

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        while True:
            pass


class RestartEveryFault(ReschedulingPolicyBase):
    """Restarts the whole job at every fault, whatever happened before: each answer passes the kit."""

    name: ClassVar[str] = RESTART_EVERY_FAULT
    version: ClassVar[str] = "1"

    def decide(self, ctx: RescheduleContext) -> Reschedule:
        return StartRung(Granularity.RESTART_JOB, "restart the whole job", deadline_ns=900 * NS)


def install_runaway_plugins(where: Path) -> Path:
    """A distribution's metadata under `where` whose entry points name these policies: with `where` on the module
    search path (sys.path, PYTHONPATH) the registry finds them as it finds an installed plugin, and nothing is
    installed into the environment."""
    dist = where / "runaway_plugins-1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: runaway-plugins\nVersion: 1\n")
    (dist / "entry_points.txt").write_text(f"[recovery.policies]\n{LOOPING} = tests.runaway_plugins:Looping\n"
                                           f"{RESTART_EVERY_FAULT} = tests.runaway_plugins:RestartEveryFault\n")
    return where

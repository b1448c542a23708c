"""The simulated world: hardware, the training job and the executors, in virtual time.

The world knows nothing of the engine. It emits the events a real cluster would (device probes, node agents,
the platform, executors' acks) through a `sink`, schedules its own future through a `Scheduler`, and carries
out the commands handed to `execute`, each after the duration of the cost model. `recovery.sim.sim.Simulator`
puts the real engine between the two; `recovery.sim.demo.DemoCluster` hands the same events to a daemon in real
time.

Its parts, one concern each: the job's state and its closed-form training (`training.py`), fault injection
(`injection.py`) and the executors (`executors.py`).
"""

from __future__ import annotations

from recovery.sim.executors import Executors
from recovery.sim.injection import FaultInjection
from recovery.sim.training import LINK, Counters, Hardware, Scheduler, Sink, TrainingState


class World(FaultInjection, Executors):
    """The simulated cluster and job: faults go in through `inject`, commands through `execute`."""


__all__ = ["LINK", "Counters", "Hardware", "Scheduler", "Sink", "TrainingState", "World"]

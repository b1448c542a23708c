"""The simulated world: hardware, the training job and the executors, in virtual time.

The world knows nothing of the engine. It emits the events a real cluster would (device probes, node agents,
the platform, executors' acks) through a `sink`, schedules its own future through a `Scheduler`, and carries
out the commands handed to `execute`, each after the duration of the cost model. `recovery.sim.sim.Simulator`
puts the real engine between the two; `recovery.sim.demo.DemoCluster` hands the same events to a daemon in real
time.

Its parts, one concern each: the job's state and its closed-form training (`training.py`), fault injection
(`injection.py`), the executors (`executors.py`) and the nodes' latent bad devices and health checks
(`health.py`).
"""

from __future__ import annotations

from recovery.sim.config import SimConfig
from recovery.sim.executors import Executors
from recovery.sim.injection import FaultInjection
from recovery.sim.training import LINK, Counters, Hardware, Scheduler, Sink, TrainingState


class World(FaultInjection, Executors):
    """The simulated cluster and job: faults go in through `inject`, commands through `execute`."""

    def __init__(self, config: SimConfig, scheduler: Scheduler, sink: Sink, *, start_ns: int) -> None:
        super().__init__(config, scheduler, sink, start_ns=start_ns)
        self.strike = self.inject  # a latent device's fault is injected as the mix's are (the simulator counts it too)


__all__ = ["LINK", "Counters", "Hardware", "Scheduler", "Sink", "TrainingState", "World"]

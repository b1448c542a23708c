"""A discrete-event cluster simulator with the real engine in the loop, and a policy benchmark.

    from recovery.sim import SimConfig, Cluster, simulate
    result = simulate(SimConfig(cluster=Cluster(gpus=1024), days=7, seed=1))
    result.render()

Seeded and deterministic (the same seed gives the same log, byte for byte), in virtual time: training between
faults is closed form, so 54 days of a 16,384-GPU job is a few hundred thousand events. See README.md here for
the fault model and the cost model with the source of every default.
"""

from recovery.sim.accounting import CAUSES, FaultOutcome, Ledger, Result
from recovery.sim.config import PROFILES, Agents, Cluster, Costs, Durations, Profile, SimConfig, Training, profile
from recovery.sim.demo import DemoCluster, demo_cluster
from recovery.sim.faults import Fault, FaultMix, draw_faults, read_trace, write_trace
from recovery.sim.sim import Simulator, faults_for, simulate
from recovery.sim.world import World

__all__ = [
    "CAUSES", "PROFILES", "Agents", "Cluster", "Costs", "DemoCluster", "Durations", "Fault", "FaultMix", "FaultOutcome",
    "Ledger", "Profile", "Result", "SimConfig", "Simulator", "Training", "World", "demo_cluster", "draw_faults",
    "faults_for", "profile", "read_trace", "simulate", "write_trace",
]

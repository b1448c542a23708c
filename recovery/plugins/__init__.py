"""Where third-party policies run: a worker process per plugin, which the host abandons (kills) when a call runs past
its budget (`PolicyWorkers`). The engine learns of it only from the log (`recovery.core.overruns`)."""

from recovery.plugins.workers import DEFAULT_BUDGET_S, START_BUDGET_S, PolicyWorkers

__all__ = ["DEFAULT_BUDGET_S", "START_BUDGET_S", "PolicyWorkers"]

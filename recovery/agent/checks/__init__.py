"""The node's health checks, run before ranks land on it and logged as `node.checked` (`events.health`).

- `runner.py`: `HealthChecks`: every check at once, each within its budget; a passing run answers for
  `check_fresh_s` unless a fault comes; the gate before ranks start (`ready_for`, `gate`).
- `selection.py`: which checks a node runs (`health_check`: auto, on, off).
- `host.py`: `memory`, `disk:<dir>`, and the platform's own commands (`checks`).
- `gpu.py`: `gpu-state` from NVML, and the launchers of `gpu-compute` and `collective`, which run as processes of
  their own (`gpu_compute.py`, `collective.py`: standard library and torch only, so that the agent never imports
  torch; this file imports nothing for them).
- `process.py`: a check's process, killed with its children past the check's budget.
"""

"""Slurm as the scheduler under the control plane: the allocation `recovery-run` runs in (`allocation.py`), the one
door to Slurm's commands (`scontrol.py`) and the executor that carries the engine's node isolations and requeues
into Slurm (`bridge.py`, run as `recovery-slurm`). docs/slurm.md says how a platform deploys it."""

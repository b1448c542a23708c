"""recovery: the fault-recovery control plane for large distributed training jobs."""

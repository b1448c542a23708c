"""The Slurm allocation a process runs in (inside `sbatch` or `salloc`), read from the environment Slurm gives it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from recovery.slurm.scontrol import Scontrol, ScontrolFailed


class AllocationError(Exception):
    """Slurm's environment is there but does not describe a usable allocation."""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: list[str]
    """in Slurm's order, which is the order `srun` gives node ranks in"""
    restarts: int
    """SLURM_RESTART_COUNT: how often the job was requeued (or restarted after a node failure) before this run"""

    @property
    def run_name(self) -> str:
        """A recovery job id for this run of the allocation: one per run, since a requeued batch script submits a new
        recovery job (the one before ended with the run Slurm stopped)."""
        return f"slurm-{self.job_id}" + (f"-r{self.restarts}" if self.restarts else "")


def from_environment(env: Mapping[str, str], scontrol: Scontrol | None = None) -> Allocation | None:
    """The allocation of `env`, or None outside one. Its host list is expanded by `scontrol show hostnames`, as Slurm
    itself expands it (ranges, zero padding, several bracketed parts)."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise AllocationError(f"SLURM_JOB_ID={job_id} but no SLURM_JOB_NODELIST: not inside an allocation's step")
    try:
        nodes = (scontrol or Scontrol()).hostnames(nodelist)
    except (OSError, ScontrolFailed) as exc:
        raise AllocationError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r}: {exc}") from None
    expected = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if expected and expected.isdigit() and int(expected) != len(nodes):
        raise AllocationError(f"SLURM_JOB_NODELIST={nodelist!r} expands to {len(nodes)} node(s), SLURM_NNODES says "
                              f"{expected}")
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Allocation(job_id, nodes, int(restarts) if restarts.isdigit() else 0)

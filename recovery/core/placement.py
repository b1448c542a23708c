"""Placement: which nodes a job may use, and the size it can run at.

The cluster view says which nodes are usable; this part says which of a job's nodes it must vacate, which free
spares it may take (within its quota), where a job-level restart or a scale places it, and the largest
data-parallel size whole nodes can hold.
"""

from __future__ import annotations

from events.values import Granularity, Layout
from recovery.core.cluster import ClusterView
from recovery.core.job import Attempt, Job, dead_ranks

G = Granularity


class Placement:
    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster

    def vacate(self, job: Job) -> list[str]:
        """The job's nodes its ranks cannot stay on, in placement order: among the cluster's impaired nodes and any
        of the job's it never registered (a set difference, at C speed), never by asking each node of a large job."""
        cluster = self.cluster
        leave = {name for name in cluster.impaired() if not cluster.usable_by(name, job.rpn)}
        leave.update(set(job.nodes).difference(cluster.nodes))
        if not leave:
            return []
        return [name for name in job.nodes if name in leave]

    def split_by_reset(self, vacate: list[str]) -> tuple[list[str], dict[str, tuple[int, ...]]]:
        """The nodes to vacate that a device reset would make usable again (only bad devices a reset clears keep them
        out), with those devices, and the rest, which must be left."""
        reset: dict[str, tuple[int, ...]] = {}
        must_move: list[str] = []
        for name in vacate:
            node = self.cluster.nodes.get(name)
            if (node is None or not node.bad_devices or not node.ready or node.drained or node.isolated
                    or node.links_down or not node.bad_devices <= node.resettable):
                must_move.append(name)
            else:
                reset[name] = tuple(sorted(node.bad_devices))
        return must_move, reset

    def reset_clears(self, vacate: list[str]) -> bool:
        """Would a device reset make every node to vacate usable?"""
        must_move, reset = self.split_by_reset(vacate)
        return bool(reset) and not must_move

    def fault_nodes(self, job: Job) -> list[str]:
        """Nodes of the faulty or dead ranks: what a migration moves when no node is unusable."""
        assert job.incident is not None
        ranks = {r for f in job.incident.faults for r in f["ranks"] if r < job.world}
        ranks.update(dead_ranks(job.alive))
        indices = {r // job.rpn for r in ranks}
        return [n for i, n in enumerate(job.nodes) if i in indices]

    def scale_in_dp(self, job: Job, vacate: list[str]) -> int | None:
        elastic = job.spec.elastic
        if elastic is None:
            return None
        # The nodes it keeps and the spares it may take: a job that cannot have its old size runs at the largest size
        # these give, at or above its minimum, rather than wait for the whole of its old size to come back.
        have = len(job.nodes) - len(vacate) + len(self.spares_for(job))
        dp = fit_dp(job.layout, job.rpn, have, elastic.max_dp)
        return dp if dp is not None and elastic.min_dp <= dp < job.layout.dp else None

    def spares_for(self, job: Job) -> list[str]:
        """The free spares this job may take now, in the order they joined: of its pool (`spare_pool` in its spec; the
        shared pool without one), within its quota (`spares`: nodes of the pool it may hold at once beyond its own
        placement), so one job cannot take every spare."""
        free = self.cluster.free_spares(job.spec.spare_pool)
        quota = job.spec.spares
        if quota is None:
            return free
        own = job.own_nodes
        held = sum(1 for name in job.nodes if name not in own)
        return free[:max(0, quota - held)]

    def place(self, job: Job, attempt: Attempt) -> tuple[list[str], int] | None:
        """Nodes and data-parallel size after a job-level restart or scale, off the nodes the attempt vacates."""
        usable = [n for n in job.nodes if self.cluster.usable_by(n, job.rpn) and n not in attempt.vacate]
        spares = self.spares_for(job)
        per_replica = job.layout.per_replica
        if attempt.granularity is G.SCALE_IN:
            dp = attempt.dp or self.scale_in_dp(job, list(attempt.vacate)) or job.layout.dp
            need = dp * per_replica // job.rpn
            # Nodes may have gone since the attempt was planned (or a forced scale-in had no smaller dp):
            # never place the job on fewer nodes than its ranks need.
            if len(usable) + len(spares) < need:
                return None
            return usable[:need] + spares[: max(0, need - len(usable))], dp
        if attempt.granularity is G.SCALE_OUT:
            dp = attempt.dp or job.layout.dp
            need = dp * per_replica // job.rpn
            if len(usable) + len(spares) < need:
                return None
            return usable[:need] + spares[: max(0, need - len(usable))], dp
        need = len(job.nodes)
        if len(usable) + len(spares) < need:
            return None
        return usable + spares[: need - len(usable)], job.layout.dp


    @staticmethod
    def survivors(job: Job, nodes: list[str]) -> dict[int, int]:
        """The processes a scale to `nodes` keeps, old rank -> new rank: each live rank on a node the job keeps, as the
        rank of the same local rank there, if that holds the same shard (a replica spanning nodes may not; with
        `fsdp` every rank's shard changes, and each reshards the state in process). Only for a script that re-forms
        its process group in-process (its ranks said so, `Job.can`): a stock script's processes all start anew."""
        if not job.can("reform"):
            return {}
        shards = 1 if job.layout.fsdp else job.layout.shards
        index = {name: i for i, name in enumerate(job.nodes)}
        kept: dict[int, int] = {}
        for new_index, name in enumerate(nodes):
            old_index = index.get(name)
            if old_index is None:
                continue
            for local in range(job.rpn):
                old, new = old_index * job.rpn + local, new_index * job.rpn + local
                if old < job.world and job.alive[old] and old % shards == new % shards:
                    kept[old] = new
        return kept


def fit_dp(layout: Layout, rpn: int, nodes: int, cap: int) -> int | None:
    """The largest dp <= cap whose ranks fill whole nodes among `nodes`."""
    per_replica = layout.per_replica
    dp = min(cap, nodes * rpn // per_replica)
    while dp >= 1 and (dp * per_replica) % rpn:
        dp -= 1
    return dp if dp >= 1 else None

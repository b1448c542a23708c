"""The control plane on a NATS cluster: three nats-servers routed on loopback, every stream and bucket at three
replicas. The server leading the log stream is SIGKILLed twice under load with faults in flight (its leadership
moves to a peer, and it comes back and catches up), and the daemon once: nothing is lost, no command is doubled,
and the log's decisions are exactly those of an offline replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench.py"


def test_losing_the_log_streams_leader_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    """The soak bench on the cluster (its smoke test too: the bench's figures and its drawing)."""
    png = tmp_path / "soak.png"
    done = subprocess.run([sys.executable, str(BENCH), "soak", "--cluster", "3", "--minutes", "0.45", "--rate", "400",
                           "--step-s", "0.2", "--fault-every-s", "1", "--kill-every-s", "14",
                           "--nats-restart-every-s", "8", "--down-s", "4", "--sample-s", "1", "--warmup-s", "5",
                           "--png", str(png)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    values = {row["metric"]: row["value"] for row in map(orjson.loads, done.stdout.splitlines())}
    assert values["events_published"] > 5_000 and values["commands"] > 0, values
    assert values["nats_restarts"] >= 2 and values["daemon_kills"] >= 1, values
    assert values["events_lost"] == values["commands_doubled"] == 0, values
    assert values["decisions_missing"] == values["decisions_extra"] == 0, values
    assert png.read_bytes().startswith(b"\x89PNG"), done.stderr[-4000:]


def test_the_cluster_places_the_streams_on_every_server(tmp_path: Path) -> None:
    """A daemon with `replicas = 3` on the cluster: its log stream has a leader and two current replicas."""
    import asyncio

    import nats

    from recovery.testing.nats import NatsCluster
    from tests.daemon_support import DaemonProcess

    cluster = NatsCluster(tmp_path / "nats")
    daemon = DaemonProcess(tmp_path / "daemon", cluster.url, lease_ttl_s=0, replicas=3)
    try:
        cluster.start()
        daemon.start()
        daemon.wait_ready()

        async def placement() -> tuple[str | None, list[bool]]:
            nc = await nats.connect(cluster.url.split(","))
            try:
                info = await nc.jetstream().stream_info("RECOVERY")
                assert info.config.num_replicas == 3
                replicas = [bool(r.current) for r in (info.cluster.replicas or [])] if info.cluster else []
                return (info.cluster.leader if info.cluster else None), replicas
            finally:
                await nc.close()

        leader, replicas = asyncio.run(placement())
        assert leader in cluster.names and len(replicas) == 2
        assert cluster.leader_of("RECOVERY") is cluster.servers[cluster.names.index(leader)]
    finally:
        daemon.close()
        cluster.stop()

"""The agent's probes running in the agent: the link state of configured interfaces and NVIDIA XIDs from the kernel
log reach the log as the node's events, and the daemon decides on them.

The last test is a real link fault: a veth pair in a network namespace of its own, the agent running inside the
namespace (the interfaces it watches must be in its own namespace's sysfs) and reaching NATS over a second veth
pair; one end of the first pair goes down and the daemon, on the host, decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from nats.aio.msg import Msg

from events import subjects
from events.codec import encode_envelope
from events.envelope import make_envelope
from recovery.cli.agent import main as agent_main
from recovery.testing.nats import NatsServer
from tests.daemon_support import DaemonProcess
from tests.e2e_support import AgentProcess, connect, submit, wait_until
from tests.test_probes import network_namespace, operstate_in, run_ip

XID_79 = "NVRM: Xid (PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus.\n"


@contextlib.contextmanager
def running(agent: AgentProcess) -> Iterator[AgentProcess]:
    try:
        yield agent
    finally:
        agent.stop()


async def node_events(url: str, node: str) -> tuple[Any, list[dict[str, Any]]]:
    nc = await connect(url)
    seen: list[dict[str, Any]] = []

    async def on_event(msg: Msg) -> None:
        seen.append(orjson.loads(msg.data))

    await nc.subscribe(f"{subjects.PREFIX}.ev.node.{node}.>", cb=on_event)
    return nc, seen


def of(seen: list[dict[str, Any]], type_: str) -> list[dict[str, Any]]:
    return [e for e in seen if e["type"] == type_]


# -- configuration -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "key", "says"), [
    (["--links", "eth0,../etc"], "links", "not a network interface name"),
    (["--kernel-log", "/nonexistent/kmsg", "--gpu-bus-ids", '{"0000:05:00.0": 0}'], "kernel_log", "cannot open"),
    (["--kernel-log", "/dev/null", "--gpu-bus-ids", '{"not-an-address": 0}'], "gpu_bus_ids", ""),
])
def test_a_probe_that_cannot_work_stops_the_agent_at_start_naming_the_key(
        flags: list[str], key: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--node", "n1", *flags]) == 2
    err = capsys.readouterr().err
    assert f"invalid configuration: {key}:" in err and says in err, err


def test_without_nvidia_smi_or_a_map_an_xid_probe_says_how_to_map_the_gpus(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    (tmp_path / "kern.log").write_text("")
    assert agent_main(["--node", "n1", "--kernel-log", str(tmp_path / "kern.log")]) == 2
    err = capsys.readouterr().err
    assert "gpu_bus_ids" in err and "nvidia-smi" in err, err


# -- in the agent --------------------------------------------------------------------------------------------------
async def test_the_agent_reports_link_transitions_and_xids_as_its_nodes_events(
        nats_server: NatsServer, tmp_path: Path) -> None:
    sysfs = tmp_path / "net"
    for name, state in (("ib0", "up"), ("ib1", "down")):
        (sysfs / name).mkdir(parents=True)
        (sysfs / name / "operstate").write_text(f"{state}\n")
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("[  10.000000] NVRM: Xid (PCI:0000:05:00): 48, logged before the agent started\n")
    daemon = DaemonProcess(tmp_path / "daemon", nats_server.url)  # it makes the streams the agent publishes to
    daemon.start()
    nc, seen = await node_events(nats_server.url, "gpu-3")
    flags = ["--links", "ib0,ib1", "--sysfs-net", str(sysfs), "--link-poll-s", "0.05",
             "--kernel-log", str(kernel_log), "--gpu-bus-ids", '{"0000:03:00.0": 0, "0000:05:00.0": 1}',
             "--xid-poll-s", "0.05"]
    try:
        await asyncio.to_thread(daemon.wait_ready)
        with running(AgentProcess(tmp_path / "agent", "gpu-3", nats_server.url, False, *flags)) as agent:
            # the first poll reports the link that is down, and nothing of the one that is up
            await wait_until(lambda: bool(of(seen, "network.link_down")), 30, "ib1 reported down",
                             agent.log_tail)
            assert [e["data"]["link"] for e in of(seen, "network.link_down")] == ["ib1"]
            (sysfs / "ib0" / "operstate").write_text("lowerlayerdown\n")
            (sysfs / "ib1" / "operstate").write_text("up\n")
            await wait_until(lambda: len(of(seen, "network.link_down")) == 2 and bool(of(seen, "network.link_up")),
                             30, "ib0 down and ib1 up", agent.log_tail)
            assert [e["data"]["link"] for e in of(seen, "network.link_down")] == ["ib1", "ib0"]
            assert [e["data"]["link"] for e in of(seen, "network.link_up")] == ["ib1"]
            with kernel_log.open("a") as fh:
                fh.write(f"[ 123.456789] {XID_79}")
            await wait_until(lambda: bool(of(seen, "device.fault")), 30, "the XID as a device fault", agent.log_tail)
            [fault] = of(seen, "device.fault")
            # only what was logged after the agent started; the address is the node's second GPU
            assert fault["node"] == "gpu-3" and fault["data"]["device"] == 1 and fault["data"]["code"] == "79"
            assert fault["data"]["vendor"] == "nvidia" and "fallen off the bus" in fault["data"]["message"]
    finally:
        await nc.close()
        daemon.close()


# -- a real link fault ---------------------------------------------------------------------------------------------
async def test_a_veth_taken_down_in_the_agents_namespace_is_published_and_decided_on(tmp_path: Path) -> None:
    """The agent runs in a network namespace with a veth pair `va`/`vb` and watches `va`; NATS listens on the host
    end of a second pair that connects the namespace to the host. Taking `vb` down takes `va`'s carrier away:
    the agent publishes `network.link_down` for `va`, and the daemon suspects the link of the job on that node."""
    subnet = f"10.231.{random.randrange(1, 255)}"
    host_end = f"vh{random.randrange(16**6):06x}"
    with network_namespace() as netns:
        run_ip("-n", netns, "link", "add", "va", "type", "veth", "peer", "name", "vb", what="cannot make a veth pair")
        for name in ("va", "vb", "lo"):
            run_ip("-n", netns, "link", "set", name, "up", what=f"cannot bring {name} up")
        # the namespace's way to NATS: deleting the namespace deletes `vn`, and with it its host end
        run_ip("link", "add", host_end, "type", "veth", "peer", "name", "vn", "netns", netns,
               what="cannot connect the namespace to the host")
        run_ip("addr", "add", f"{subnet}.1/30", "dev", host_end, what="cannot address the host end")
        run_ip("link", "set", host_end, "up", what="cannot bring the host end up")
        run_ip("-n", netns, "addr", "add", f"{subnet}.2/30", "dev", "vn", what="cannot address the namespace end")
        run_ip("-n", netns, "link", "set", "vn", "up", what="cannot bring the namespace end up")
        server = NatsServer(tmp_path / "nats", host=f"{subnet}.1")
        server.start()
        daemon = DaemonProcess(tmp_path / "daemon", server.url)
        nc, seen = await node_events(server.url, "n-link")
        try:
            daemon.start()
            await asyncio.to_thread(daemon.wait_ready)
            decisions: list[dict[str, Any]] = []

            async def on_decision(msg: Msg) -> None:
                decisions.append(orjson.loads(msg.data)["data"])

            await nc.subscribe(subjects.decision("linked"), cb=on_decision)
            await submit(nc, "linked", {"nodes": ["n-link"], "ranks_per_node": 2, "layout": {"dp": 2}})
            # the job runs (started by whatever launched it: it has no entrypoint for the agent to launch)
            started = make_envelope("job.started", {}, id="linked:started", job="linked", source="test")
            await nc.jetstream().publish(subjects.job_event("linked", "job.started"), encode_envelope(started),
                                         headers={"Nats-Msg-Id": started.id})
            with running(AgentProcess(tmp_path / "agent", "n-link", server.url, False, "--links", "va",
                                      "--link-poll-s", "0.05", namespace=netns)) as agent:
                await wait_until(lambda: bool(of(seen, "node.ready")), 60, "the agent in the namespace ready",
                                 agent.log_tail)
                await wait_until(lambda: any(d["kind"] == "job.started" for d in decisions), 60, "the job running",
                                 daemon.log_tail)
                run_ip("-n", netns, "link", "set", "vb", "down", what="cannot take vb down")
                await wait_until(lambda: operstate_in(netns, "va") != "up", 10, "va without its peer")
                await wait_until(lambda: bool(of(seen, "network.link_down")), 30, "va reported down", agent.log_tail)
                assert [e["data"]["link"] for e in of(seen, "network.link_down")] == ["va"]
                await wait_until(lambda: any(d["kind"] == "fault.suspected" for d in decisions), 30,
                                 "the daemon's decision", daemon.log_tail)
                [suspected] = [d for d in decisions if d["kind"] == "fault.suspected"]
                assert suspected["reason"] == "link va down on n-link" and suspected["detail"]["ranks"] == [0, 1]
        finally:
            await nc.close()
            daemon.close()
            server.stop()

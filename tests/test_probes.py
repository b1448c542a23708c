"""The node agent's hardware probes: NVIDIA XIDs from the kernel log, and link state from sysfs, down to a real
veth pair in a network namespace of its own."""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from events.envelope import make_envelope
from events.kinds import DeviceFault, LinkDown, LinkUp
from recovery.agent.probes import xid
from recovery.agent.probes.links import LinkChange, LinkWatcher, is_up
from recovery.agent.probes.xid import (
    PciAddress,
    XidError,
    XidFault,
    XidFollower,
    parse_nvidia_smi_bus_ids,
    parse_xid,
)
from recovery.testing.scenario import Scenario

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

NVIDIA_SMI = """\
0, 00000000:05:00.0
1, 00000000:1B:00.0
2, 00000000:3B:00.0
3, 00000000:CB:00.0
4, 00000001:01:00.0
5, 00000000:03:00.0
6, 00000000:01:00.0
7, 00000000:00:05.0
"""
"""`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` on an 8-GPU node: an 8-digit domain,
upper-case hex, and (GPU 7, as on some clouds' virtual machines) a GPU at device 05 of bus 00"""
DEVICES = parse_nvidia_smi_bus_ids(NVIDIA_SMI)

# Lines as drivers printed them (taken from bug reports and vendors' parsers, PCI addresses moved onto this node).
OLDEST = "NVRM: Xid (0000:03:00): 13, 0003 00000000 00008297 00001098 00000000 00000044"
WITH_PID = "NVRM: Xid (PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus."
NO_PID = "NVRM: Xid (PCI:0000:05:00): 79, GPU has fallen off the bus."
NEWEST = ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
          "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")
NEWEST_NAMED = ("NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX "
                "SWITCH TIMEOUT, Info 0x58005")
NEWEST_ECC = "NVRM: Xid (PCI:0000:00:05): 94, pid='<unknown>', name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No"
NVLINK = ("NVRM: Xid (PCI:0001:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 "
          "0x00000000 0x00000000 0x00000000)")


def wait_for(condition: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """The condition's first truthy value, checked until a deadline; failing names what never happened."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout_s} s still waiting for {what}")
        time.sleep(0.01)


def fault(line: str) -> XidFault:
    parsed = parse_xid(line, DEVICES)
    assert isinstance(parsed, XidFault), parsed
    return parsed


# -- XID lines -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "device", "code", "pid", "process"), [
    (OLDEST, 5, "13", None, None),
    (WITH_PID, 0, "79", 1173, None),
    (NO_PID, 0, "79", None, None),
    (NEWEST, 3, "13", None, None),
    (NEWEST_NAMED, 3, "109", 1797828, "pt_main_thread"),
    (NEWEST_ECC, 7, "94", None, None),
    (NVLINK, 4, "149", None, None),
], ids=["oldest", "pci-pid", "pci-no-pid", "newest-unknown-pid", "newest-named", "newest-bus-00", "nvlink-domain-1"])
def test_every_driver_format_is_a_device_fault_on_the_gpu_at_its_address(
        line: str, device: int, code: str, pid: int | None, process: str | None) -> None:
    found = fault(line)
    assert (found.event.device, found.event.code, found.pid, found.process) == (device, code, pid, process)
    assert found.event.vendor == "nvidia" and found.event.message == line and found.event.severity is None
    assert found.type == "device.fault"
    assert DeviceFault.model_validate(found.data()) == found.event
    envelope = make_envelope(found.type, found.data(), id="xid-1", node="n0", source="agent")
    assert envelope.data == found.event


def test_a_kmsg_record_prefix_gives_the_sequence_and_the_time_since_boot() -> None:
    found = fault(f"6,1234,5678,-;{WITH_PID}")
    assert (found.sequence, found.uptime_s, found.event.code, found.event.message) == (1234, 0.005678, "79", WITH_PID)
    # more fields may come before the ';' (the kernel's documentation says to ignore them), or none but three
    assert fault(f"4,9921,9370042162,-,caller=T1;{NEWEST}").sequence == 9921
    assert fault(f"3,42,2000001;{NO_PID}").sequence == 42


@pytest.mark.parametrize(("prefix", "uptime_s"), [
    ("[ 1843.308145] ", 1843.308145),
    ("[176830.774761] ", 176830.774761),
    ("[Fri Aug 30 11:43:09 2024] ", None),  # dmesg -T
    ("May 10 22:25:01 jambi kernel: [176830.774761] ", 176830.774761),
    ("Feb 14 05:03:41 gpu-1 kernel: ", None),  # journalctl -k
    ("<4>[12345.678901] ", 12345.678901),
])
def test_dmesg_and_syslog_framing_is_read_through(prefix: str, uptime_s: float | None) -> None:
    found = fault(prefix + NEWEST)
    assert (found.event.device, found.event.code, found.uptime_s, found.sequence) == (3, "13", uptime_s, None)
    assert found.event.message == NEWEST


def test_an_xid_on_an_address_that_is_no_gpu_of_this_node_is_reported_not_raised() -> None:
    line = "[ 12.5] NVRM: Xid (PCI:0000:99:00): 79, pid=1, GPU has fallen off the bus."
    error = parse_xid(line, DEVICES)
    assert isinstance(error, XidError) and error.line == line
    assert "0000:99:00.0 is not a GPU of this node" in error.reason
    error = parse_xid(WITH_PID, {})
    assert isinstance(error, XidError) and "(known: none)" in error.reason


@pytest.mark.parametrize("line", [
    "NVRM: Xid",
    "NVRM: Xid (PCI:0000:05:00): GPU has fallen off the bus.",  # no code
    "NVRM: Xid (PCI:0000:05:00) 79, GPU has fallen off the bus.",  # no colon after the address
    "NVRM: Xid (PCI:0000:zz:00): 79, GPU has fallen off the bus.",  # not hexadecimal
    "NVRM: Xid (PCI:0000:05:20): 79, GPU has fallen off the bus.",  # device above 0x1f
    "NVRM: Xid (PCI:0000:05:00): 79 GPU has fallen off the bus.",  # no comma after the code
    "6,1,2,-;NVRM: Xid (): 13, Graphics Exception",
])
def test_a_malformed_xid_line_is_an_error_value(line: str) -> None:
    error = parse_xid(line, DEVICES)
    assert isinstance(error, XidError) and error.line == line and error.reason


def test_a_device_index_beyond_the_wire_bounds_is_an_error_value() -> None:
    error = parse_xid(WITH_PID, {PciAddress(0, 5, 0): 5000})
    assert isinstance(error, XidError) and "not a valid device.fault" in error.reason


@pytest.mark.parametrize("line", [
    "6,1000,100,-;usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
    "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
    "NVRM: GPU at PCI:0000:00:05: GPU-efbdfde9-5798-a6e7-4c46-12518fa15375",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024",
    "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 12028, Non-fatal, Link 31 egress non-posted PRIV error",
    " SUBSYSTEM=pci",
    "",
])
def test_lines_that_are_not_xids_are_ignored(line: str) -> None:
    assert parse_xid(line, DEVICES) is None


def test_control_characters_in_a_line_are_escaped_so_the_message_is_valid_text() -> None:
    found = fault("NVRM: Xid (0000:03:00): 13, Graphics \x1b[2J Exception\x00\r\n")
    assert found.event.message == "NVRM: Xid (0000:03:00): 13, Graphics \\x1b[2J Exception\\x00"
    assert DeviceFault.model_validate(found.data()) == found.event


def test_the_engine_decides_on_a_parsed_xid() -> None:
    """XID 79 needs the node power-cycled: the job's ranks leave it, as for the simulator's XIDs."""
    s = Scenario()
    s.spare("s0")
    s.submit("j", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("j", 5)
    s.checkpoint("j", 5, "storage", "storage")
    found = fault(f"6,1234,5678,-;{WITH_PID}")
    s.node_event("n1", found.type, **found.data())
    [confirmed] = s.find("fault.confirmed", "j")
    assert confirmed.detail["fault"]["class"] == "node"


# -- PCI addresses and nvidia-smi ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "0000:cb:00", "PCI:0000:cb:00", "pci:0000:CB:00", "cb:00", "cb:00.0", "0000:cb:00.0", "00000000:CB:00.0",
    " 0000:cb:00.0 ",
])
def test_a_pci_address_is_the_same_with_or_without_domain_function_or_prefix_in_any_case(text: str) -> None:
    assert PciAddress.parse(text) == PciAddress(0, 0xCB, 0, 0)
    assert str(PciAddress.parse(text)) == "0000:cb:00.0"


@pytest.mark.parametrize("text", ["", "cb", "0000:cb", "0000:cb:00.8", "0000:cb:20", "0000:cb:00:00", "g0:00"])
def test_what_is_not_a_pci_address_raises(text: str) -> None:
    with pytest.raises(ValueError, match="not a PCI address"):
        PciAddress.parse(text)


def test_nvidia_smi_bus_ids_map_every_address_to_its_index() -> None:
    expected = {
        PciAddress(0, 0x05, 0): 0, PciAddress(0, 0x1B, 0): 1, PciAddress(0, 0x3B, 0): 2, PciAddress(0, 0xCB, 0): 3,
        PciAddress(1, 0x01, 0): 4, PciAddress(0, 0x03, 0): 5, PciAddress(0, 0x01, 0): 6, PciAddress(0, 0x00, 5): 7,
    }
    assert parse_nvidia_smi_bus_ids(NVIDIA_SMI) == expected
    assert parse_nvidia_smi_bus_ids("index, pci.bus_id\n0, 00000000:01:00.0\n\n") == {PciAddress(0, 1, 0): 0}
    assert parse_nvidia_smi_bus_ids("No devices were found\n") == {}


@pytest.mark.parametrize(("text", "message"), [
    ("0 00000000:01:00.0\n", "line 1 is not 'index, pci.bus_id'"),
    ("GPU 0, 00000000:01:00.0\n", "line 1 is not 'index, pci.bus_id'"),
    ("0, 00000000:01:00.0\n1, [N/A]\n", "not a PCI address"),
    ("0, 00000000:01:00.0\n1, 00000000:01:00.0\n", "line 2: 0000:01:00.0 is listed twice"),
    ("0, 00000000:01:00.0\n0, 00000000:02:00.0\n", "line 2: index 0 is listed twice"),
])
def test_nvidia_smi_output_that_cannot_be_read_raises_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_nvidia_smi_bus_ids(text)


# -- following the kernel log ----------------------------------------------------------------------------------
def append(path: Path, text: str) -> None:
    with path.open("a") as log:
        log.write(text)


def test_the_follower_yields_xids_appended_to_a_file_while_it_follows(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"[ 1.0] {OLDEST}\n")  # written before the follower opened it: not read
    found: queue.Queue[XidFault | XidError] = queue.Queue()
    stop = threading.Event()
    follower = XidFollower(DEVICES, log)  # opened here, at the file's end: what is appended from now on is read

    def follow() -> None:
        with follower:
            for item in follower.follow(stop, interval_s=0.01):
                found.put(item)

    thread = threading.Thread(target=follow, daemon=True)
    try:
        thread.start()
        append(log, f"[ 3.0] usb 1-1: new device\n[ 3.1] {WITH_PID}\n[ 3.2] NVRM: Xid (PCI:0000:99:00): 79, x\n")
        append(log, f"6,77,4000000,-;{NEWEST[:40]}")  # half a line: held back until its newline comes
        first, second = found.get(timeout=10), found.get(timeout=10)
        assert isinstance(first, XidFault) and first.pid == 1173 and first.uptime_s == 3.1
        assert isinstance(second, XidError) and "0000:99:00.0" in second.reason
        append(log, f"{NEWEST[40:]}\n")
        third = found.get(timeout=10)
        assert isinstance(third, XidFault) and third.event.message == NEWEST and third.sequence == 77
        assert found.empty()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_follower_reads_from_the_start_when_asked_and_survives_truncation_and_rotation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"{OLDEST}\n")
    with XidFollower(DEVICES, log, from_start=True) as follower:
        assert [f.event.code for f in follower.read() if isinstance(f, XidFault)] == ["13"]
        assert follower.read() == []
        log.write_text(f"{NO_PID}\n")  # truncated in place, then written: shorter than what was read
        assert [f.event.code for f in follower.read() if isinstance(f, XidFault)] == ["79"]
        append(log, f"{NEWEST_NAMED[:30]}")
        log.rename(tmp_path / "kern.log.1")
        append(tmp_path / "kern.log.1", f"{NEWEST_NAMED[30:]}\n")  # the rest lands in the rotated file
        log.write_text(f"{NEWEST_ECC}\n")
        assert [f.event.code for f in follower.read() if isinstance(f, XidFault)] == ["109", "94"]


def test_the_follower_skips_kmsg_records_up_to_a_sequence_it_already_reported(tmp_path: Path) -> None:
    log = tmp_path / "kmsg.txt"
    log.write_text("".join(f"6,{n},{n}000,-;{NO_PID}\n" for n in range(10, 14)) + "6,11,1,-;NVRM: Xid bad\n")
    with XidFollower(DEVICES, log, from_start=True, after_sequence=11) as follower:
        found = follower.read()
        assert [f.sequence for f in found if isinstance(f, XidFault)] == [12, 13] and len(found) == 2


def test_the_follower_goes_on_after_records_were_overwritten_and_counts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/kmsg gives one record per read(); EPIPE says records were overwritten, and the next read() goes on
    from the oldest one left. Here a read() that behaves so stands in for the kernel's."""
    device = tmp_path / "kmsg"
    device.write_text("")
    script: list[bytes | OSError] = [
        f"6,100,1000,-;{NO_PID}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:05:00.0\n".encode(),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
        f"4,105,2000,-;{NEWEST}\n".encode(),
        b"6,106,2001,-;eth0: link becomes ready\n",
        BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"),
    ]
    real_read = os.read
    with XidFollower(DEVICES, device, records=True) as follower:
        def kernel_read(fd: int, size: int) -> bytes:
            if fd != follower._fd:
                return real_read(fd, size)
            assert size >= 8192, "a read() of /dev/kmsg must hold a whole record"
            step = script.pop(0)
            if isinstance(step, OSError):
                raise step
            return step

        monkeypatch.setattr(os, "read", kernel_read)
        found = follower.read()
        monkeypatch.undo()
    assert [(f.sequence, f.event.code) for f in found if isinstance(f, XidFault)] == [(100, "79"), (105, "13")]
    assert follower.lost == 4 and script == []


def test_the_follower_reads_the_real_kernel_log_record_by_record() -> None:
    """Read only: every record of this machine's /dev/kmsg comes through whole, and parsing none of them raises."""
    if not os.access(xid.KMSG, os.R_OK):
        pytest.fail(f"{xid.KMSG} is not readable here: this test reads the real kernel log and needs root (the "
                    "agent's XID probe does too)")
    with XidFollower({}, from_start=True) as follower:
        assert follower.records
        lines = follower.read_lines()
        assert lines and all(xid._KMSG_PREFIX.match(line) for line in lines), lines[:3]
        follower.read()
    with XidFollower({}) as follower:  # from the end: nothing old
        assert all(int(line.split(",")[1]) > int(lines[-1].split(",")[1]) for line in follower.read_lines())


# -- links -----------------------------------------------------------------------------------------------------
def set_operstate(root: Path, interface: str, state: str | None) -> None:
    folder = root / interface
    if state is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "operstate").write_text(state + "\n")


def described(changes: list[LinkChange]) -> list[tuple[str, str, str]]:
    for change in changes:
        model = LinkDown if change.type == "network.link_down" else LinkUp
        assert model.model_validate(change.data()) == change.event
        assert make_envelope(change.type, change.data(), id="link-1", node="n0").data == change.event
    return [(change.type.removeprefix("network."), change.event.link, change.operstate) for change in changes]


def test_the_first_poll_reports_the_links_that_are_down_and_later_polls_only_transitions(tmp_path: Path) -> None:
    for name, state in [("eth0", "up"), ("ib0", "down"), ("lo", "unknown"), ("ib1", "up")]:
        set_operstate(tmp_path, name, state)
    watcher = LinkWatcher(["eth0", "ib0", "lo", "ib1", "ib9"], root=tmp_path)
    assert described(watcher.poll()) == [("link_down", "ib0", "down"), ("link_down", "ib9", "missing")]
    assert watcher.poll() == []
    set_operstate(tmp_path, "eth0", "lowerlayerdown")
    set_operstate(tmp_path, "ib0", "up")
    set_operstate(tmp_path, "ib9", "up")  # the missing interface appears
    assert described(watcher.poll()) == [("link_down", "eth0", "lowerlayerdown"), ("link_up", "ib0", "up"),
                                         ("link_up", "ib9", "up")]
    set_operstate(tmp_path, "eth0", "down")  # down to down: no news
    set_operstate(tmp_path, "ib1", None)  # the interface disappears
    assert described(watcher.poll()) == [("link_down", "ib1", "missing")]
    assert watcher.up == {"eth0": False, "ib0": True, "lo": True, "ib1": False, "ib9": True}


@pytest.mark.parametrize(("operstate", "up"), [
    ("up", True), ("unknown", True), ("down", False), ("lowerlayerdown", False), ("dormant", False),
    ("notpresent", False), ("testing", False), ("missing", False), ("", False), ("UP", False),
])
def test_which_operstates_count_as_up(operstate: str, up: bool) -> None:
    assert is_up(operstate) is up


def test_an_empty_operstate_file_counts_as_missing(tmp_path: Path) -> None:
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "operstate").write_text("")
    assert described(LinkWatcher(["eth0"], root=tmp_path).poll()) == [("link_down", "eth0", "missing")]


@pytest.mark.parametrize("name", ["", "..", "eth0/../../etc", "eth\n0"])
def test_a_name_that_cannot_be_an_interface_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a network interface name"):
        LinkWatcher([name])


# -- a real link fault -----------------------------------------------------------------------------------------
def run_ip(*args: str, what: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"{what}: `ip {' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@contextmanager
def network_namespace() -> Iterator[str]:
    """A network namespace of its own (needs root and iproute2; .ci/run installs iproute2), deleted at teardown
    with everything in it. A machine that cannot make one fails the test, saying why."""
    if shutil.which("ip") is None:
        pytest.fail("no `ip` binary (iproute2) on PATH: this test needs it to make a network namespace and a veth "
                    "pair; .ci/run installs it with apt-get")
    name = f"recovery-probes-{uuid.uuid4().hex[:8]}"
    run_ip("netns", "add", name, what="cannot make a network namespace (this test needs root)")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


WATCH_IN_NAMESPACE = """
import json, sys, time
from recovery.agent.probes.links import LinkWatcher
watcher = LinkWatcher(sys.argv[1:])
print(json.dumps({"ready": watcher.poll() == []}), flush=True)
while True:
    for change in watcher.poll():
        print(json.dumps({"type": change.type, "data": change.data(), "operstate": change.operstate}), flush=True)
    time.sleep(0.01)
"""


class WatcherProcess:
    """The link watcher polling in its own process inside the namespace, its reports read from its stdout."""

    def __init__(self, namespace: str, interfaces: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", WATCH_IN_NAMESPACE, *interfaces],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def next(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            return dict(json.loads(self.lines.get(timeout=timeout_s)))
        except queue.Empty:
            stderr = ""
            if self.process.poll() is not None and self.process.stderr is not None:
                stderr = self.process.stderr.read()
            pytest.fail(f"after {timeout_s} s the watcher in the namespace reported no {what} "
                        f"(exit status {self.process.poll()}) {stderr}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def operstate_in(namespace: str, interface: str) -> str:
    """What the namespace's own sysfs says: `ip netns exec` mounts a sysfs of the namespace for the command."""
    return subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/operstate"],
                          capture_output=True, text=True, timeout=30).stdout.strip()


def test_a_veth_whose_peer_goes_down_is_reported_down_then_up_by_a_watcher_in_its_namespace() -> None:
    """Both ends of a veth pair live in a namespace of their own, so the host's links are never touched. The
    watcher runs inside the namespace (`ip netns exec`), because /sys/class/net shows the interfaces of the
    namespace sysfs was mounted in, and `ip netns exec` mounts one for the namespace; the test process's own
    /sys/class/net would show the host's. Taking the peer `vb` down is the fault as the watched end `va` sees
    a pulled cable or a dead switch port: no carrier, `lowerlayerdown`."""
    with network_namespace() as netns:
        run_ip("-n", netns, "link", "add", "va", "type", "veth", "peer", "name", "vb", what="cannot make a veth pair")
        run_ip("-n", netns, "link", "set", "va", "up", what="cannot bring va up")
        run_ip("-n", netns, "link", "set", "vb", "up", what="cannot bring vb up")
        wait_for(lambda: operstate_in(netns, "va") == operstate_in(netns, "vb") == "up", 10, "both veth ends up")
        assert not Path("/sys/class/net/va").exists(), "this process's /sys/class/net shows the host's interfaces"
        watcher = WatcherProcess(netns, ["va", "vb"])
        try:
            assert watcher.next(30, "start") == {"ready": True}  # both up at the first poll: nothing to report

            run_ip("-n", netns, "link", "set", "vb", "down", what="cannot take vb down")
            down = [watcher.next(10, "link_down"), watcher.next(10, "second link_down")]
            assert sorted((d["type"], d["data"]["link"], d["operstate"]) for d in down) == [
                ("network.link_down", "va", "lowerlayerdown"), ("network.link_down", "vb", "down")]

            run_ip("-n", netns, "link", "set", "vb", "up", what="cannot bring vb up again")
            up = [watcher.next(10, "link_up"), watcher.next(10, "second link_up")]
            assert sorted((u["type"], u["data"]["link"], u["operstate"]) for u in up) == [
                ("network.link_up", "va", "up"), ("network.link_up", "vb", "up")]
        finally:
            watcher.stop()

    # what the watcher reported is what the engine decides on: the link down on the job's node is a suspected fault
    s = Scenario()
    s.submit("j", ["n0", "n1"], ranks_per_node=4, dp=8)
    s.train("j", 5)
    report = next(d for d in down if d["data"]["link"] == "va")
    s.node_event("n1", report["type"], **LinkDown.model_validate(report["data"]).model_dump())
    assert s.kinds("j")[-1] == "fault.suspected"

"""NVIDIA XIDs from the kernel log, as `device.fault` events.

The driver has printed an XID in three shapes over the years (real lines):

    NVRM: Xid (0000:03:00): 13, 0003 00000000 00008297 00001098 00000000 00000044
    NVRM: Xid (PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, ...

and, in the newest shape, `pid=1797828, name=pt_main_thread, ...` when the process is known. A line reaches the
parser with whatever framing its reader added: a `/dev/kmsg` record prefix (`6,1234,5678,-;`), dmesg's
`[ 123.456]` or `[Fri Aug 30 11:43:09 2024]`, a syslog or journal prefix (`May 10 22:25:01 host kernel: `). So the
parser looks for `NVRM: Xid` anywhere in a line; a line without it is not an XID and is ignored, and a line with
it that does not read as one of the shapes, or names a PCI address that is not a GPU of this node, is an
`XidError`, returned, never raised.

The address in the line is the GPU's PCI bus and device (`domain:bus:device`, function 0); the node's device
index for it comes from a mapping the caller supplies, on a real node read from
`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` (`parse_nvidia_smi_bus_ids`).

The probe reports the fact only: the event's `code` is the XID number and its `message` the driver's own line;
how serious an XID is (`policies.codes.nvidia_xid`) is the detection policy's call, so `severity` stays unset.
"""

from __future__ import annotations

import errno
import os
import re
import select
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from pydantic import ValidationError

from events.kinds import DeviceFault

KMSG = "/dev/kmsg"
KMSG_RECORD_BYTES = 16384
"""a read() of /dev/kmsg returns one whole record, and fails with EINVAL if the buffer cannot hold it; records
are at most 8 KiB (the kernel's CONSOLE_EXT_LOG_MAX)"""

_PCI = re.compile(
    r"(?:PCI:)?(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})(?:\.(?P<function>[0-7]))?",
    re.IGNORECASE,
)
_KMSG_PREFIX = re.compile(r"(?P<priority>\d+),(?P<sequence>\d+),(?P<usec>\d+)(?:,[^;]*)?;")
"""priority, sequence, microseconds since boot, flags and any later fields; the text follows the ';'"""
_DMESG_TIME = re.compile(r"\[\s*(?P<seconds>\d+\.\d+)\]")
_MARK = "NVRM: Xid"
_XID = re.compile(r"NVRM: Xid\s*\(\s*(?P<address>[^()]*?)\s*\):\s*(?P<code>\d+)\s*(?:,\s*(?P<rest>.*?))?\s*")
_PID = re.compile(r"pid=(?:(?P<pid>\d+)|'?<unknown>'?)\s*(?:,\s*|$)")
_NAME = re.compile(r"name=(?P<name>[^,]*?)\s*(?:,\s*|$)")
_TEXT_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_NO_DEVICES = "no devices were found"


class PciAddress(NamedTuple):
    """A PCI function's address. XID lines name the GPU's bus and device (`0000:05:00`), nvidia-smi the whole
    address with an 8-digit domain (`00000000:05:00.0`): both parse to the same value."""

    domain: int
    bus: int
    device: int
    function: int = 0

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """`[PCI:][domain:]bus:device[.function]` in hexadecimal, any case; the domain and function default to 0.
        Raises ValueError for anything else."""
        match = _PCI.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not a PCI address: {text!r}")
        device = int(match["device"], 16)
        if device > 0x1F:
            raise ValueError(f"not a PCI address: {text!r} (device {device:#x} is above 0x1f)")
        return cls(int(match["domain"] or "0", 16), int(match["bus"], 16), device, int(match["function"] or "0"))

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function}"


def parse_nvidia_smi_bus_ids(text: str) -> dict[PciAddress, int]:
    """The node's GPUs by PCI address, from the output of
    `nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` (lines like `0, 00000000:1B:00.0`).

    "No devices were found" is an empty mapping; a header line is skipped. A line that is not an index and an
    address, or an index or address given twice, raises ValueError naming the line.
    """
    found: dict[PciAddress, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.casefold() == _NO_DEVICES or line.replace(" ", "").casefold() == "index,pci.bus_id":
            continue
        index_text, comma, address_text = line.partition(",")
        if not comma or not index_text.strip().isdigit():
            raise ValueError(f"nvidia-smi line {number} is not 'index, pci.bus_id': {raw!r}")
        address = PciAddress.parse(address_text)
        index = int(index_text)
        if address in found:
            raise ValueError(f"nvidia-smi line {number}: {address} is listed twice")
        if index in found.values():
            raise ValueError(f"nvidia-smi line {number}: index {index} is listed twice")
        found[address] = index
    return found


@dataclass(frozen=True, slots=True)
class XidFault:
    """An XID on one of the node's GPUs: the `device.fault` event and what else the line said."""

    type: ClassVar[str] = "device.fault"

    event: DeviceFault
    address: PciAddress
    pid: int | None = None
    """the process the driver blamed, when it named one"""
    process: str | None = None
    sequence: int | None = None
    """the /dev/kmsg record's sequence number (unique per boot), when the line had that prefix"""
    uptime_s: float | None = None
    """when the kernel logged it, in seconds since boot (from the kmsg prefix or dmesg's timestamp)"""

    def data(self) -> dict[str, Any]:
        """The event's `data` as it goes on the wire."""
        return self.event.model_dump(mode="json")


@dataclass(frozen=True, slots=True)
class XidError:
    """A line that names an XID but could not be turned into a device fault, and why."""

    line: str
    reason: str


def parse_xid(line: str, devices: Mapping[PciAddress, int]) -> XidFault | XidError | None:
    """The XID a kernel-log line reports, on the device `devices` maps its PCI address to; None for a line that
    is no XID; an XidError for one that names an XID but is malformed or names an unknown address."""
    start = line.find(_MARK)
    if start < 0:
        return None
    line = line.rstrip("\r\n")
    text = line[start:]
    match = _XID.fullmatch(text)
    if match is None:
        return XidError(line, "an NVRM: Xid line without '(address): code'")
    try:
        address = PciAddress.parse(match["address"])
    except ValueError as error:
        return XidError(line, str(error))
    device = devices.get(address)
    if device is None:
        known = ", ".join(str(a) for a in sorted(devices)) or "none"
        return XidError(line, f"PCI address {address} is not a GPU of this node (known: {known})")
    pid, process = _blamed_process(match["rest"] or "")
    sequence, uptime_s = _when(line[:start])
    message = _TEXT_CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    try:
        event = DeviceFault(device=device, vendor="nvidia", code=str(int(match["code"])), message=message)
    except ValidationError as error:
        return XidError(line, f"not a valid device.fault: {error.errors()[0]['msg']}")
    return XidFault(event, address, pid, process, sequence, uptime_s)


def _blamed_process(rest: str) -> tuple[int | None, str | None]:
    pid: int | None = None
    process: str | None = None
    found = _PID.match(rest)
    if found is not None:
        pid = int(found["pid"]) if found["pid"] else None
        rest = rest[found.end():]
        named = _NAME.match(rest)
        if named is not None and named["name"] not in ("<unknown>", "'<unknown>'", ""):
            process = named["name"]
    return pid, process


def _when(prefix: str) -> tuple[int | None, float | None]:
    kmsg = _KMSG_PREFIX.match(prefix)
    if kmsg is not None:
        return int(kmsg["sequence"]), int(kmsg["usec"]) / 1e6
    dmesg = _DMESG_TIME.search(prefix)
    return None, (float(dmesg["seconds"]) if dmesg is not None else None)


class XidFollower:
    """Follows the kernel log and parses the XIDs appended to it.

    On `/dev/kmsg` (any character device) every read() returns one record; when the kernel overwrote records
    before they were read, read() fails once with EPIPE and the next read() goes on from the oldest record left:
    the follower goes on too and counts what it missed in `lost` (from the gaps in the records' sequence
    numbers). On a regular file it reads appended lines, holding back a line until its newline is written; a file
    truncated in place is read again from its start, and one replaced under its name (rotated) is reopened.

    By default only what is logged after opening is read (`from_start=False`); `after_sequence` skips kmsg
    records up to and including that sequence number, so an agent that restarts can go on where it stopped.
    """

    def __init__(
        self,
        devices: Mapping[PciAddress, int],
        path: str | os.PathLike[str] = KMSG,
        *,
        from_start: bool = False,
        after_sequence: int | None = None,
        records: bool | None = None,
    ) -> None:
        """`records`: read one record per read() as /dev/kmsg requires (None: when `path` is a character device)."""
        self.devices = dict(devices)
        self.path = os.fspath(path)
        self.after_sequence = after_sequence
        self.lost = 0
        """kmsg records overwritten before they were read"""
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        info = os.fstat(self._fd)
        self.records = stat.S_ISCHR(info.st_mode) if records is None else records
        self._inode = (info.st_dev, info.st_ino)
        self._offset = 0
        self._partial = b""
        self._last_sequence: int | None = None
        if not from_start:
            self._offset = os.lseek(self._fd, 0, os.SEEK_END)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> XidFollower:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def read(self) -> list[XidFault | XidError]:
        """The XIDs (and malformed XID lines) logged since the last read, without waiting."""
        found: list[XidFault | XidError] = []
        for line in self.read_lines():
            if self.after_sequence is not None:
                prefix = _KMSG_PREFIX.match(line)
                if prefix is not None and int(prefix["sequence"]) <= self.after_sequence:
                    continue
            parsed = parse_xid(line, self.devices)
            if parsed is not None:
                found.append(parsed)
        return found

    def read_lines(self) -> list[str]:
        """Every complete line (kmsg: every record's text line, with its prefix) logged since the last read."""
        return self._read_records() if self.records else self._read_appended()

    def wait(self, timeout_s: float) -> None:
        """Return when more may have been logged, or after `timeout_s`. A character device says when it has a
        record; a regular file cannot, so this waits the whole timeout."""
        if self.records:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            poller.poll(max(0, int(timeout_s * 1000)))
        else:
            time.sleep(timeout_s)

    def follow(self, stop: threading.Event, interval_s: float = 0.5) -> Iterator[XidFault | XidError]:
        """Yield XIDs as they are logged until `stop` is set (noticed within `interval_s`)."""
        while not stop.is_set():
            found = self.read()
            yield from found
            if not found:
                if self.records:
                    self.wait(interval_s)
                else:
                    stop.wait(interval_s)

    # -- /dev/kmsg -----------------------------------------------------------------------------------------------
    def _read_records(self) -> list[str]:
        lines: list[str] = []
        while True:
            try:
                record = os.read(self._fd, KMSG_RECORD_BYTES)
            except BlockingIOError:
                return lines
            except BrokenPipeError:
                continue  # records were overwritten; the next read() returns the oldest one left
            except OSError as error:
                if error.errno == errno.EINTR:
                    continue
                raise
            if not record:
                return lines
            # the first line is the record; lines after it that start with a space are its key=value dictionary
            line = record.split(b"\n", 1)[0].decode("utf-8", errors="backslashreplace")
            self._count_lost(line)
            lines.append(line)

    def _count_lost(self, line: str) -> None:
        prefix = _KMSG_PREFIX.match(line)
        if prefix is None:
            return
        sequence = int(prefix["sequence"])
        if self._last_sequence is not None and sequence > self._last_sequence + 1:
            self.lost += sequence - self._last_sequence - 1
        self._last_sequence = sequence

    # -- a regular file ------------------------------------------------------------------------------------------
    def _read_appended(self) -> list[str]:
        self._follow_rotation()
        if os.fstat(self._fd).st_size < self._offset:  # truncated in place: read it again from the start
            self._offset = 0
            self._partial = b""
        os.lseek(self._fd, self._offset, os.SEEK_SET)
        chunks = [self._partial]
        while chunk := os.read(self._fd, 1 << 16):
            chunks.append(chunk)
            self._offset += len(chunk)
        *complete, self._partial = b"".join(chunks).split(b"\n")
        return [line.decode("utf-8", errors="backslashreplace") for line in complete]

    def _follow_rotation(self) -> None:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return  # moved away and not yet replaced: keep reading the old file
        if (now.st_dev, now.st_ino) == self._inode:
            return
        # another file under the name: what was appended to the old one first, then the new one from its start
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # gone again: the next read looks again
        leftover = self._read_to_end()
        os.close(self._fd)
        self._fd = fd
        info = os.fstat(fd)
        self._inode = (info.st_dev, info.st_ino)
        self._offset = 0
        self._partial = leftover

    def _read_to_end(self) -> bytes:
        os.lseek(self._fd, self._offset, os.SEEK_SET)
        chunks = [self._partial]
        while chunk := os.read(self._fd, 1 << 16):
            chunks.append(chunk)
        data = b"".join(chunks)
        return data if data.endswith(b"\n") or not data else data + b"\n"

"""NVIDIA device health from NVML, as `device.fault` events, beside the kernel log's XIDs (`xid.py`).

What NVML tells that a kernel log does not, or tells where no kernel log can be read (a container without
/dev/kmsg):
- XID events (`nvmlEventTypeXidCriticalError`), the same numbers as the kernel log's: read here only where the
  agent follows no kernel log, so that one XID is never reported twice;
- a GPU that fell off the bus: every call on it answers `NVML_ERROR_GPU_IS_LOST`, reported once as XID 79 (the
  driver's own number for it, which `policies.codes` classes as a node fault);
- ECC counters (volatile, since the driver loaded): new uncorrectable errors as XID 48 with `ecc_dbe`, new
  corrected ones as XID 92 (a wear signal the detection policy watches) with `ecc_sbe`;
- row remapping (Ampere and later; older GPUs retire pages instead): a failed remap as XID 64, new remapped rows
  as XID 63, and on older GPUs new pages retired for double-bit errors as XID 48.

The probe reports counters' changes from the values it read when it opened, so that an agent's restart reports
nothing old. A counter the device does not support (ECC off, a GPU without row remapping) is left out; any other
NVML error is logged once and the probe goes on with the other counters and devices. `nvml` is the module
(`pynvml`, from the nvidia-ml-py distribution) or a stand-in with its names, which the tests give.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio

from events.kinds import DeviceFault
from recovery.settings import ConfigError

logger = logging.getLogger("recovery.agent")

GPU_LOST_XID = "79"
DBE_XID = "48"
SBE_XID = "92"
REMAPPED_XID = "63"
REMAP_FAILED_XID = "64"


@dataclass(frozen=True, slots=True)
class NvmlFault:
    """A fact NVML gave about one of the node's GPUs: the `device.fault` event."""

    type: ClassVar[str] = "device.fault"

    event: DeviceFault

    def data(self) -> dict[str, Any]:
        return self.event.model_dump(mode="json")


@dataclass
class _Counters:
    """One device's counters as last read (None: not supported by the device)."""

    dbe: int | None = None
    sbe: int | None = None
    remapped: int | None = None
    remap_failed: bool | None = None
    retired_dbe: int | None = None
    lost: bool = False
    errors: set[str] = field(default_factory=set)  # what failed to read, logged once each


def load_nvml() -> Any:
    """The NVML module (nvidia-ml-py's `pynvml`); ImportError where it is not installed."""
    import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

    return pynvml


class NvmlProbe:
    """NVML's view of the node's GPUs, read by `poll` (cheap: a few counters per device, and the XID events that
    came since the last poll)."""

    def __init__(self, nvml: Any, xid_events: bool = True) -> None:
        self.nvml = nvml
        self.xid_events = xid_events
        nvml.nvmlInit()
        self._open = True
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._counters = [_Counters() for _ in self.handles]
        self._events: Any = None
        if xid_events and self.handles:
            self._events = nvml.nvmlEventSetCreate()
            for index, handle in enumerate(self.handles):
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
                except nvml.NVMLError as exc:
                    logger.warning("NVML: no XID events from GPU %d: %s", index, exc)
        for index in range(len(self.handles)):
            self._read(index, report=False)

    @property
    def devices(self) -> int:
        return len(self.handles)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._events is not None:
            with contextlib.suppress(self.nvml.NVMLError):  # else the set goes with NVML's shutdown
                self.nvml.nvmlEventSetFree(self._events)
        self.nvml.nvmlShutdown()

    def poll(self) -> list[NvmlFault]:
        """What changed since the last poll: XID events first (in the order NVML gave them), then counters by
        device."""
        found = self._xids()
        for index in range(len(self.handles)):
            found.extend(self._read(index, report=True))
        return found

    # -- XID events -----------------------------------------------------------------------------------
    def _xids(self) -> list[NvmlFault]:
        nvml, found = self.nvml, []
        if self._events is None:
            return found
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    logger.warning("NVML: reading XID events failed: %s", exc)
                return found
            device = self._index_of(event.device)
            if device is None or not event.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            found.append(_fault(device, str(int(event.eventData)), "NVML XID event"))

    def _index_of(self, handle: Any) -> int | None:
        for index, known in enumerate(self.handles):
            if known == handle:
                return index
        return None

    # -- counters -------------------------------------------------------------------------------------
    def _read(self, index: int, report: bool) -> list[NvmlFault]:
        nvml, handle, last = self.nvml, self.handles[index], self._counters[index]
        if last.lost:
            return []
        found: list[NvmlFault] = []
        try:
            dbe = self._counter(index, "uncorrectable ECC", nvml.nvmlDeviceGetTotalEccErrors, handle,
                                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            sbe = self._counter(index, "corrected ECC", nvml.nvmlDeviceGetTotalEccErrors, handle,
                                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)
            rows = self._counter(index, "remapped rows", nvml.nvmlDeviceGetRemappedRows, handle)
            retired = None
            if rows is None:  # before Ampere: pages retired instead of rows remapped
                pages = self._counter(index, "retired pages", nvml.nvmlDeviceGetRetiredPages, handle,
                                      nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
                retired = None if pages is None else len(pages)
        except nvml.NVMLError as exc:  # only GPU_IS_LOST gets here
            last.lost = True
            return [_fault(index, GPU_LOST_XID, f"NVML: GPU is lost ({exc}): it has fallen off the bus")] \
                if report else []
        remapped = None if rows is None else int(rows[0]) + int(rows[1])
        remap_failed = None if rows is None else bool(rows[3])
        if report:
            if dbe is not None and last.dbe is not None and dbe > last.dbe:
                found.append(_fault(index, DBE_XID, f"NVML: {dbe - last.dbe} new uncorrectable ECC error(s)",
                                    ecc_dbe=dbe - last.dbe))
            if retired is not None and last.retired_dbe is not None and retired > last.retired_dbe:
                found.append(_fault(index, DBE_XID, f"NVML: {retired - last.retired_dbe} page(s) retired for "
                                                    "double-bit ECC errors"))
            if remap_failed and not last.remap_failed:
                found.append(_fault(index, REMAP_FAILED_XID, "NVML: a row remapping failed"))
            elif remapped is not None and last.remapped is not None and remapped > last.remapped:
                found.append(_fault(index, REMAPPED_XID, f"NVML: {remapped - last.remapped} row(s) remapped"))
            if sbe is not None and last.sbe is not None and sbe > last.sbe:
                found.append(_fault(index, SBE_XID, f"NVML: {sbe - last.sbe} new corrected ECC error(s)",
                                    ecc_sbe=sbe - last.sbe))
        last.dbe, last.sbe, last.remapped, last.remap_failed, last.retired_dbe = \
            dbe, sbe, remapped, remap_failed, retired
        return found

    def _counter(self, index: int, what: str, read: Any, *args: Any) -> Any:
        """One counter's value; None where the device does not support it or it could not be read (logged once).
        A lost GPU's error is raised: the device is gone, not the counter."""
        nvml = self.nvml
        try:
            return read(*args)
        except nvml.NVMLError as exc:
            value = getattr(exc, "value", None)
            if value == nvml.NVML_ERROR_GPU_IS_LOST:
                raise
            errors = self._counters[index].errors
            if value != nvml.NVML_ERROR_NOT_SUPPORTED and what not in errors:
                errors.add(what)
                logger.warning("NVML: cannot read %s of GPU %d: %s", what, index, exc)
            return None


def _fault(device: int, code: str, message: str, ecc_sbe: int = 0, ecc_dbe: int = 0) -> NvmlFault:
    return NvmlFault(DeviceFault(device=device, vendor="nvidia", code=code, ecc_sbe=ecc_sbe, ecc_dbe=ecc_dbe,
                                 message=message))


async def watch_nvml(probe: NvmlProbe, publish: Callable[[str, dict[str, Any]], None], interval_s: float) -> None:
    """Publish what NVML finds on the node's GPUs (XID events, a lost GPU, ECC and row-remapping counters), read
    every `interval_s` in a worker thread (an NVML call can take milliseconds per device)."""
    while True:
        for item in await anyio.to_thread.run_sync(probe.poll):
            logger.warning("NVML: XID %s on device %s: %s", item.event.code, item.event.device, item.event.message)
            publish(item.type, item.data())
        await anyio.sleep(interval_s)  # the poll interval


def open_nvml_probe(mode: str, kernel_log: Path | None) -> NvmlProbe | None:
    """The NVML probe (`nvml`: `off`, `on`, or `auto`: on where NVML answers), reading XID events only where no
    kernel log is followed; ConfigError naming `nvml` when `on` and NVML cannot be opened."""
    if mode == "off":
        return None
    try:
        probe = NvmlProbe(load_nvml(), xid_events=kernel_log is None)
    except Exception as exc:  # ImportError, NVMLError (no driver, no library): no GPU to watch
        if mode == "on":
            raise ConfigError(f"invalid configuration: nvml: on, but NVML cannot be opened: {exc}") from None
        logger.info("no NVML probe: %s", exc)
        return None
    if not probe.devices:
        probe.close()
        return None
    return probe

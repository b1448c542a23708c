"""The NVML probe against a stand-in NVML with pynvml's names: what each change of a GPU's health becomes, and
what is never reported (old counters, unsupported ones, an XID the kernel log already gives)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from recovery.agent.probes.nvml import NvmlProbe, open_nvml_probe
from recovery.settings import ConfigError


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """pynvml's calls over a list of devices whose counters a test sets."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, devices: int = 2, remapping: bool = True) -> None:
        self.devices = [{"sbe": 0, "dbe": 0, "rows": (0, 0, 0, 0), "pages": [], "lost": False, "ecc": True}
                        for _ in range(devices)]
        self.remapping = remapping
        self.events: list[Any] = []
        self.registered: list[int] = []
        self.initialised = 0

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def _device(self, handle: str) -> dict[str, Any]:
        device = self.devices[int(handle.removeprefix("handle"))]
        if device["lost"]:
            raise FakeNVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return device

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        device = self._device(handle)
        if not device["ecc"]:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return int(device["dbe" if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "sbe"])

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        device = self._device(handle)
        if not self.remapping:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return device["rows"]  # type: ignore[no-any-return]

    def nvmlDeviceGetRetiredPages(self, handle: str, cause: int) -> list[int]:
        return list(self._device(handle)["pages"])

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, events: str) -> None:
        self.registered.append(int(handle.removeprefix("handle")))

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        if not self.events:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def xid(self, device: int, xid: int) -> None:
        self.events.append(SimpleNamespace(device=f"handle{device}", eventType=self.nvmlEventTypeXidCriticalError,
                                           eventData=xid))


def codes(probe: NvmlProbe) -> list[tuple[int, str, int, int]]:
    return [(f.event.device, f.event.code, f.event.ecc_sbe, f.event.ecc_dbe) for f in probe.poll()]


def test_counters_read_at_open_are_not_reported() -> None:
    nvml = FakeNvml()
    nvml.devices[0].update(sbe=40, dbe=2, rows=(3, 1, 0, 0))
    probe = NvmlProbe(nvml)
    assert codes(probe) == []


def test_new_uncorrectable_ecc_errors_are_xid_48_with_their_count() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml)
    nvml.devices[1]["dbe"] = 2
    assert codes(probe) == [(1, "48", 0, 2)]
    assert codes(probe) == []  # reported once


def test_corrected_ecc_errors_are_a_wear_signal() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml)
    nvml.devices[0]["sbe"] = 7
    assert codes(probe) == [(0, "92", 7, 0)]


def test_row_remapping_recorded_and_failed() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml)
    nvml.devices[0]["rows"] = (1, 0, 1, 0)
    assert codes(probe) == [(0, "63", 0, 0)]
    nvml.devices[0]["rows"] = (1, 1, 1, 1)
    assert codes(probe) == [(0, "64", 0, 0)]  # the failure, not also the new row
    assert codes(probe) == []


def test_pages_retired_where_rows_are_not_remapped() -> None:
    nvml = FakeNvml(remapping=False)
    probe = NvmlProbe(nvml)
    nvml.devices[1]["pages"] = [0x1000, 0x2000]
    assert codes(probe) == [(1, "48", 0, 0)]


def test_a_lost_gpu_is_xid_79_once_and_the_others_are_still_read() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml)
    nvml.devices[0]["lost"] = True
    nvml.devices[1]["dbe"] = 1
    assert codes(probe) == [(0, "79", 0, 0), (1, "48", 0, 1)]
    assert codes(probe) == []


def test_ecc_disabled_is_left_out_not_an_error() -> None:
    nvml = FakeNvml()
    nvml.devices[0]["ecc"] = False
    probe = NvmlProbe(nvml)
    nvml.devices[0]["sbe"] = 5  # not readable: ECC off
    assert codes(probe) == []


def test_xid_events_in_order_and_only_without_a_kernel_log() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml, xid_events=True)
    assert nvml.registered == [0, 1]
    nvml.xid(1, 13)
    nvml.xid(0, 31)
    assert codes(probe) == [(1, "13", 0, 0), (0, "31", 0, 0)]
    quiet = FakeNvml()
    probe = NvmlProbe(quiet, xid_events=False)
    quiet.xid(0, 79)
    assert quiet.registered == [] and codes(probe) == []


def test_close_shuts_nvml_down_once() -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml)
    probe.close()
    probe.close()
    assert nvml.initialised == 0


def test_an_agent_told_to_read_nvml_without_it_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr("recovery.agent.probes.nvml.load_nvml", missing)
    assert open_nvml_probe("auto", None) is None
    assert open_nvml_probe("off", None) is None
    with pytest.raises(ConfigError, match="nvml: on"):
        open_nvml_probe("on", None)

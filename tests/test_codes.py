"""Pins the fault-code tables and lookups in `policies.codes`."""

from __future__ import annotations

import pytest

from events.values import FaultClass
from policies.codes import (
    ASCEND_CODES,
    ASCEND_LEVELS,
    NVIDIA_XID,
    SIGNALS,
    Action,
    CodeMeaning,
    ascend_fault,
    exit_status,
    nvidia_xid,
)

# -- table invariants ---------------------------------------------------------------------------------------

ALL_ENTRIES: list[tuple[str, CodeMeaning]] = [
    *((f"XID {k}", v) for k, v in NVIDIA_XID.items()),
    *((f"Ascend {k}", v) for k, v in ASCEND_LEVELS.items()),
    *((f"signal {k}", v) for k, v in SIGNALS.items()),
]


@pytest.mark.parametrize(("name", "meaning"), ALL_ENTRIES, ids=[name for name, _ in ALL_ENTRIES])
def test_ignore_entries_have_no_fault_class_and_others_have_one(name: str, meaning: CodeMeaning) -> None:
    if meaning.action is Action.IGNORE:
        assert meaning.fault_class is None, name
    else:
        assert isinstance(meaning.fault_class, FaultClass), name
    assert meaning.description.strip(), name


def test_code_meaning_rejects_ignore_with_a_fault_class() -> None:
    with pytest.raises(ValueError, match="IGNORE"):
        CodeMeaning(FaultClass.DEVICE, Action.IGNORE, "contradiction")


def test_code_meaning_rejects_an_action_without_a_fault_class() -> None:
    with pytest.raises(ValueError, match="IGNORE"):
        CodeMeaning(None, Action.RESTART_PROCESS, "contradiction")


def test_code_meaning_is_frozen() -> None:
    meaning = nvidia_xid("79")
    with pytest.raises(AttributeError):
        meaning.action = Action.IGNORE  # type: ignore[misc]


# -- NVIDIA XIDs --------------------------------------------------------------------------------------------


def test_required_xids_are_in_the_table() -> None:
    required = {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 121}
    assert required <= NVIDIA_XID.keys()


def test_xid_79_fallen_off_bus_resets_device() -> None:
    meaning = nvidia_xid("79")
    assert meaning.action is Action.RESET_DEVICE
    # A GPU off the PCIe bus needs the machine power-cycled: every rank on the node is affected.
    assert meaning.fault_class is FaultClass.NODE
    assert "fallen off the bus" in meaning.description


def test_xid_48_double_bit_ecc_resets_device() -> None:
    assert nvidia_xid("48") == CodeMeaning(FaultClass.DEVICE, Action.RESET_DEVICE, NVIDIA_XID[48].description)


def test_xid_74_nvlink_error_is_a_network_fault_needing_reset() -> None:
    meaning = nvidia_xid("74")
    assert meaning.fault_class is FaultClass.NETWORK
    assert meaning.action is Action.RESET_DEVICE


@pytest.mark.parametrize("xid", ["13", "31", "43"])
def test_xid_application_errors_restart_the_process(xid: str) -> None:
    meaning = nvidia_xid(xid)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS


def test_xid_45_preemptive_cleanup_is_ignored_as_a_consequence() -> None:
    meaning = nvidia_xid("45")
    assert meaning.action is Action.IGNORE
    assert meaning.fault_class is None


def test_xid_63_row_remap_recorded_is_watched() -> None:
    meaning = nvidia_xid("63")
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.WATCH


def test_xid_64_row_remap_failure_resets_device() -> None:
    assert nvidia_xid("64").action is Action.RESET_DEVICE


def test_xid_92_high_single_bit_ecc_rate_is_watched() -> None:
    meaning = nvidia_xid("92")
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.WATCH


def test_xid_94_contained_ecc_restarts_process_on_device_fault() -> None:
    meaning = nvidia_xid("94")
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESTART_PROCESS


def test_xid_95_uncontained_ecc_resets_device() -> None:
    meaning = nvidia_xid("95")
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESET_DEVICE


@pytest.mark.parametrize("xid", ["61", "62", "119", "120"])
def test_xid_firmware_and_microcontroller_faults_reset_device(xid: str) -> None:
    assert nvidia_xid(xid).action is Action.RESET_DEVICE


@pytest.mark.parametrize("xid", ["68", "69"])
def test_xid_engine_errors_restart_the_process(xid: str) -> None:
    meaning = nvidia_xid(xid)
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESTART_PROCESS


def test_xid_121_c2c_corrected_error_is_watched() -> None:
    assert nvidia_xid("121").action is Action.WATCH


def test_xid_lookup_returns_the_table_entry_and_ignores_whitespace() -> None:
    assert nvidia_xid("79") is NVIDIA_XID[79]
    assert nvidia_xid(" 79\n") is NVIDIA_XID[79]


@pytest.mark.parametrize("code", ["999", "154", "0", "abc", "", "7.9", "-79", "0x4F"])
def test_unknown_xid_is_a_device_fault_that_restarts_the_process(code: str) -> None:
    meaning = nvidia_xid(code)
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESTART_PROCESS
    assert "unknown XID" in meaning.description


# -- Ascend -------------------------------------------------------------------------------------------------

MINDCLUSTER_PROCESSOR_LEVELS = (
    "NotHandleFault", "RestartRequest", "RestartBusiness", "FreeRestartNPU", "RestartNPU", "SeparateNPU",
    "PreSeparateNPU", "SubHealthFault",
)


def test_ascend_levels_cover_every_mindcluster_processor_level() -> None:
    assert set(MINDCLUSTER_PROCESSOR_LEVELS) <= ASCEND_LEVELS.keys()


@pytest.mark.parametrize(
    ("level", "fault_class", "action"),
    [
        ("NotHandleFault", None, Action.IGNORE),
        ("RestartRequest", FaultClass.DEVICE, Action.RETRY),
        ("RestartBusiness", FaultClass.DEVICE, Action.RESTART_PROCESS),
        ("FreeRestartNPU", FaultClass.DEVICE, Action.RESET_DEVICE),
        ("RestartNPU", FaultClass.DEVICE, Action.RESET_DEVICE),
        ("SeparateNPU", FaultClass.DEVICE, Action.ISOLATE_DEVICE),
        ("ManuallySeparateNPU", FaultClass.DEVICE, Action.ISOLATE_DEVICE),
        ("PreSeparateNPU", FaultClass.DEVICE, Action.DRAIN),
        ("SubHealthFault", FaultClass.DEVICE, Action.DRAIN),
    ],
)
def test_ascend_level_name_maps_to_action(level: str, fault_class: FaultClass | None, action: Action) -> None:
    meaning = ascend_fault(level)
    assert meaning is ASCEND_LEVELS[level]
    assert meaning.fault_class is fault_class
    assert meaning.action is action


def test_ascend_level_names_match_case_insensitively() -> None:
    assert ascend_fault("restartnpu") is ASCEND_LEVELS["RestartNPU"]
    assert ascend_fault(" SEPARATENPU ") is ASCEND_LEVELS["SeparateNPU"]


@pytest.mark.parametrize("spelling", ["0x80E01801", "0x80e01801", "0X80E01801", "80E01801", "80e01801"])
def test_ascend_hex_code_is_case_insensitive(spelling: str) -> None:
    meaning = ascend_fault(spelling)
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESTART_PROCESS  # RestartBusiness
    assert meaning == ascend_fault("0x80E01801")


def test_ascend_code_answers_with_its_level_and_names_both() -> None:
    meaning = ascend_fault("0x80e3a201")
    assert meaning.action is Action.ISOLATE_DEVICE
    assert meaning.description.startswith("0x80E3A201 SeparateNPU")


def test_ascend_not_handle_code_is_ignored() -> None:
    meaning = ascend_fault("0x80E21007")
    assert meaning.action is Action.IGNORE
    assert meaning.fault_class is None


@pytest.mark.parametrize(("code", "level"), sorted(ASCEND_CODES.items()))
def test_every_ascend_code_resolves_to_its_level(code: int, level: str) -> None:
    assert level in ASCEND_LEVELS
    meaning = ascend_fault(f"0x{code:08X}")
    expected = ASCEND_LEVELS[level]
    assert (meaning.fault_class, meaning.action) == (expected.fault_class, expected.action)


@pytest.mark.parametrize("code", ["0xDEADBEEF", "0x00000000", "zz", "", "0x", "0x80E0180G", "Restart NPU"])
def test_unknown_ascend_fault_is_a_device_fault_that_restarts_the_process(code: str) -> None:
    meaning = ascend_fault(code)
    assert meaning.fault_class is FaultClass.DEVICE
    assert meaning.action is Action.RESTART_PROCESS
    assert "unknown Ascend fault" in meaning.description


# -- exit statuses and signals ------------------------------------------------------------------------------


def test_exit_zero_is_ignored() -> None:
    meaning = exit_status(0, None)
    assert meaning.action is Action.IGNORE
    assert meaning.fault_class is None


@pytest.mark.parametrize(("exit_code", "signal"), [(None, 15), (143, None), (-15, None)])
def test_sigterm_is_preemption_asked_to_stop(exit_code: int | None, signal: int | None) -> None:
    meaning = exit_status(exit_code, signal)
    assert meaning.fault_class is FaultClass.PREEMPTION
    assert meaning.action is Action.RESTART_PROCESS
    assert "asked to stop" in meaning.description


@pytest.mark.parametrize(("exit_code", "signal"), [(None, 9), (137, None), (-9, None)])
def test_sigkill_137_is_a_process_kill(exit_code: int | None, signal: int | None) -> None:
    meaning = exit_status(exit_code, signal)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS
    assert "OOM" in meaning.description


@pytest.mark.parametrize(
    ("signal", "exit_code", "name"),
    [(11, 139, "SIGSEGV"), (6, 134, "SIGABRT"), (7, 135, "SIGBUS"), (4, 132, "SIGILL"), (8, 136, "SIGFPE")],
)
def test_crash_signals_restart_the_process(signal: int, exit_code: int, name: str) -> None:
    for meaning in (exit_status(None, signal), exit_status(exit_code, None)):
        assert meaning.fault_class is FaultClass.PROCESS
        assert meaning.action is Action.RESTART_PROCESS
        assert meaning.description.startswith(name)


@pytest.mark.parametrize("signal", sorted(SIGNALS))
def test_exit_code_128_plus_n_is_read_as_signal_n(signal: int) -> None:
    by_signal = exit_status(None, signal)
    by_exit = exit_status(128 + signal, None)
    assert (by_exit.fault_class, by_exit.action) == (by_signal.fault_class, by_signal.action)
    assert by_exit.description.startswith(SIGNALS[signal].description)
    assert f"{128 + signal} = 128+{signal}" in by_exit.description


def test_exit_code_128_plus_unlisted_signal_is_still_a_signal() -> None:
    meaning = exit_status(128 + 40, None)  # a real-time signal
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS
    assert "signal 40" in meaning.description


@pytest.mark.parametrize("exit_code", [128, 193, 255])
def test_exit_codes_outside_128_plus_signal_range_are_plain_exits(exit_code: int) -> None:
    meaning = exit_status(exit_code, None)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS
    assert meaning.description == f"exited with status {exit_code}"


@pytest.mark.parametrize("exit_code", [1, 2, 126, 127])
def test_other_nonzero_exit_restarts_the_process(exit_code: int) -> None:
    meaning = exit_status(exit_code, None)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS
    assert f"status {exit_code}" in meaning.description


def test_reported_signal_wins_over_exit_code() -> None:
    assert exit_status(0, 9).fault_class is FaultClass.PROCESS
    assert exit_status(1, 15).fault_class is FaultClass.PREEMPTION


def test_signal_zero_means_no_signal() -> None:
    assert exit_status(0, 0).action is Action.IGNORE


def test_unlisted_signal_restarts_the_process() -> None:
    meaning = exit_status(None, 40)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS


def test_no_exit_code_and_no_signal_is_a_process_fault() -> None:
    meaning = exit_status(None, None)
    assert meaning.fault_class is FaultClass.PROCESS
    assert meaning.action is Action.RESTART_PROCESS


def test_sigint_is_preemption() -> None:
    assert exit_status(130, None).fault_class is FaultClass.PREEMPTION


def test_lookups_are_deterministic() -> None:
    assert exit_status(139, None) == exit_status(139, None)
    assert ascend_fault("0x8C084E00") == ascend_fault("0x8c084e00")
    assert nvidia_xid("12345") == nvidia_xid("12345")

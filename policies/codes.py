"""Fault-code tables for detection policies: NVIDIA XIDs, Ascend (MindCluster) fault codes and fault
levels, and process exit statuses and signals.

Pure data plus three lookups (`nvidia_xid`, `ascend_fault`, `exit_status`): no I/O, and the same input always
gives the same answer. Every table names its public source. A code whose meaning could not be checked there is
left out on purpose, so it falls through to its lookup's conservative default instead of carrying a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from events.values import FaultClass


class Action(StrEnum):
    """What a detection policy should do about a code. The order is not a severity scale: DRAIN is a
    deferred move, milder than RESET_DEVICE."""

    IGNORE = "ignore"  # informational, or a consequence of another fault
    WATCH = "watch"  # count it (frequency escalation), do nothing yet
    RETRY = "retry"  # transient: retry the step
    RESTART_PROCESS = "restart_process"  # the process must restart; the device is fine
    # device needs a reset: the ranks on it must move or the node restart its device
    RESET_DEVICE = "reset_device"
    ISOLATE_DEVICE = "isolate_device"  # take the device out of service
    ISOLATE_NODE = "isolate_node"  # take the node out of service
    DRAIN = "drain"  # sub-health: move away at the next checkpoint


@dataclass(frozen=True, slots=True)
class CodeMeaning:
    """What one code means: its fault class (None exactly when the action is IGNORE), the action to take,
    and a one-line reason an operator can read."""

    fault_class: FaultClass | None
    action: Action
    description: str

    def __post_init__(self) -> None:
        # Policies branch on `fault_class is None` as well as on the action; the two must never disagree.
        if (self.action is Action.IGNORE) != (self.fault_class is None):
            raise ValueError(f"fault_class must be None exactly when the action is IGNORE, got "
                             f"{self.fault_class!r} with {self.action!r}")


_DEVICE = FaultClass.DEVICE
_PROCESS = FaultClass.PROCESS

# ----------------------------------------------------------------------------------------------------
# NVIDIA XIDs
#
# Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog" (Ampere and newer),
#   https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
#   column "Resolution Bucket (Immediate Action)", read through NVIDIA's machine-readable copy of that
#   column in NVIDIA/NVSentinel: distros/kubernetes/nvsentinel/charts/gpu-health-monitor/xiderrorsmapping.csv.
# Per-XID wording: NVIDIA, "XID Errors", https://docs.nvidia.com/deploy/xid-errors/index.html, and
#   "GPU Debug Guidelines", https://docs.nvidia.com/deploy/gpu-debug-guidelines/index.html.
#
# Bucket -> Action:
#   RESTART_APP -> RESTART_PROCESS (the GPU is usable again at once)
#   RESET_GPU, WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR -> RESET_DEVICE (reset the GPU, or reboot the node)
#   RESTART_BM (power-cycle the machine) -> RESET_DEVICE with fault class NODE: every rank there moves
#   IGNORE -> WATCH for wear signals worth counting (63, 92, 121), IGNORE for echoes of another fault (45)
# Left out: XID 154 (GPU Recovery Action Changed) carries its action in its payload and defers to another
# XID; the NVLink5 XIDs 144-150 need their payload decoded (WORKFLOW_NVLINK5_ERR). Both fall to the default.
# ----------------------------------------------------------------------------------------------------
NVIDIA_XID: dict[int, CodeMeaning] = {
    13: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                    "Graphics Engine Exception: usually the application (out-of-bounds access, illegal "
                    "instruction); catalog RESTART_APP"),
    31: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                    "GPU memory page fault (MMU): usually an illegal address access by the application; "
                    "catalog RESTART_APP"),
    # The catalog's bucket for 43 is IGNORE because nothing needs doing to the GPU; the process that hit it
    # must still terminate ("XID Errors": user application hit a software-induced fault, GPU stays healthy).
    43: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                    "GPU stopped processing: the application hit a software-induced fault and must "
                    "terminate; the GPU stays healthy"),
    # Logged when channels are torn down after another error or because the process ended (Ctrl-C, kill):
    # the fault to act on is the XID or exit before it.
    45: CodeMeaning(None, Action.IGNORE,
                    "Preemptive cleanup of GPU channels after another error or the process ending; act on "
                    "the fault before it (catalog WORKFLOW_XID_45)"),
    46: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "GPU stopped processing (ROBUST_CHANNEL_GPU_TIMEOUT_ERROR); catalog RESET_GPU"),
    48: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "Double-bit (uncorrectable) ECC error: a GPU reset or node reboot clears it; catalog "
                    "WORKFLOW_XID_48 (reset; drain and reset when XID 63/64 follow)"),
    61: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "Internal micro-controller (PMU) breakpoint/warning: report it and reset the GPU"),
    62: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "Internal micro-controller (PMU) halt; catalog RESET_GPU"),
    # The remap is recorded and activates at the next reset; until then page offlining keeps new work safe
    # (NVML nvmlDeviceGetRemappedRows), so this is wear to count, not a reason to stop.
    63: CodeMeaning(_DEVICE, Action.WATCH,
                    "Row remapping (ECC page retirement) recorded; it takes effect at the next GPU reset; "
                    "catalog IGNORE"),
    64: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "Row remapping (ECC page retirement) could not be recorded; catalog RESET_GPU, RMA if it "
                    "recurs"),
    68: CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                    "NVDEC0 (video decoder) exception; catalog RESTART_APP"),
    69: CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                    "Graphics Engine class error; catalog RESTART_APP"),
    # NVLink is the GPU-to-GPU fabric; the faulty end may be the remote GPU or NVSwitch, not this one.
    74: CodeMeaning(FaultClass.NETWORK, Action.RESET_DEVICE,
                    "NVLink error (the fault may be at the remote end of the link): a GPU reset or node "
                    "reboot clears it; catalog WORKFLOW_NVLINK_ERR"),
    # A GPU reset cannot reach a GPU that left the PCIe bus: the machine needs a power cycle, so the fault is
    # classed NODE and every rank on the node has to move.
    79: CodeMeaning(FaultClass.NODE, Action.RESET_DEVICE,
                    "GPU has fallen off the bus (not reachable over PCIe): the node must be power-cycled; "
                    "catalog RESTART_BM"),
    92: CodeMeaning(_DEVICE, Action.WATCH,
                    "High single-bit ECC error rate: corrected by the GPU, a wear signal; catalog IGNORE"),
    94: CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                    "Contained ECC error: only the application that touched the memory is affected and must "
                    "restart; reset the GPU when convenient; catalog RESTART_APP"),
    95: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                    "Uncontained ECC error: several applications affected; the GPU must be reset before they "
                    "restart; catalog RESET_GPU"),
    119: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                     "GSP RPC timeout (the GPU System Processor firmware did not answer); catalog RESET_GPU"),
    120: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                     "GSP (GPU System Processor) error; catalog RESET_GPU"),
    # Corrected errors with no operational impact; a GPU reset retrains the link when convenient.
    121: CodeMeaning(_DEVICE, Action.WATCH,
                     "C2C link corrected error (NVLink-C2C to the Grace CPU), no operational impact; catalog "
                     "IGNORE"),
    140: CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                     "Unrecovered ECC error (escaped page offlining and row remapping); catalog RESET_GPU"),
}

# ----------------------------------------------------------------------------------------------------
# Huawei Ascend: MindCluster fault levels and fault codes
#
# Levels: MindCluster "Configuration Description", Table 2 "Fault severity and handling policies",
#   https://www.hiascend.com/document/detail/en/mindcluster/730/clustersched/schedulingug/dl_resume_084.html
#   (processor faults), and the `fault_handling` field of the Ascend Device Plugin / ClusterD device ConfigMap
#   in the MindCluster API docs (which adds ManuallySeparateNPU).
# Codes: the Ascend Device Plugin default table, Ascend/mind-cluster
#   component/ascend-device-plugin/build/faultCode.json (https://gitcode.com/Ascend/mind-cluster).
# ----------------------------------------------------------------------------------------------------
ASCEND_LEVELS: dict[str, CodeMeaning] = {
    "NotHandleFault": CodeMeaning(None, Action.IGNORE,
                                  "NotHandleFault: no impact on the workload, no action needed"),
    # The mildest "execute again" level: the unit of work (an inference request, a training step) is redone,
    # not the service. If the retry does not hold, the process exit or the frequency window escalates it.
    "RestartRequest": CodeMeaning(_DEVICE, Action.RETRY,
                                  "RestartRequest: the workload is affected and the request must be executed "
                                  "again"),
    "RestartBusiness": CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                                   "RestartBusiness: the workload is affected and must be executed again; "
                                   "the chip needs no reset"),
    # "Reset when idle" still means the ranks must leave the chip first, the same as an immediate reset.
    "FreeRestartNPU": CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                                  "FreeRestartNPU: the workload is affected; the chip must be reset once it "
                                  "is idle"),
    "RestartNPU": CodeMeaning(_DEVICE, Action.RESET_DEVICE,
                              "RestartNPU: reset the chip now and execute the workload again"),
    "SeparateNPU": CodeMeaning(_DEVICE, Action.ISOLATE_DEVICE,
                               "SeparateNPU: cannot be recovered, the chip must be isolated"),
    "ManuallySeparateNPU": CodeMeaning(_DEVICE, Action.ISOLATE_DEVICE,
                                       "ManuallySeparateNPU: isolated by Ascend Device Plugin/ClusterD after "
                                       "the fault recurred at the configured frequency"),
    # No impact yet, but nothing new is scheduled on the chip: leave it at the next checkpoint.
    "PreSeparateNPU": CodeMeaning(_DEVICE, Action.DRAIN,
                                  "PreSeparateNPU: no impact for now, no new work will be scheduled on the "
                                  "chip (pre-isolated)"),
    "SubHealthFault": CodeMeaning(_DEVICE, Action.DRAIN,
                                  "SubHealthFault: sub-health, workload performance is affected (MindCluster "
                                  "applies the job's subHealthyStrategy)"),
}

# A handful of codes whose level is the same in both versions of the Ascend Device Plugin faultCode.json
# that were checked, and which appear under exactly one level there (the plugin handles a code listed
# twice at its highest level). Deployments override this table through their own faultCode.json; MindCluster
# Container Manager ships different defaults (it lists the sub-health codes below as NotHandleFault), so
# this is a floor, not the full list. PreSeparateNPUCodes is empty in the default table, so no code maps to
# PreSeparateNPU.
ASCEND_CODES: dict[int, str] = {
    0x80E21007: "NotHandleFault",
    0x80E38003: "NotHandleFault",
    0x80C98008: "RestartRequest",
    0x80C98002: "RestartRequest",
    0x80E01801: "RestartBusiness",
    0x8C084E00: "FreeRestartNPU",
    0x8C0E4E00: "FreeRestartNPU",
    0x8C03A000: "RestartNPU",
    0x80E24E00: "RestartNPU",
    0x80E3A201: "SeparateNPU",
    0x80E18402: "SeparateNPU",
    0x81A3880C: "SubHealthFault",
    0x8C2FA001: "SubHealthFault",
}

# ----------------------------------------------------------------------------------------------------
# Linux signals and exit statuses
#
# Numbers: signal(7), https://man7.org/linux/man-pages/man7/signal.7.html, as on x86 and ARM (alpha, MIPS,
#   SPARC and PA-RISC number some signals differently; this table assumes x86 or ARM nodes).
# 128+N: GNU Bash manual, 3.7.5 "Exit Status": "When a command terminates on a fatal signal whose number is N,
#   Bash uses the value 128+N as the exit status"; 126 is "found but not executable", 127 "not found".
# -N: Python's Popen.returncode, and torchelastic's ProcessFailure.exitcode (torch.distributed.elastic.
#   multiprocessing.errors: `signal_name()` is `signal.Signals(-exitcode)` when exitcode < 0).
# ----------------------------------------------------------------------------------------------------
SIGNALS: dict[int, CodeMeaning] = {
    1: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                   "SIGHUP: hangup of the controlling terminal, or its controlling process died"),
    # An interrupt is someone asking the process to stop (Ctrl-C, or a launcher passing one on), not a crash.
    2: CodeMeaning(FaultClass.PREEMPTION, Action.RESTART_PROCESS, "SIGINT: interrupted, asked to stop"),
    3: CodeMeaning(_PROCESS, Action.RESTART_PROCESS, "SIGQUIT: quit, with a core dump"),
    4: CodeMeaning(_PROCESS, Action.RESTART_PROCESS, "SIGILL: illegal instruction"),
    6: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                   "SIGABRT: aborted (abort(3): a failed assertion or an uncaught C++ exception)"),
    7: CodeMeaning(_PROCESS, Action.RESTART_PROCESS, "SIGBUS: bus error (bad memory access)"),
    8: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                   "SIGFPE: erroneous arithmetic operation (e.g. integer division by zero)"),
    # SIGKILL cannot be caught, so the process saved nothing: the kernel OOM killer or a supervisor that
    # stopped waiting after asking politely.
    9: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                   "SIGKILL: killed, by the kernel OOM killer or from outside"),
    11: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                    "SIGSEGV: invalid memory reference (segmentation fault)"),
    13: CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                    "SIGPIPE: broken pipe (wrote to a pipe with no reader)"),
    # SIGTERM is the usual way a platform asks a process to stop (pod termination, scheduler preemption):
    # the platform's decision, not a failure of the job, and the process may have saved state on the way out.
    15: CodeMeaning(FaultClass.PREEMPTION, Action.RESTART_PROCESS,
                    "SIGTERM: asked to stop (preemption, drain or shutdown by the platform)"),
}

_SIGNAL_EXIT_BASE = 128  # Bash: a command ended by signal N exits with 128+N
_MAX_SIGNAL = 64  # signal(7): SIGRTMAX is at most 64 on Linux, so 129..192 are the 128+N statuses
_EXIT_CODES: dict[int, str] = {
    126: "exited with status 126: command found but not executable",
    127: "exited with status 127: command not found",
}

_XID_RE = re.compile(r"\d+")
_HEX_RE = re.compile(r"(?:0[xX])?([0-9A-Fa-f]{1,16})")
_ASCEND_LEVEL_BY_FOLDED: dict[str, str] = {name.casefold(): name for name in ASCEND_LEVELS}


def nvidia_xid(code: str) -> CodeMeaning:
    """Meaning of an NVIDIA XID given as its decimal number (``"79"``).

    An XID missing from `NVIDIA_XID`, or a string that is not a number, is a device fault whose process must
    restart: the GPU may well be fine, and a GPU that keeps raising unknown XIDs is caught by the detection
    policy's frequency escalation rather than isolated on first sight.
    """
    text = code.strip()
    if _XID_RE.fullmatch(text):
        known = NVIDIA_XID.get(int(text))
        if known is not None:
            return known
    return CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                       f"unknown XID {text or repr(code)}: restart the process")


def ascend_fault(code: str) -> CodeMeaning:
    """Meaning of an Ascend fault: a fault code in hex (``"0x80E01801"`` or ``"80e01801"``, any case) or a
    MindCluster fault level name (``"RestartNPU"``, matched case-insensitively).

    A level name answers with that level's meaning; a code in `ASCEND_CODES` answers with its level's action
    and a description naming both. Anything else is treated like an unknown XID: a device fault whose process
    must restart, left to frequency escalation.
    """
    text = code.strip()
    level = _ASCEND_LEVEL_BY_FOLDED.get(text.casefold())
    if level is not None:
        return ASCEND_LEVELS[level]
    match = _HEX_RE.fullmatch(text)
    if match is not None:
        value = int(match.group(1), 16)
        level = ASCEND_CODES.get(value)
        if level is not None:
            meaning = ASCEND_LEVELS[level]
            return CodeMeaning(meaning.fault_class, meaning.action, f"0x{value:08X} {meaning.description}")
        return CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                           f"unknown Ascend fault code 0x{value:08X}: restart the process")
    return CodeMeaning(_DEVICE, Action.RESTART_PROCESS,
                       f"unknown Ascend fault {text or repr(code)}: restart the process")


def _signal_of(exit_code: int | None, signal: int | None) -> tuple[int | None, str]:
    """The signal that ended a process, and how it was learnt (a suffix for the description)."""
    if signal:  # a reported signal wins: a process killed by a signal has no exit status of its own
        return signal, ""
    if exit_code is None:
        return None, ""
    if exit_code < 0:  # Popen.returncode and torchelastic's ProcessFailure.exitcode: -N is signal N
        return -exit_code, f" (exit code {exit_code})"
    if _SIGNAL_EXIT_BASE < exit_code <= _SIGNAL_EXIT_BASE + _MAX_SIGNAL:
        return exit_code - _SIGNAL_EXIT_BASE, (f" (exit status {exit_code} = {_SIGNAL_EXIT_BASE}+"
                                               f"{exit_code - _SIGNAL_EXIT_BASE})")
    return None, ""


def exit_status(exit_code: int | None, signal: int | None) -> CodeMeaning:
    """Meaning of how a process ended: its exit code and/or the signal that killed it.

    A reported signal (non-zero) wins over the exit code. Otherwise an exit code of 128+N (N a Linux
    signal, 1..64) or -N is read as signal N. Status 0 is IGNORE; SIGTERM and SIGINT are PREEMPTION (asked
    to stop); SIGKILL, crashes (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE), other signals and any other
    non-zero status are a PROCESS fault whose process must restart. With neither an exit code nor a signal
    the process is taken to have died without a report, also a PROCESS fault.
    """
    sig, how = _signal_of(exit_code, signal)
    if sig is not None:
        known = SIGNALS.get(sig)
        if known is None:
            return CodeMeaning(_PROCESS, Action.RESTART_PROCESS, f"killed by signal {sig}{how}")
        return CodeMeaning(known.fault_class, known.action, f"{known.description}{how}")
    if exit_code is None:
        return CodeMeaning(_PROCESS, Action.RESTART_PROCESS, "ended with no exit status or signal reported")
    if exit_code == 0:
        return CodeMeaning(None, Action.IGNORE, "exited normally (status 0)")
    return CodeMeaning(_PROCESS, Action.RESTART_PROCESS,
                       _EXIT_CODES.get(exit_code, f"exited with status {exit_code}"))

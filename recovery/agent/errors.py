"""Why a rank's script failed, in its own words, read by its agent when the process exits.

torchrun gives every worker `TORCHELASTIC_ERROR_FILE`, a path of its own, and a script whose entry point is decorated
with `torch.distributed.elastic.multiprocessing.errors.record` writes the exception it dies of there as JSON
(`{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": <traceback>, ...}}}`). The agent does the
same, so that the exit it reports carries the exception's type, message and place: the decision, the report and
`recovery-run` quote the script's error instead of an exit code. A script without `@record` is read from the end of
its output: the last traceback's last line, or else its last line (a CLI framework such as hydra prints its error
and exits 1 without a traceback).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from events.kinds import MAX_ERROR_MESSAGE, ScriptError
from events.values import MAX_NAME_LENGTH

OUTPUT_TAIL_BYTES = 64 * 1024
"""of a rank's output read for its error: a traceback's end is within it, however long the run's output was"""
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Failure|Fault)?): "
                        r"(?P<message>.*)$|^(?P<bare>[A-Za-z_][\w.]*(?:Error|Exception))$")
_NOISE = ("Set the environment variable HYDRA_FULL_ERROR",)
"""lines a framework prints after the error that say nothing of it"""
_STOPPED_SIGNALS = (9, 15)
_STOPPED_CODES = (0, 128 + 9, 128 + 15)


def error_file(runtime_dir: Path, job: str, rank: int, attempt: int) -> Path:
    """The rank's `TORCHELASTIC_ERROR_FILE` in generation `attempt`: beside its output file, one per process."""
    return runtime_dir / f"{job}.rank{rank}.gen{attempt}.error.json"


def output_file(runtime_dir: Path, job: str, rank: int, attempt: int) -> Path:
    """The rank's output in generation `attempt` (the agent writes it there)."""
    return runtime_dir / f"{job}.rank{rank}.gen{attempt}.log"


def failed(exit_code: int | None, signal: int | None) -> bool:
    """Did the process end of its own failure: not cleanly, and not by the SIGTERM or SIGKILL of a stop?"""
    if signal is not None:
        return signal not in _STOPPED_SIGNALS
    return exit_code is not None and exit_code not in _STOPPED_CODES


def script_error(runtime_dir: Path, job: str, rank: int, attempt: int, exit_code: int | None,
                 signal: int | None) -> ScriptError | None:
    """The script's error of a failed exit, from its error file, else from its output; None for an exit that is no
    failure (a stop, a clean end) or one that left no word."""
    if not failed(exit_code, signal):
        return None
    return (from_error_file(error_file(runtime_dir, job, rank, attempt))
            or from_output(output_file(runtime_dir, job, rank, attempt)))


def from_error_file(path: Path) -> ScriptError | None:
    """torch's error file (`ErrorHandler.record_exception`'s format), or None if there is none or it is not one."""
    try:
        data: Any = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    callstack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            callstack = extra["py_callstack"]
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    kind, text = _split(message.strip())
    return _error(kind, text, _place(callstack.splitlines()), "error_file")


def from_output(path: Path) -> ScriptError | None:
    """The error at the end of the rank's output: the last traceback's exception line and innermost frame of the
    script's, else the last line that says something."""
    try:
        with path.open("rb") as output:
            with contextlib.suppress(OSError):
                output.seek(-OUTPUT_TAIL_BYTES, 2)
            tail = output.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line.rstrip() for line in tail.splitlines()]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=None)
    if start is not None:
        frames = lines[start + 1:]
        for line in frames:
            match = _EXCEPTION.match(line)
            if match is not None and not line.startswith(" "):
                kind = match.group("type") or match.group("bare") or ""
                return _error(kind, match.group("message") or "", _place(frames), "output")
    said = [line.strip() for line in lines if line.strip() and not line.startswith(_NOISE)]
    if not said:
        return None
    kind, text = _split(said[-1])
    return _error(kind, text, "", "output")


def _split(line: str) -> tuple[str, str]:
    """`ValueError: bad lr` -> ("ValueError", "bad lr"); a line that names no exception type is all message."""
    match = _EXCEPTION.match(line)
    if match is None:
        return "", line
    return match.group("type") or match.group("bare") or "", match.group("message") or ""


def _place(traceback: list[str]) -> str:
    """`train.py:42 in main`: the innermost frame of the traceback (where it was raised)."""
    frames = [m for m in map(_FRAME.match, traceback) if m is not None]
    if not frames:
        return ""
    last = frames[-1]
    return f"{Path(last.group('file')).name}:{last.group('line')} in {last.group('function')}"


def _error(kind: str, message: str, place: str, source: str) -> ScriptError:
    one_line = " ".join(message.split())  # a message over lines is quoted on one
    return ScriptError(type=_printable(kind)[:MAX_NAME_LENGTH], message=_printable(one_line)[:MAX_ERROR_MESSAGE],
                       place=_printable(place)[:MAX_NAME_LENGTH], source=source)  # type: ignore[arg-type]


def _printable(text: str) -> str:
    """The wire's labels take no control character."""
    return "".join(c if c.isprintable() else "?" for c in text)

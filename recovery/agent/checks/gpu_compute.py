"""The `gpu-compute` health check, in a process of its own (the agent never imports torch): on every GPU torch sees,
a matrix product against the CPU's and a fill and verify of a few hundred MiB of its memory. Standard library and
torch only: it runs in the interpreter `check_python` names.

    python -m recovery.agent.checks.gpu_compute --fill-mib 256

Exit status 0 when every GPU passes; the last line of its output says what it saw (the failing GPU first).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

SIZE = 1024  # the matrices' side: milliseconds on any GPU, a fraction of a second on the CPU
PATTERNS = (0x55555555, -0x55555556)  # 0101... and 1010...: every bit of the filled memory written both ways


def check_gpu(torch: Any, index: int, fill_mib: int) -> str | None:
    """What is wrong with GPU `index`, or None."""
    device = torch.device("cuda", index)
    generator = torch.Generator().manual_seed(index)
    a = torch.randn(SIZE, SIZE, generator=generator)
    b = torch.randn(SIZE, SIZE, generator=generator)
    expected = a @ b
    got = (a.to(device) @ b.to(device)).cpu()
    error = float((got - expected).abs().max())
    bound = 1e-3 * float(expected.abs().max())  # float32 sums in another order, no TF32 (turned off below)
    if not error <= bound:  # NaN included
        return f"GPU {index}: matrix product off the CPU's by {error:.3g} (bound {bound:.3g})"
    count = fill_mib * (1 << 20) // 4
    memory = torch.empty(count, dtype=torch.int32, device=device)
    for pattern in PATTERNS:
        memory.fill_(pattern)
        wrong = int((memory != pattern).sum())
        if wrong:
            return f"GPU {index}: {wrong} of {count} words read back wrong after a fill with {pattern & 0xFFFFFFFF:#x}"
    del memory
    torch.cuda.synchronize(device)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fill-mib", type=int, default=256)
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        import torch
    except ImportError as exc:
        print(f"torch cannot be imported: {exc}")
        return 1
    if not torch.cuda.is_available():
        print("torch sees no GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    count = torch.cuda.device_count()
    for index in range(count):
        try:
            wrong = check_gpu(torch, index, args.fill_mib)
        except Exception as exc:  # a CUDA error is the GPU's failure, said as such
            wrong = f"GPU {index}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if wrong is not None:
            print(wrong)
            return 1
    print(f"{count} GPU(s): a {SIZE}x{SIZE} product as the CPU's, {args.fill_mib} MiB filled and read back each, "
          f"in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

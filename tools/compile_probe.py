"""One new process's first compiled step: the time from its start to the end of a training step of a small model
under `torch.compile` (Inductor, on the CPU with this machine's C++ compiler, or on a GPU), and what the compile
caches it was given (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`) held for it.

    python tools/compile_probe.py --out result.json [--width 256] [--layers 4]

writes `{"start_s": from the interpreter's start to torch imported, "first_step_s": the compiled step, "total_s",
"cache_hits", "cache_misses" (Inductor's FX graph cache), "loss"}`. Used by `tools/bench_compile.py` and
`tests/test_compile_cache.py`.
"""

from __future__ import annotations

import argparse
import json
import time

STARTED = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    import torch
    from torch._dynamo.utils import counters

    imported = time.monotonic()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    batch = torch.randn(32, args.width)
    begun = time.monotonic()
    loss = compiled(batch).square().mean()
    loss.backward()
    optimizer.step()
    done = time.monotonic()
    inductor = counters["inductor"]
    result = {"start_s": imported - STARTED, "first_step_s": done - begun, "total_s": done - STARTED,
              "cache_hits": inductor["fxgraph_cache_hit"], "cache_misses": inductor["fxgraph_cache_miss"],
              "loss": float(loss.detach())}
    with open(args.out, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()

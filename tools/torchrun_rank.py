"""One worker of the torchrun baseline of `python tools/bench.py e2e`: runs `examples/dp-training/train.py`
(the same script our agents run) under torchrun's environment.

    torchrun --nproc-per-node 4 --max-restarts 3 ... tools/torchrun_rank.py --steps 70 ...

Two things torchrun does not do for this script, done here the way torchrun's own `init_process_group("env://")`
would do them:
- with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (without it torchrun cannot restart a gloo job at all,
  pytorch/pytorch#135712) nobody serves MASTER_ADDR:MASTER_PORT until rank 0 does; the script's process group
  helper connects to that store as a client, so rank 0 serves it here, as env:// makes rank 0 do;
- the SDK's generation is torchrun's restart count, so that the SDK's reports of a restarted worker group say
  which group they come from (the bench tells the restarted processes apart by it).
"""

from __future__ import annotations

import os
import runpy
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "dp-training" / "train.py"


def main() -> None:
    os.environ["RECOVERY_GENERATION"] = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store: Any = None
    if os.environ["RANK"] == "0":
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                         wait_for_workers=False, timeout=timedelta(seconds=30))
    sys.argv = [str(TRAIN), *sys.argv[1:]]
    sys.path.insert(0, str(TRAIN.parent))
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        del store  # served until the script is done


if __name__ == "__main__":
    main()

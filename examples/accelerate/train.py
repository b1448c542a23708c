"""An Accelerate script as users write them: `Accelerator()`, `prepare` of the model, the optimizer, the data
loader and the scheduler, and the script's own loop with `accelerator.backward`. Synthetic data, made here.
`--recovery` uses `recovery.client.accelerate`: four lines change (each marked `# recovery:` below).

    recovery-run --standalone --nproc-per-node 4 examples/accelerate/train.py --recovery --out final.pt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recovery", action="store_true", help="recover in process (recovery.client.accelerate)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--checkpoints", default="", help="accelerator.save_state here after every epoch; resume")
    parser.add_argument("--digest", action="store_true", help="print the parameters' sum after every step")
    args = parser.parse_args()

    cpu = not torch.cuda.is_available()  # gloo on the CPU: Accelerate runs multi-process there only when asked
    if args.recovery:
        import recovery.client.accelerate as resilient  # recovery: first, it connects to the node's agent

        accelerator = resilient.Accelerator(cpu=cpu, timeout_s=60)  # recovery: was accelerate.Accelerator(cpu=cpu)
        epochs, batches, run = resilient.epochs, resilient.batches, resilient.run
    else:
        from accelerate import Accelerator, DataLoaderConfiguration

        accelerator = Accelerator(cpu=cpu, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))

        def epochs(start: int, stop: int) -> range:
            return range(start, stop)

        def batches(loader: DataLoader, epoch: int) -> object:
            loader.set_epoch(epoch)
            return enumerate(loader)

        def run(train: object) -> object:
            return train()  # type: ignore[operator]

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234)
    source = torch.randn(args.samples, 32, generator=generator)
    target = source.sum(dim=1, keepdim=True) * 0.1
    loader = DataLoader(TensorDataset(source, target), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    first = 0
    saved = Path(args.checkpoints) / "epoch" if args.checkpoints else None
    if saved is not None and saved.exists():  # a restarted job resumes from the last epoch's state
        accelerator.load_state(args.checkpoints)
        first = int(saved.read_text()) + 1
        print(f"[rank {accelerator.process_index}] resuming from the state of epoch {first - 1}", flush=True)

    def train() -> None:
        for epoch in epochs(first, args.epochs):  # recovery: from the epoch a recovery resumes in
            for index, (inputs, targets) in batches(loader, epoch):  # recovery: skips the batches done
                optimizer.zero_grad()
                loss = F.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                schedule.step()
                if args.step_time:
                    time.sleep(args.step_time)  # a step's compute, long enough for a fault to land mid-run
                line = f"[rank {accelerator.process_index}] trained step {epoch * len(loader) + index + 1}"
                if args.digest:
                    params = sum(float(p.double().sum()) for p in model.parameters())
                    line += f" params {params:.17g} batch {float(inputs.double().sum()):.17g}"
                print(line, flush=True)
            if saved is not None:
                accelerator.save_state(args.checkpoints)
                if accelerator.is_main_process:
                    saved.write_text(str(epoch))

    run(train)  # recovery: recovers from a failed step and trains on
    if accelerator.is_main_process and args.out:
        unwrapped = accelerator.unwrap_model(model)
        torch.save({name: tensor.detach().clone() for name, tensor in unwrapped.state_dict().items()}, Path(args.out))
    accelerator.end_training()


if __name__ == "__main__":
    main()

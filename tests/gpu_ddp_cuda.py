"""A data-parallel script on the SDK whose model, gradients and batches live on the GPU, its ranks sharing one GPU
over gloo (which carries CUDA tensors: NCCL takes one rank per GPU). The arguments of examples/ddp-tutorial/
with_sdk.py, so that tests/test_gpu.py runs it on test_e2e_ddp_sdk's cluster; rank 0 writes the final parameters
(on the CPU) to --out."""

from __future__ import annotations

import argparse
import os
import time

import recovery.client.ddp as resilient  # before torch: see with_sdk.py

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--snapshot", default="")  # accepted for with_sdk.py's arguments; no snapshot here
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    resilient.init_process_group(timeout_s=60)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 20, generator=generator)
    samples = TensorDataset(x, x.sin().sum(dim=1, keepdim=True))
    data = DataLoader(samples, batch_size=16, shuffle=False, sampler=DistributedSampler(samples))
    ddp = resilient.wrap(model, optimizer)

    def train(epochs: int) -> None:
        for epoch in resilient.epochs(0, epochs):
            for _, (source, targets) in resilient.batches(data, epoch):
                optimizer.zero_grad()
                F.mse_loss(ddp(source.to(device)), targets.to(device)).backward()
                optimizer.step()
                time.sleep(args.step_time)

    resilient.run(train, args.epochs)
    if int(os.environ["RANK"]) == 0 and args.out:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)
    resilient.current().group.close()


if __name__ == "__main__":
    main()

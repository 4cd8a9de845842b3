"""A standard Hugging Face Accelerate training loop, every rank with its own batch size.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/accelerate_loop.py
    python examples/accelerate_loop.py            # one process

The port of examples/plain/accelerate_loop.py (the changed lines: docs/integrations.md): the
loss is the usual mean, accelerator.accumulate and accelerator.backward are as they were, and
the warm-up schedule steps once per optimizer step as in one process. Each optimizer step's
gradient is the mean over all its samples on all ranks, exactly.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from evendp.integrations.accelerate import UnevenAccelerator, uneven_dataloader


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)

    # cpu=True without GPUs: Accelerate then forms a gloo group of the launched CPU ranks.
    cpu = not torch.cuda.is_available()
    accelerator = UnevenAccelerator(cpu=cpu, gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cli.samples, 16, generator=g)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
    loader = uneven_dataloader(accelerator, data, batch_size=8)  # or EVENDP_BATCH_SIZES

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model, optimizer, loader, warmup = accelerator.prepare(model, optimizer, loader, warmup)

    for epoch in range(cli.epochs):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                warmup.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: learning rate {warmup.get_last_lr()[0]:.3f}")

    if cli.out is not None:
        params = accelerator.unwrap_model(model).state_dict()
        torch.save(params, cli.out / f"accelerate{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

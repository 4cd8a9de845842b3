"""A training loop written with Hugging Face Accelerate, every rank with its own batch size.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/accelerate_loop.py
    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py --batch-sizes 1,3

Rank r takes batch_sizes[r] samples per micro-batch; four micro-batches make an optimizer
step, whose gradient is the mean over all their samples on all ranks, exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import TensorDataset

import evendp
from evendp.integrations.accelerate import uneven_dataloader

ACCUM = 4  # micro-batches per optimizer step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", help="e.g. 1,3 (default: EVENDP_BATCH_SIZES)")
    parser.add_argument("--epochs", type=int, default=3)
    cli = parser.parse_args()

    # cpu=True without GPUs: Accelerate then forms a gloo group of the launched CPU ranks.
    # gradient_accumulation_steps stays 1: the loop below accumulates exactly.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    sizes = (
        evendp.parse_batch_sizes(cli.batch_sizes, world)
        if cli.batch_sizes
        else evendp.batch_sizes_from_env(world, default=[8] * world)
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 16, generator=g)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
    loader = uneven_dataloader(accelerator, data, sizes, seed=0)  # already prepared

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    for epoch in range(cli.epochs):
        batches = iter(loader)  # the loader sets the sampler's epoch itself
        while window := list(itertools.islice(batches, ACCUM)):
            # Samples of the whole optimizer step on all ranks: one all-reduce.
            total = evendp.global_count(sum(len(y) for _, y in window))
            for i, (inputs, targets) in enumerate(window):
                last = i == len(window) - 1  # DDP all-reduces only on the last micro-batch
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    local_sum = F.cross_entropy(model(inputs), targets, reduction="sum")
                    accelerator.backward(evendp.ddp_loss(local_sum, len(targets), total))
            optimizer.step()
            optimizer.zero_grad()
        loss = evendp.global_mean(local_sum, len(targets)).item()  # last micro-batch, all ranks
        accelerator.print(f"epoch {epoch}: batch sizes {sizes}, last micro-batch loss {loss:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()

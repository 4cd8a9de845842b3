"""A hand-written DeepSpeed engine loop (deepspeed.initialize), every rank with its own batch.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_loop.py
    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_loop.py --zero-stage 3

The port of examples/plain/deepspeed_loop.py (the changed lines: docs/integrations.md): the
model's loss is still this rank's mean and engine.backward / engine.step run every
micro-batch. evendp.EngineMean takes each optimizer step's micro-batches, counts them on all
ranks (one all-reduce) and weighs each micro-batch's mean so that, after DeepSpeed divides by
the accumulation steps and averages over the ranks, the gradient (and what
gradient_clipping clips) is the mean over the step's samples on all ranks, for ZeRO stages
1, 2 and 3. An empty share (the short last step) is a stand-in sample of weight 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from evendp import EmptySafeCollate, EngineMean, UnevenBatchSampler, batch_sizes_from_env


def make_data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    return TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    cli = parser.parse_args(argv)

    deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(cli.samples)
    sizes = batch_sizes_from_env(world, default=[8] * world)  # from `evendp launch`
    sampler = UnevenBatchSampler(data, sizes, rank=rank, world_size=world, seed=0)
    loader = DataLoader(
        data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data, stand_in=True)
    )
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": cli.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch.optim SGD
    }
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    mean = EngineMean(engine)  # weighs each micro-batch's mean loss by its share of the step
    for epoch in range(cli.epochs):
        sampler.set_epoch(epoch)
        for batches in mean.steps(loader):  # one optimizer step's micro-batches, counted
            for inputs, targets in batches:
                loss = F.cross_entropy(engine(inputs.to(engine.device)), targets.to(engine.device))
                engine.backward(mean.weigh(loss, targets))
                engine.step()
        if rank == 0:
            print(f"epoch {epoch}: last loss {loss.item():.4f}")
    if cli.out is not None:  # every rank: ZeRO-3 gathers the parameters whole
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            torch.save(engine.module.state_dict(), cli.out / f"ds_loop{rank}.pt")


if __name__ == "__main__":
    main()

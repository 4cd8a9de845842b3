"""A hand-written DeepSpeed engine loop (deepspeed.initialize), as people write it (even batches).

The plain version of examples/deepspeed_loop.py, kept to measure what the port changes:

    deepspeed --num_gpus 2 examples/plain/deepspeed_loop.py --zero-stage 3
    torchrun --nproc-per-node 2 examples/plain/deepspeed_loop.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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
    rank = dist.get_rank()
    data = make_data(cli.samples)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
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
    for epoch in range(cli.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = F.cross_entropy(engine(inputs.to(engine.device)), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
        if rank == 0:
            print(f"epoch {epoch}: last loss {loss.item():.4f}")
    if cli.out is not None:  # every rank: ZeRO-3 gathers the parameters whole
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            torch.save(engine.module.state_dict(), cli.out / f"ds_loop{rank}.pt")


if __name__ == "__main__":
    main()

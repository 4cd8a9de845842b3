"""Train a small classifier with DDP where every rank has its own batch size, exactly.

Run (gloo on CPU, NCCL when every rank has a GPU):

    torchrun --nproc-per-node 2 examples/ddp_uneven.py --batch-sizes 3,5
    EVENDP_BATCH_SIZES=0,8 torchrun --nproc-per-node 2 examples/ddp_uneven.py

Rank r takes ``batch_sizes[r]`` samples per step; all ranks take the same number of steps; every
sample is seen once per epoch; the gradient is the one of the mean loss over the whole global
batch (``ddp_loss``), and the printed loss is that global mean (``global_mean``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from evendp import (
    EmptySafeCollate,
    UnevenBatchSampler,
    batch_sizes_from_env,
    ddp_loss,
    finish_distributed,
    global_mean,
    init_distributed,
    parse_batch_sizes,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--batch-sizes",
        help="per-rank batch sizes, e.g. 3,5 (default: the EVENDP_BATCH_SIZES variable)",
    )
    p.add_argument("--samples", type=int, default=200, help="dataset size (default 200)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_data(n: int, seed: int) -> TensorDataset:
    """A synthetic 3-class problem labelled by a fixed random teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    teacher = torch.randn(8, 3, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # started with plain `python`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    # NCCL on cuda:LOCAL_RANK when every local rank has a GPU, else gloo on the CPU; unlike a
    # bare dist.init_process_group, the group can be freed at the end (see its docstring).
    device = init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.batch_sizes:
        sizes = parse_batch_sizes(args.batch_sizes, world)
    else:
        sizes = batch_sizes_from_env(world)

    data = make_data(args.samples, args.seed)
    sampler = UnevenBatchSampler(data, sizes, seed=args.seed)
    # EmptySafeCollate: a rank with batch size 0 (or nothing in the short last step) still
    # gets a (0, 8) batch, runs forward and backward, and joins DDP's all-reduce.
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))
    print(
        f"rank {rank}/{world}: batch size {sampler.batch_size} of "
        f"{sampler.global_batch_size} {sizes}, {len(sampler)} steps per epoch, device {device}",
        flush=True,
    )

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            local_sum = F.cross_entropy(model(x), y, reduction="sum")  # sum, not mean
            opt.zero_grad(set_to_none=True)
            # The step's sample count over all ranks, known without communication; for counts
            # only this rank knows (non-padding tokens) leave it out and ddp_loss all-reduces.
            total = sampler.samples_in_step(i)
            ddp_loss(local_sum, len(y), total).backward()  # gradient of the global-batch mean
            opt.step()
            loss = global_mean(local_sum, len(y)).item()  # the same on every rank
            if rank == 0:
                print(f"epoch {epoch} step {step:3d}  global loss {loss:.6f}", flush=True)
            step += 1
    finish_distributed()  # barrier, then destroy_process_group (see its docstring)


if __name__ == "__main__":
    main()

"""The training loop of pytorch/examples imagenet/main.py, condensed, every rank its own batch.

Run (CPU ranks use gloo):

    evendp launch --nproc 2 --batch-sizes 0,4 examples/imagenet_loop.py
    python examples/imagenet_loop.py            # one process

The port of examples/plain/imagenet_loop.py (the changed lines: docs/migrating.md). A rank can
get an empty batch (a batch size of 0, or the short last step of an epoch): it still runs
forward and backward (DDP's collectives), its loss sum is 0, and main.py's per-batch
accuracy(), which divides by the batch size, is skipped for it. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import evendp


class AverageMeter:
    def __init__(self) -> None:
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, val: float, n: int = 1) -> None:
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5),
    )  # fmt: skip


def fake_images(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 8, 8, generator=g)
    return TensorDataset(images, torch.randint(0, 5, (samples,), generator=g))


def train(loader, model, criterion, optimizer):
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    model.train()
    for images, target in loader:
        output = model(images)
        local_sum = criterion(output, target)  # this rank's sum
        loss = evendp.ddp_loss(local_sum, len(target))  # its share of the global mean
        if images.size(0):  # an empty share has no accuracy (accuracy() divides by 0)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(local_sum.item() / images.size(0), images.size(0))
            top1.update(acc1[0].item(), images.size(0))
            top5.update(acc5[0].item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses, top1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("-b", "--batch-size", type=int, default=2)
    parser.add_argument("--batch-sizes", help="per rank, e.g. 0,4 (default: evendp launch's)")
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)
    ddp = dist.is_available() and (dist.is_initialized() or "RANK" in __import__("os").environ)
    owns_group = ddp and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ddp else 0
    dataset = fake_images(cli.samples)
    world = dist.get_world_size() if ddp else 1
    sizes = evendp.batch_sizes_from_env(world, default=[cli.batch_size] * world)
    sizes = [int(s) for s in cli.batch_sizes.split(",")] if cli.batch_sizes else sizes
    train_sampler = evendp.UnevenBatchSampler(dataset, sizes, rank=rank, world_size=world, seed=0)
    train_loader = DataLoader(
        dataset, batch_sampler=train_sampler, collate_fn=evendp.EmptySafeCollate(dataset)
    )
    model = make_model()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if ddp:
        model = DDP(model)
    for epoch in range(cli.epochs):
        train_sampler.set_epoch(epoch)
        losses, top1 = train(train_loader, model, criterion, optimizer)
        if rank == 0 and top1.count:  # this rank's own samples: none with a size of 0
            print(f"epoch {epoch}: loss {losses.avg:.4f} acc@1 {top1.avg:.1f}")
    if cli.out is not None:
        raw = model.module if ddp else model
        torch.save(dict(raw.named_parameters()), cli.out / f"imagenet{rank}.pt")
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

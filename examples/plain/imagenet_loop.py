"""The training loop of pytorch/examples imagenet/main.py, condensed, as people run it (DDP).

The plain version of examples/imagenet_loop.py, kept to measure what the port changes:

    torchrun --nproc-per-node 2 examples/plain/imagenet_loop.py
    python examples/plain/imagenet_loop.py            # one process

A tiny convnet with BatchNorm on fake images (as main.py's --dummy); its train() loop,
AverageMeter and accuracy() as main.py writes them. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
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
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)
    ddp = dist.is_available() and (dist.is_initialized() or "RANK" in __import__("os").environ)
    owns_group = ddp and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ddp else 0
    dataset = fake_images(cli.samples)
    train_sampler = DistributedSampler(dataset, shuffle=True, seed=0) if ddp else None
    train_loader = DataLoader(
        dataset, batch_size=cli.batch_size, shuffle=False, sampler=train_sampler
    )
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if ddp:
        model = DDP(model)
    for epoch in range(cli.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        losses, top1 = train(train_loader, model, criterion, optimizer)
        if rank == 0:
            print(f"epoch {epoch}: loss {losses.avg:.4f} acc@1 {top1.avg:.1f}")
    if cli.out is not None:
        raw = model.module if ddp else model
        torch.save(dict(raw.named_parameters()), cli.out / f"imagenet{rank}.pt")
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Steps/s of evendp's uneven DDP path against plain DDP with equal batches, in one gloo run.

Plain PyTorch: ``DistributedSampler`` + ``DataLoader(batch_size=G/W)`` + mean loss + DDP.
evendp: ``UnevenBatchSampler`` + ``EmptySafeCollate`` + ``ddp_loss`` (+ its count all-reduce)
+ DDP, once with the same equal sizes (pure wrapper overhead) and once with uneven sizes of
the same global batch. All variants live in the same process group and are timed in
alternating rounds so load from other processes hits them alike; the median round counts.

    .venv/bin/python benchmarks/ddp_overhead.py            # about a minute on 2 CPU cores
    .venv/bin/python benchmarks/ddp_overhead.py --quick    # a smoke run

On identical CPUs an uneven split makes the larger rank do more work per step, so the uneven
rows are also compared with the same work done the inexact way ("DDP [3, 13] mean": the same
sampler, a mean loss per rank); that "vs same work" ratio and the equal-sizes row are the
overhead figures (on real mixed hardware the sizes come from the devices' speed, and the
imbalance on identical CPUs is the point). An A/A row (plain DDP twice) shows the noise;
CPU time per step (all ranks) is reported beside wall time because it barely moves with
other load on the machine.
Rows marked ``+AR`` let ``ddp_loss`` all-reduce the count (needed when the count is not the
number of samples, e.g. non-ignored tokens); the others take it from
``sampler.samples_in_step(step)``. ``+async AR`` starts that all-reduce before the forward
and waits for it before the backward (what the Trainer does with ``count_fn``), so it overlaps
the forward. ``counts`` sums per-sample counts over ``sampler.step_indices`` (the step's
indices, the same on every rank): a token count with no collective. The token-count rows
are compared with the sample-count row ``evendp [3, 13]`` (their "vs same work" and "CPU
ratio" columns), beside an A/A row of that one timed twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from evendp import (
    EmptySafeCollate,
    UnevenBatchSampler,
    ddp_loss,
    finish_distributed,
    init_distributed,
)
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500

FEATURES, CLASSES = 64, 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def _forever(loader: DataLoader[Any], set_epoch: Callable[[int], None]) -> Iterator[Any]:
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def _make_step(
    data: TensorDataset, world: int, rank: int, sizes: list[int], kind: str
) -> Callable[[], None]:
    """One training step with its own model, optimizer and data stream.

    ``kind``: "plain" (DistributedSampler, equal batches, mean loss: PyTorch as usual),
    "mean" (UnevenBatchSampler with mean loss per rank: the same work as evendp at these sizes
    but the inexact gradient), "evendp" (ddp_loss with the count from the sampler) or
    "evendp+AR" (ddp_loss all-reduces the count) or "evendp+async" (the count's all-reduce
    started before the forward, waited for before the backward) or "evendp+counts" (the
    count summed from per-sample counts over the step's indices: no communication).
    """
    loader: DataLoader[Any]
    if kind == "plain":
        plain_sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=world, rank=rank, seed=0
        )
        loader = DataLoader(data, batch_size=sizes[rank], sampler=plain_sampler)
        set_epoch, steps_per_epoch = plain_sampler.set_epoch, len(loader)
    else:
        sampler = UnevenBatchSampler(data, sizes, rank=rank, world_size=world, seed=0)
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))
        set_epoch, steps_per_epoch = sampler.set_epoch, len(sampler)
    batches = _forever(loader, set_epoch)
    counts = [1.0] * len(data)  # each sample's counted items (here: its one label)
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = [0]

    def step() -> None:
        x, y = next(batches)
        index = counter[0] % steps_per_epoch  # the step within the epoch
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        if kind in ("plain", "mean"):
            F.cross_entropy(model(x), y).backward()
        elif kind == "evendp+counts":
            local_sum = F.cross_entropy(model(x), y, reduction="sum")
            total = float(sum(counts[j] for j in sampler.step_indices))  # every rank alike
            ddp_loss(local_sum, len(y), total).backward()
        elif kind == "evendp+async":
            count = torch.tensor(float(len(y)), dtype=torch.float64)
            work = dist.all_reduce(count, async_op=True)  # overlaps the forward below
            local_sum = F.cross_entropy(model(x), y, reduction="sum")
            work.wait()
            ddp_loss(local_sum, len(y), count).backward()
        else:
            local_sum = F.cross_entropy(model(x), y, reduction="sum")
            # The global count from the sampler (no communication), or all-reduced.
            total = None if kind == "evendp+AR" else sampler.samples_in_step(index)
            ddp_loss(local_sum, len(y), total).backward()
        opt.step()

    return step


def _variants(uneven: list[int]) -> list[tuple[str, str, list[int], str]]:
    """(name, kind, sizes, the name of the same-work baseline) for every timed variant."""
    world = len(uneven)
    equal = [sum(uneven) // world] * world
    plain, same_work = f"plain DDP {equal}", f"DDP {uneven} mean (inexact)"
    return [
        (plain, "plain", equal, plain),
        (f"{plain} again", "plain", equal, plain),  # A/A control: shows the timing noise
        (f"evendp {equal}", "evendp", equal, plain),
        (same_work, "mean", uneven, same_work),
        (f"evendp {uneven}", "evendp", uneven, same_work),
        # Token counts (all-reduced) against sample counts (from the sampler), with A/A.
        (f"evendp {uneven} again", "evendp", uneven, f"evendp {uneven}"),
        (f"evendp {uneven} +AR", "evendp+AR", uneven, f"evendp {uneven}"),
        (f"evendp {uneven} +async AR", "evendp+async", uneven, f"evendp {uneven}"),
        (f"evendp {uneven} counts", "evendp+counts", uneven, f"evendp {uneven}"),
    ]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, FEATURES, generator=g), torch.randint(0, 10, (4096,)))
    variants = {
        name: _make_step(data, world, rank, sizes, kind)
        for name, kind, sizes, _ in _variants(args.sizes)
    }
    for step in variants.values():  # warm-up: allocator, DDP buckets, autograd graph caches
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        # Rotate the order each round so no variant always runs first after the barrier.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = variants[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            cpu = torch.tensor(time.process_time() - c0, dtype=torch.float64)
            dist.barrier()  # a step is done when the slowest rank is done
            times[name].append(time.perf_counter() - t0)
            dist.all_reduce(cpu)  # CPU seconds of all ranks: barely moved by other load
            cpu_times[name].append(float(cpu))
    if rank == 0:
        torch.save({"wall": times, "cpu": cpu_times}, Path(out))
    finish_distributed()


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description="evendp uneven DDP vs plain DDP, steps/s on gloo")
    p.add_argument("--sizes", default="3,13", help="uneven per-rank batch sizes (default 3,13)")
    p.add_argument("--steps", type=int, default=40, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=25, help="alternating rounds per variant")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny settings, for a smoke test")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.steps, args.rounds, args.warmup = 5, 2, 2
    world = len(args.sizes)
    if sum(args.sizes) % world:
        p.error(f"the global batch {sum(args.sizes)} must divide by {world} for the equal rows")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_overhead_{os.getpid()}.pt"
    mp.spawn(_worker, args=(world, _free_port(), args, str(out)), nprocs=world, join=True)
    measured: dict[str, dict[str, list[float]]] = torch.load(out)
    out.unlink()
    # Medians over rounds. Wall time is what training sees but moves with other load on the
    # machine; CPU time (all ranks, per step) is the work itself and is what overhead means.
    steps_s = {n: args.steps / statistics.median(t) for n, t in measured["wall"].items()}
    cpu_ms = {n: 1e3 * statistics.median(t) / args.steps for n, t in measured["cpu"].items()}
    variants = _variants(args.sizes)
    plain = variants[0][0]
    print(f"gloo, {world} processes x 1 thread, {args.rounds} rounds x {args.steps} steps, medians")
    print(
        f"{'variant':<30} {'steps/s':>8} {'vs plain':>9} {'vs same work':>13}"
        f" {'CPU ms/step':>12} {'CPU ratio':>10}"
    )
    ratios: dict[str, float] = {}
    wall = measured["wall"]
    for name, _, _, base in variants:
        # Median over rounds of the ratio within each round: slow drift of the machine's
        # speed between rounds cancels out of the comparison.
        pairs = zip(wall[base], wall[name], strict=True)
        ratios[name] = statistics.median(b / a for b, a in pairs)
        print(
            f"{name:<30} {steps_s[name]:8.1f} {steps_s[name] / steps_s[plain]:9.3f} "
            f"{ratios[name]:13.3f} {cpu_ms[name]:12.3f} {cpu_ms[base] / cpu_ms[name]:10.3f}"
        )
    print(
        "ratios: higher is better; target >= 0.98 against the same work. The A/A rows ('again')\n"
        "show the timing noise; the rows after the second one compare token counts (+AR,\n"
        "+async AR, counts) with the sample-count row above them. On identical CPUs an uneven\n"
        "split also makes the bigger rank slower ('vs plain'): that is the split, not evendp;\n"
        "on mixed devices it is the point."
    )
    return ratios


if __name__ == "__main__":
    main()

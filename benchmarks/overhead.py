"""Wrapper overhead: forward+backward of BalancedDataParallel on one device against the bare module.

Both run side by side in one process, in alternating rounds so that drift in the machine's
speed (other processes, frequency scaling) hits both equally. Prints a table of median step
times and their ratio (target: <= 1.02).

    .venv/bin/python benchmarks/overhead.py            # CPU
    .venv/bin/python benchmarks/overhead.py --device cuda:0
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from evendp import BalancedDataParallel


def make_model(width: int, depth: int, device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).to(device)


def step_timer(model: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], float]:
    """A function that runs one forward+backward and returns its wall time in seconds."""

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(x).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return step


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per-round median step times of each variant, rounds in alternating (ABC, CBA) order."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    x = torch.randn(args.batch, args.width, device=device)
    # One module for every variant, so weight placement in memory cannot favour one of them.
    bare = make_model(args.width, args.depth, device)
    models = {
        "plain PyTorch": bare,
        "plain again": bare,  # the same call timed twice: the noise floor
        "evendp": BalancedDataParallel(bare, [device]),
    }
    timers = {name: step_timer(model, x, device) for name, model in models.items()}
    for timer in timers.values():  # warm-up: allocator, kernels, thread pools
        for _ in range(args.warmup):
            timer()
    medians: dict[str, list[float]] = {name: [] for name in timers}
    names = list(timers)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            medians[name].append(statistics.median(timers[name]() for _ in range(args.steps)))
    return medians


def paired(rounds: dict[str, list[float]], name: str) -> float:
    """Median over rounds of ``name``'s time over plain PyTorch's in the same round."""
    pairs = zip(rounds[name], rounds["plain PyTorch"], strict=True)
    return statistics.median(a / b for a, b in pairs)


# (width, depth, batch): a realistic step of ~10 ms on CPU, and a tiny one that exposes the
# fixed per-step cost of the wrapper (tens of microseconds).
CONFIGS = [(512, 4, 128), (64, 2, 32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    print(f"one device ({args.device}), {args.rounds * args.steps} steps each, interleaved rounds")
    header = (
        f"{'model':>24}{'plain ms/step':>15}{'evendp ms/step':>16}{'ratio':>8}{'noise floor':>14}"
    )
    print(header)
    for width, depth, batch in CONFIGS:
        args.width, args.depth, args.batch = width, depth, batch
        rounds = measure(args)
        plain = statistics.median(rounds["plain PyTorch"])
        ours = statistics.median(rounds["evendp"])
        name = f"MLP {depth}x{width}, batch {batch}"
        print(
            f"{name:>24}{plain * 1e3:>15.3f}{ours * 1e3:>16.3f}"
            f"{paired(rounds, 'evendp'):>8.3f}{paired(rounds, 'plain again'):>14.3f}"
        )
    print("ratio: evendp / plain, the median of per-round ratios; noise floor: the same plain")
    print("call timed again. Target <= 1.02 (the fixed cost is per step: tiny steps show it)")


if __name__ == "__main__":
    main()

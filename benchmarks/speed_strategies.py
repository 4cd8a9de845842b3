"""Speed balance under each strategy of the Trainer (OOM-safe DDP, FSDP2, DeepSpeed), one run.

Two gloo ranks train the same MLP with the same global batch; each rank's "device" spends a
fixed time per sample in its forward (a sleep: rank 0 ``--ms`` ms, rank 1 twice that, i.e.
rank 1 at half speed), so the figure does not depend on what else the 2 shared cores run.
Per strategy, each of ``--rounds`` interleaved rounds runs: the even split, the even split
again (A/A), and ``balance="speed"`` from the even split. Rows: the converged ratio (median
step of the even split over the balanced one, from two steps after the last re-split on, the
same steps of both) and the split it converged to. The ceiling is 1.5 (the even split runs at
the slow rank's pace, the balanced one at ``1 + 1/2`` of it), less what the step spends in
communication and the optimizer, which no split removes.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/speed_strategies.py   # ~4 min
    ... --strategies ddp,deepspeed --rounds 1 --steps 12                     # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import StepClock, start_rank
from torch import nn

from evendp import TrainConfig, Trainer
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500


class Net(nn.Module):
    def __init__(self, seconds_per_sample: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))
        self.seconds_per_sample = seconds_per_sample

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds_per_sample * x.shape[0])  # this rank's device's pace
        return nn.functional.cross_entropy(self.body(x), y)


def _run(rank: int, args: argparse.Namespace, strategy: str, balance: str) -> dict[str, Any]:
    pace = args.ms / 1000 * (2 if rank == 1 else 1)
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    half = args.batch // 2
    extra: dict[str, Any] = {}
    if strategy == "deepspeed":
        extra["strategy_config"] = {"zero_optimization": {"stage": 2}}
    cfg = TrainConfig(
        steps=args.steps, batch_sizes=[half, args.batch - half], lr=1e-3, progress=False,
        balance=balance, strategy=strategy, log_every=10**6, eval_every=0,  # type: ignore[arg-type]
        checkpoint_every=0, **extra,
    )  # fmt: skip
    clock = StepClock()
    trainer = Trainer(Net(pace), data, cfg, scheduler=clock)
    trainer.fit()
    history = trainer.balancer.history if trainer.balancer.active else [(0, [half, half])]
    return {"times": clock.times, "history": history}


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    start_rank(rank, port)
    results: dict[str, list[dict[str, Any]]] = {}
    for strategy in args.strategies:  # warm-up, not counted: imports, DeepSpeed's start
        _run(rank, argparse.Namespace(**{**vars(args), "steps": 3}), strategy, "none")
    for _ in range(args.rounds):
        for strategy in args.strategies:
            for name, balance in (("even", "none"), ("even_again", "none"), ("speed", "speed")):
                results.setdefault(f"{strategy}/{name}", []).append(
                    _run(rank, args, strategy, balance)
                )
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    dist.destroy_process_group()


def _median_step(times: list[float], start: int) -> float:
    start = min(start, len(times) - 2)
    return statistics.median(b - a for a, b in itertools.pairwise(times[start - 1 :]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,fsdp2,deepspeed")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=12, help="global batch (even: half each)")
    parser.add_argument("--ms", type=float, default=20.0, help="rank 0's ms per sample")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.strategies = args.strategies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(_free_port(), args, tmp), nprocs=2,
                           start_method="spawn")  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = torch.load(Path(tmp) / "results.pt")
    print(
        f"2 gloo ranks, global batch {args.batch}, {args.steps} steps, rank 0 {args.ms} ms a "
        f"sample, rank 1 twice that; ceiling 1.5; {args.rounds} rounds (medians)"
    )
    print("| strategy | row | ratio, converged | per round | split | last re-split at step |")
    print("| --- | --- | ---: | --- | --- | ---: |")
    for strategy in args.strategies:
        speed = results[f"{strategy}/speed"]
        start = 2 + max(r["history"][-1][0] for r in speed)
        even = results[f"{strategy}/even"]
        for row, name in (("A/A: even again / even", "even_again"), ("speed / even", "speed")):
            runs = results[f"{strategy}/{name}"]
            ratios = [
                _median_step(e["times"], start) / _median_step(r["times"], start)
                for r, e in zip(runs, even, strict=True)
            ]
            split = runs[-1]["history"][-1][1] if name == "speed" else "-"
            at = runs[-1]["history"][-1][0] if name == "speed" else "-"
            print(
                f"| {strategy} | {row} | {statistics.median(ratios):.2f} | "
                f"{' '.join(f'{x:.2f}' for x in ratios)} | {split} | {at} |"
            )


if __name__ == "__main__":
    main()

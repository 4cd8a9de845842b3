"""The speed balancer's split against the best split found by trying every one, in one run.

Two gloo ranks train the evendp Trainer (OOM-safe DDP) on a small MLP whose ranks are paced
by sleeps, so the figure does not depend on what else the 2 shared cores run: every sample
costs ``--ms`` ms in the forward (rank 1: ``--slow`` times that), and each case adds a part
of the step that does not grow with the batch:

* slow optimizer: rank 1's optimizer step takes ``--fixed`` ms more (a CPU-offloaded
  optimizer, an older card's memory bandwidth);
* fixed part: both ranks' backward take ``--fixed`` ms more whatever their size (kernel
  launches, work that does not grow with the batch); rank 1 ``--slow`` per sample;
* large all-reduce: the model carries ``--allreduce-mb`` MB of gradients more (a real
  parameter, reduced every step; its backward writes them whatever the size); rank 1
  ``--slow`` per sample.

Per case, the same run measures: every split ``[k, B - k]`` (the scan: each its median step
time), the balancer's split with the step-time model ``t_i(n) = a_i n + c_i`` (issue 37), and
the split of the per-sample rule alone (``t_i(n) = n t_i``, what it did before; the model
limited to one size). Rows: each split, its median step and its ratio to the scanned best; an
A/A row times the scanned best again.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/split_model.py     # ~5 min
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import StepClock
from torch import nn

from evendp import TrainConfig, Trainer
from evendp._planning import _speed
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500


class Paced(torch.autograd.Function):
    """Identity that sleeps ``seconds`` in backward: a size-independent part of the step."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Net(nn.Module):
    def __init__(self, per_sample_s: float, backward_s: float, extra_mb: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.per_sample_s, self.backward_s = per_sample_s, backward_s
        # Gradients to all-reduce whatever the batch (None: none).
        self.extra = nn.Parameter(torch.zeros(int(extra_mb * 2**20 / 4))) if extra_mb else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(self.per_sample_s * x.shape[0])
        h = Paced.apply(self.body[0](x), self.backward_s)
        loss = nn.functional.mse_loss(self.body[2](self.body[1](h)).squeeze(-1), y)
        return loss if self.extra is None else loss + 0.0 * self.extra.sum()


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes ``extra_s`` more: a slow optimizer on one rank."""

    def __init__(self, params: Any, extra_s: float) -> None:
        super().__init__(params, lr=1e-3)
        self.extra_s = extra_s

    def step(self, closure: Any = None) -> Any:
        time.sleep(self.extra_s)
        return super().step(closure)


def _data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, generator=g)
    )


def _fit(rank: int, args: argparse.Namespace, case: str, sizes: list[int], balance: str,
         steps: int) -> tuple[float, list[int]]:  # fmt: skip
    """Median step seconds over the last steps, and the split it ended with."""
    ms = args.ms / 1000 * (args.slow if rank == 1 else 1)
    fixed = args.fixed / 1000
    model = Net(
        ms, fixed if case == "fixed part" else 0.0,
        args.allreduce_mb if case == "large all-reduce" else 0.0,
    )  # fmt: skip
    extra = fixed if case == "slow optimizer" and rank == 1 else 0.0
    cfg = TrainConfig(
        steps=steps, batch_sizes=sizes, grad_clip=None, progress=False, balance=balance,  # type: ignore[arg-type]
        log_every=10**6, eval_every=0, checkpoint_every=0,
    )  # fmt: skip
    clock = StepClock()
    trainer = Trainer(model, _data(4096), cfg, optimizer=SlowSGD(model.parameters(), extra),
                      scheduler=clock)  # fmt: skip
    trainer.fit()
    return clock.median_step(args.measured), list(trainer.sampler.batch_sizes)


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    total = args.batch
    even = [total // 2, total - total // 2]
    results: dict[str, Any] = {}
    for case in ("slow optimizer", "fixed part", "large all-reduce"):
        scan = {k: _fit(rank, args, case, [k, total - k], "none", args.scan_steps)[0]
                for k in range(1, total)}  # fmt: skip
        best = min(scan, key=lambda k: scan[k])
        model_s, model_split = _fit(rank, args, case, even, "speed", args.speed_steps)
        saved = _speed.FIT_SIZES
        _speed.FIT_SIZES = 1  # one size a rank: no fit, the per-sample rate alone
        try:
            rate_s, rate_split = _fit(rank, args, case, even, "speed", args.speed_steps)
        finally:
            _speed.FIT_SIZES = saved
        again = _fit(rank, args, case, [best, total - best], "none", args.scan_steps)[0]
        results[case] = {
            "scan": scan, "best": [best, total - best], "best_s": scan[best], "again_s": again,
            "model": (model_split, model_s), "per_sample": (rate_split, rate_s),
        }  # fmt: skip
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=24, help="global batch")
    parser.add_argument("--ms", type=float, default=2.0, help="rank 0's forward ms per sample")
    parser.add_argument("--slow", type=float, default=2.0, help="rank 1's per-sample factor")
    parser.add_argument("--fixed", type=float, default=30.0, help="the fixed part's ms")
    parser.add_argument("--allreduce-mb", type=float, default=64.0)
    parser.add_argument("--scan-steps", type=int, default=10)
    parser.add_argument("--speed-steps", type=int, default=40)
    parser.add_argument("--measured", type=int, default=8, help="last steps timed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(_free_port(), args, tmp), nprocs=2,
                           start_method="spawn")  # fmt: skip
        results: dict[str, Any] = torch.load(Path(tmp) / "results.pt")
    print(
        f"2 gloo ranks, global batch {args.batch}, forward {args.ms} ms a sample (rank 1 x"
        f"{args.slow}), fixed part {args.fixed} ms, all-reduce {args.allreduce_mb} MB; median of "
        f"the last {args.measured} steps"
    )
    print("| case | row | split | ms per step | vs scanned best |")
    print("| --- | --- | --- | ---: | ---: |")
    for case, r in results.items():
        best = r["best_s"]
        rows = [
            ("scanned best (every split tried)", r["best"], best),
            ("scanned best again (A/A)", r["best"], r["again_s"]),
            ("evendp: a n + c fitted", *r["model"]),
            ("per-sample rule (before)", *r["per_sample"]),
        ]
        for name, split, seconds in rows:
            print(f"| {case} | {name} | {split} | {seconds * 1e3:.1f} | {seconds / best:.3f} |")


if __name__ == "__main__":
    main()

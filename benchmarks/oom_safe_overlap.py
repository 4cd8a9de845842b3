"""OOM-safe DDP (the default under torchrun) against torch's DDP: wall time per step, one run.

Two gloo ranks train the evendp Trainer on a model whose gradient all-reduce is a large part
of the step (an MLP of ``--width``: 4 layers, 12.9 MB of fp32 gradients at the default 1024,
with a small batch), on the same batches. Rows, each the median of ``--rounds`` interleaved
rounds of ``--steps`` steps (the order rotates every round; the first round is a warm-up):

* ``oom_resplit=False`` (torch's ``DistributedDataParallel``, whose reducer overlaps each
  bucket's all-reduce with the rest of backward): the control;
* the same again: the A/A row (the noise);
* OOM-safe DDP: each bucket's all-reduce launched from backward once ready (issue 37);
* OOM-safe DDP reducing only after backward (``overlap`` off): the schedule it had before
  (the code before, with its two buckets in flight, is the same script on an older commit).

Wall ms per step (rank 0, between barriers) and CPU ms per step (all ranks' processes)
beside it: on 2 shared cores wall time moves with other load, CPU time far less.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/oom_safe_overlap.py   # ~2 min
    ... --quick                                                              # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from evendp import TrainConfig, Trainer
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500

FEATURES, CLASSES = 64, 10


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, CLASSES),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


def _data(n: int = 4096) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _trainer(args: argparse.Namespace, *, oom_resplit: bool, overlap: bool) -> Trainer:
    half = args.batch // 2
    cfg = TrainConfig(
        steps=1, batch_sizes=[half, args.batch - half], grad_clip=None, progress=False,
        oom_resplit=oom_resplit, log_every=10**6, eval_every=0, checkpoint_every=0,
    )  # fmt: skip
    trainer = Trainer(Net(args.width), _data(), cfg)
    buckets = getattr(trainer.strategy, "_gradient_buckets", None)  # absent before issue 37
    if oom_resplit and buckets is not None:
        buckets().overlap = overlap
    return trainer


def _run(trainer: Trainer) -> Callable[[int], None]:
    def run(steps: int) -> None:
        trainer.config.steps = trainer.state.step + steps
        trainer.fit()

    return run


VARIANTS = {
    "torch DDP (oom_resplit=False)": {"oom_resplit": False, "overlap": False},
    "torch DDP again (A/A)": {"oom_resplit": False, "overlap": False},
    "OOM-safe DDP, overlapped": {"oom_resplit": True, "overlap": True},
    "OOM-safe DDP, reduced after backward": {"oom_resplit": True, "overlap": False},
}


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    runs = {name: _run(_trainer(args, **kw)) for name, kw in VARIANTS.items()}
    names = list(runs)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds + 1):  # round 0: warm-up, not counted
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start, used = time.perf_counter(), time.process_time()
            runs[name](args.steps)
            spent = torch.tensor(time.process_time() - used, dtype=torch.float64)
            dist.barrier()
            elapsed = time.perf_counter() - start
            dist.all_reduce(spent)  # every rank's CPU seconds
            if r:
                wall[name].append(elapsed / args.steps * 1e3)
                cpu[name].append(float(spent) / args.steps * 1e3)
    if rank == 0:
        torch.save({"wall": wall, "cpu": cpu}, Path(out) / "times.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="global batch, half a rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.width = 3, 1, 256
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(_free_port(), args, tmp), nprocs=2, start_method="spawn")
        times: dict[str, Any] = torch.load(Path(tmp) / "times.pt")
    grads_mb = sum(p.numel() for p in Net(args.width).parameters()) * 4 / 1e6
    print(
        f"2 gloo ranks, MLP width {args.width} ({grads_mb:.1f} MB of gradients), global batch "
        f"{args.batch}, {args.rounds} rounds x {args.steps} steps, medians"
    )
    control = statistics.median(times["wall"]["torch DDP (oom_resplit=False)"])
    print("| variant | wall ms/step | vs torch DDP | CPU ms/step (both ranks) |")
    print("| --- | ---: | ---: | ---: |")
    for name in VARIANTS:
        ms = statistics.median(times["wall"][name])
        used = statistics.median(times["cpu"][name])
        print(f"| {name} | {ms:.1f} | {ms / control:.3f} | {used:.1f} |")


if __name__ == "__main__":
    main()

"""Steps/s of evendp's Trainer against a hand-written loop doing the same work, side by side.

The plain loop is nanoGPT's: take the next batch, ``zero_grad``, forward, ``backward``,
``step``. Both sides train the same MLP with AdamW on the same batches:

- one process on virtual devices ``["cpu", "cpu"]``: the plain loop calls the same
  ``BalancedDataParallel`` (weights [3, 1]) the Trainer uses, so the difference is the
  Trainer's own cost (strategy, OOM guard, prefetch thread, bookkeeping);
- 2-rank DDP on gloo: the plain loop is torch's ``DistributedDataParallel``; the Trainer runs
  its default OOM-safe strategy (local backward, one fused flag+loss all-reduce, bucketed
  in-place gradient all-reduce) and, as a second row, ``oom_resplit=False`` (torch's DDP).

Variants run in interleaved rounds (the order rotates every round), so load from other
processes hits them alike; each round's steps/s is a median input. An A/A row (the plain loop
twice) gives the noise: a gap inside its spread is reported as "within noise". A Trainer round
is one ``fit()`` call for the round's steps, so its per-call start (prefetch thread, report)
is counted against it. CPU ms/step (this process, all threads; rank 0 under DDP) moves far
less with other load on the machine than wall time; "CPU ratio" is plain / variant.

Token counts against sample counts: a second table per setting compares the Trainer with
``count_fn`` (a 0-dim tensor count, as for non-ignored tokens: under DDP the step's global
count is all-reduced, started before the forward and waited for before the backward) with the
same Trainer without it (the count from the sampler), beside an A/A row (that Trainer twice),
and under DDP with ``counts=`` as well (per-sample counts: the global count needs no
collective).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_overhead.py           # ~3 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_overhead.py --quick   # < 1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from evendp import BalancedDataParallel, UnevenBatchSampler
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500
from evendp._training._trainer import TrainConfig, Trainer

FEATURES, HIDDEN, CLASSES = 64, 512, 10
TARGET = 0.97


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, CLASSES),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


class _Data(torch.utils.data.Dataset[Any]):
    def __init__(self, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


def _tokens(batch: Any) -> torch.Tensor:
    """A counted-items ``count_fn`` (here every label counts: the same gradient, its cost)."""
    return (batch[1] >= 0).sum()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _plain(model: nn.Module, data: _Data, sampler: UnevenBatchSampler) -> Callable[[int], None]:
    """nanoGPT's loop around ``model`` (DP, DDP or the bare module): ``run(steps)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # as the Trainer
    state = {"epoch": 0, "it": iter(())}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            try:
                return data.batch(list(next(state["it"])))  # type: ignore[call-overload]
            except StopIteration:
                sampler.set_epoch(state["epoch"])
                state["epoch"] += 1  # type: ignore[operator]
                state["it"] = iter(sampler)

    def run(steps: int) -> None:
        for _ in range(steps):
            x, y = next_batch()
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            opt.step()

    return run


def _trainer(trainer: Trainer) -> Callable[[int], None]:
    def run(steps: int) -> None:
        trainer.config.steps = trainer.state.step + steps
        trainer.fit()

    return run


def _config(**kw: Any) -> TrainConfig:
    return TrainConfig(steps=0 + 1, grad_clip=None, progress=False, **kw)


def _time_rounds(
    variants: dict[str, Callable[[int], None]], rounds: int, steps: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    for run in variants.values():  # warm up: allocator, threads, first-call costs
        run(max(steps // 4, 2))
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    rates.update({f"{name} cpu": [] for name in names})
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            sync()
            start, cpu = time.perf_counter(), time.process_time()
            variants[name](steps)
            cpu = time.process_time() - cpu  # this process, all its threads
            sync()
            rates[name].append(steps / (time.perf_counter() - start))
            rates[f"{name} cpu"].append(cpu / steps * 1e3)
    return rates


def _one_process(rounds: int, steps: int, batch: int) -> dict[str, list[float]]:
    data = _Data()
    devices, weights = ["cpu", "cpu"], [3.0, 1.0]

    def plain() -> Callable[[int], None]:
        sampler = UnevenBatchSampler(data, [batch], rank=0, world_size=1, seed=0)
        return _plain(BalancedDataParallel(_model(), devices, weights=weights), data, sampler)

    # The Trainer's step 0 is not a timed step: its config asks for at least one.
    cfg = _config(batch_size=batch)
    cfg.steps = 1

    def trainer(**kw: Any) -> Callable[[int], None]:
        return _trainer(Trainer(_model(), data, cfg, device_ids=devices, weights=weights, **kw))

    variants = {
        "plain loop": plain(),
        "plain loop again": plain(),
        "Trainer": trainer(),
        "Trainer again": trainer(),
        "Trainer, count_fn": trainer(count_fn=_tokens),
    }
    return _time_rounds(variants, rounds, steps, sync=lambda: None)


def _ddp_worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    data = _Data()
    sizes = [args.batch // 2, args.batch - args.batch // 2]

    def plain() -> Callable[[int], None]:
        sampler = UnevenBatchSampler(data, sizes, rank=rank, world_size=2, seed=0)
        ddp = nn.parallel.DistributedDataParallel(_model())
        return _plain(ddp, data, sampler)

    def trainer(**kw: Any) -> Callable[[int], None]:
        extra = {k: kw.pop(k) for k in ("count_fn", "counts") if k in kw}
        return _trainer(Trainer(_model(), data, _config(batch_sizes=sizes, **kw), **extra))

    variants = {
        "plain DDP loop": plain(),
        "plain DDP loop again": plain(),
        "Trainer (OOM-safe DDP)": trainer(),
        "Trainer (oom_resplit=False)": trainer(oom_resplit=False),
        "Trainer (OOM-safe) again": trainer(),
        "Trainer (OOM-safe), count_fn": trainer(count_fn=_tokens),
        "Trainer (OOM-safe), counts=": trainer(count_fn=_tokens, counts=[1.0] * len(data)),
    }
    rates = _time_rounds(variants, args.rounds, args.steps, sync=dist.barrier)
    if rank == 0:
        torch.save(rates, Path(out) / "ddp.pt")
    dist.destroy_process_group()


def _ddp(args: argparse.Namespace, out: Path) -> dict[str, list[float]]:
    mp.start_processes(
        _ddp_worker, args=(_free_port(), args, str(out)), nprocs=2, start_method="spawn"
    )
    return torch.load(out / "ddp.pt")  # type: ignore[no-any-return]


def _table(title: str, rates: dict[str, list[float]], names: list[str]) -> list[str]:
    """Rows ``names`` against ``names[0]``, with ``names[1]`` its A/A control."""
    plain, again = names[0], names[1]
    base = rates[plain]
    aa = [b / a for a, b in zip(base, rates[again], strict=True)]
    quartiles = statistics.quantiles(aa, n=4) if len(aa) > 1 else [aa[0]] * 3
    noise = max(abs(1 - statistics.median(aa)), (quartiles[2] - quartiles[0]) / 2)
    head = f"{'variant':30} {'steps/s':>8} {'vs plain':>9} {'CPU ms/step':>12} {'CPU ratio':>10}"
    lines = [title, head + "  verdict"]
    cpu0 = statistics.median(rates[f"{plain} cpu"])
    for name in names:
        ratio = statistics.median(
            [b / a for a, b in zip(base, rates[name], strict=True)]
        )  # per-round ratios: both sides of a round saw the same load
        if name == plain:
            verdict = ""
        elif name == again:
            verdict = f"A/A spread +-{noise:.3f}"
        elif ratio >= TARGET:
            verdict = f"meets >= {TARGET}"
        elif abs(1 - ratio) <= noise:
            verdict = "within noise"
        else:
            verdict = f"below {TARGET}"
        cpu = statistics.median(rates[f"{name} cpu"])
        lines.append(
            f"{name:30} {statistics.median(rates[name]):8.1f} {ratio:9.3f} {cpu:12.2f}"
            f" {cpu0 / cpu:10.3f}  {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="evendp Trainer vs a hand-written loop, steps/s")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    p.add_argument("--batch", type=int, default=64, help="global batch per step")
    p.add_argument("--quick", action="store_true", help="few short rounds (< 1 min)")
    p.add_argument("--out", default="/tmp/evendp_trainer_overhead")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 5, 8
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {args.batch}, AdamW"
    header += f", {args.rounds} rounds x {args.steps} steps, medians"
    print(header)
    one = _one_process(args.rounds, args.steps, args.batch)
    title = "one process, device_ids=['cpu', 'cpu'], weights [3, 1]"
    print("\n".join(_table(title, one, ["plain loop", "plain loop again", "Trainer"])))
    print()
    counts = ["Trainer", "Trainer again", "Trainer, count_fn"]
    print("\n".join(_table(f"{title}: token counts vs sample counts", one, counts)))
    print()
    ddp = _ddp(args, out)
    title = "2 ranks, gloo, 1 thread each, sizes [B/2, B/2]"
    names = ["plain DDP loop", "plain DDP loop again"]
    names += ["Trainer (OOM-safe DDP)", "Trainer (oom_resplit=False)"]
    print("\n".join(_table(title, ddp, names)))
    print()
    counts = ["Trainer (OOM-safe DDP)", "Trainer (OOM-safe) again", "Trainer (OOM-safe), count_fn"]
    counts.append("Trainer (OOM-safe), counts=")
    print("\n".join(_table(f"{title}: token counts vs sample counts", ddp, counts)))


if __name__ == "__main__":
    main()

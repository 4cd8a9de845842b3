"""Speed balance inside the real Hugging Face Trainer and the evendp Trainer: ratios, one run.

Two gloo ranks train a tiny GPT-2 (HF ``UnevenTrainer``) and a small MLP (``evendp.Trainer``)
on the same global batch. Each rank's "device" spends a fixed time per sample in its forward
(a sleep inside the model: rank 0 ``--ms`` ms, rank 1 twice that, i.e. rank 1 at half speed),
so the figure does not depend on what else the 2 shared cores run. Rows, each the median of
``--rounds`` rounds (a round runs every configuration once, interleaved):

* A/A control: the even split against a second run of the even split (should read 1.00);
* speed: ``balance="speed"`` against the even split, in samples/s over all steps after the
  first (the convergence steps included), and after it converged: the median step time
  from two steps after the last re-split on, the same steps of both runs (a median, so a
  burst of load from other programs moves it little). The ceiling of
  this setup is 1.5: the even split runs at the slow rank's pace on both, the balanced
  split at ``1 + 1/2`` of it.
* steps to converge: the step of the last re-split (the split stays there after it).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/speed_balance_hf.py`` (about 4
minutes on 2 busy cores; ``--steps 10 --rounds 1`` for a smoke run). Prints a table and,
with ``--json PATH``, writes the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import torch
import torch.nn.functional as F
from _common import SEQ, VOCAB, Tokens, hf_gpt2_run, spawn_two_ranks, start_rank
from torch import nn

import evendp

# --- the slowed "devices" ---------------------------------------------------------------------


def slow_down(module: nn.Module, seconds_per_sample: float) -> None:
    """Spend ``seconds_per_sample`` per row inside ``module``'s forward (a device's pace)."""

    def pace(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rows = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        time.sleep(seconds_per_sample * rows.shape[0])

    module.register_forward_pre_hook(pace, with_kwargs=True)


def pace_of(rank: int, ms: float) -> float:
    return ms / 1000 * (2 if rank == 1 else 1)  # rank 1 at half speed


def converged_at(history: list[tuple[int, list[int]]]) -> int:
    """The step from which the split stays where it ends (0: it never moved)."""
    return history[-1][0] if len(history) > 1 else 0


# --- HF Trainer ---------------------------------------------------------------------------------


def hf_run(rank: int, args: argparse.Namespace, balance: str, tmp: str) -> dict[str, Any]:

    from evendp.integrations.transformers import UnevenTrainer

    half = args.batch // 2
    model, training = hf_gpt2_run(tmp, args.steps, half)
    slow_down(model.transformer, pace_of(rank, args.ms))
    clock = StepClock()
    trainer = UnevenTrainer(
        model, training, train_dataset=Tokens(args.batch * args.steps, SEQ, VOCAB),
        batch_sizes=[half, half], balance=balance, callbacks=[clock.hf_callback()],
    )  # fmt: skip
    trainer.train()
    return clock.result(args.batch, trainer.balancer.history)


# --- evendp Trainer -----------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), y)


def evendp_run(rank: int, args: argparse.Namespace, balance: str) -> dict[str, Any]:
    model = Net()
    slow_down(model.body, pace_of(rank, args.ms))
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    half = args.batch // 2
    cfg = evendp.TrainConfig(
        steps=args.steps, batch_size=args.batch, batch_sizes=[half, half], lr=1e-3,
        progress=False, balance=balance,  # type: ignore[arg-type]
    )  # fmt: skip
    clock = StepClock()
    trainer = evendp.Trainer(model, data, cfg, scheduler=clock)
    trainer.fit()
    return clock.result(args.batch, trainer.balancer.history)


# --- timing -------------------------------------------------------------------------------------


class StepClock(_common.StepClock):
    """The shared clock, and what this benchmark reads of a run."""

    def result(self, batch: int, history: list[tuple[int, list[int]]]) -> dict[str, Any]:
        steps = len(self.times) - 1  # from the end of the first step (startup excluded)
        return {
            "samples_per_s": batch * steps / (self.times[-1] - self.times[0]),
            "times": self.times,
            "converged_at": converged_at(history),
            "final_split": history[-1][1] if history else None,
            "history": history,
        }


# --- driver ---------------------------------------------------------------------------------


RUNS = ("even", "even_again", "speed")


def worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    start_rank(rank, port)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Warm-up, not counted: first calls pay imports, allocations and one-off kernels.
        warm = argparse.Namespace(**{**vars(args), "steps": 5})
        hf_run(rank, warm, "none", tmp)
        evendp_run(rank, warm, "none")
        for _ in range(args.rounds):
            for run in RUNS:
                balance = "speed" if run == "speed" else "none"
                results.setdefault(f"hf/{run}", []).append(hf_run(rank, args, balance, tmp))
                results.setdefault(f"evendp/{run}", []).append(evendp_run(rank, args, balance))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    evendp.finish_distributed()


def _window_time(run: dict[str, Any], start: int) -> float:
    """The median seconds of one step from step ``start`` on (steps counted from 1): the
    typical step, which a burst of load from other programs on the machine moves little."""
    times = run["times"]
    start = min(start, len(times) - 2)
    return statistics.median(b - a for a, b in itertools.pairwise(times[start - 1 :]))


def _rounds(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def table(results: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    lines = [
        "| trainer | row | samples/s | ratio, all steps | per round | ratio, converged "
        "| per round | converged at step |",
        "| --- | --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    figures: dict[str, Any] = {}
    for trainer in ("hf", "evendp"):
        even = results[f"{trainer}/even"]
        # "Converged": from two steps after the last re-split of any round (a loader may run
        # one step ahead) to the end, the same window of steps in every run compared.
        start = 2 + max(r["converged_at"] for r in results[f"{trainer}/speed"])
        for row, name in (("A/A control", "even_again"), ("speed / even", "speed")):
            runs = results[f"{trainer}/{name}"]
            pairs = list(zip(runs, even, strict=True))
            ratios = [r["samples_per_s"] / e["samples_per_s"] for r, e in pairs]
            steady = [_window_time(e, start) / _window_time(r, start) for r, e in pairs]
            rate = statistics.median(r["samples_per_s"] for r in runs)
            steps = statistics.median(r["converged_at"] for r in runs)
            label = "HF UnevenTrainer" if trainer == "hf" else "evendp Trainer"
            conv = f"{steps:g} (split {runs[-1]['final_split']})" if name == "speed" else "-"
            lines.append(
                f"| {label} | {row} | {rate:.0f} | {statistics.median(ratios):.2f} | "
                f"{_rounds(ratios)} | {statistics.median(steady):.2f} | {_rounds(steady)} | "
                f"{conv} |"
            )
            figures[f"{trainer}/{name}"] = {
                "ratio": statistics.median(ratios), "ratios": ratios,
                "ratio_converged": statistics.median(steady), "ratios_converged": steady,
                "steps": steps,
            }  # fmt: skip
    return "\n".join(lines), figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=12, help="global batch (even: half each)")
    parser.add_argument("--ms", type=float, default=40.0, help="rank 0's ms per sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = spawn_two_ranks(worker, args)
    text, figures = table(results)
    print(
        f"2 gloo ranks, global batch {args.batch}, {args.steps} steps, rank 0 {args.ms} ms "
        f"per sample, rank 1 twice that; ceiling 1.5\n{text}"
    )
    for key in ("hf/speed", "evendp/speed"):
        print(f"{key} splits (step, sizes):", results[key][-1]["history"])
    if args.json is not None:
        args.json.write_text(json.dumps({"figures": figures, "runs": results}, indent=2))


if __name__ == "__main__":
    main()

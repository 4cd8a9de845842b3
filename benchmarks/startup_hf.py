"""``UnevenTrainer.train()`` against the plain Hugging Face ``Trainer.train()``: the whole call.

Two gloo ranks train the same tiny GPT-2 on the same data with the same even split; what is
timed is the whole ``train()`` call (wrapping, the loader, every step, the end), from a barrier
before it to its return, on rank 0. Rows, each the median of ``--rounds`` rounds (a round runs
every configuration once, interleaved, after one warm-up of each that is not counted):

* A/A control: the plain ``Trainer`` against a second run of itself (should read +0.00 s);
* ``UnevenTrainer`` against the plain ``Trainer``: the seconds it adds to ``train()``;
* the same two split into the first step (start-up: wrapping, the first batch) and the rest.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/startup_hf.py`` (about a minute
on 2 cores; ``--rounds 1`` for a smoke run). ``--profile PATH`` also writes a cProfile of
rank 0's last ``UnevenTrainer.train()``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _common import SEQ, VOCAB, Tokens, hf_gpt2_run, spawn_two_ranks, start_rank

import evendp

RUNS = ("hf", "hf_again", "uneven")


def one_run(kind: str, args: argparse.Namespace, tmp: str, profile: Path | None) -> list[float]:
    """``[whole train(), first step]`` in seconds for one ``kind`` of Trainer."""
    import transformers

    from evendp.integrations.transformers import UnevenTrainer

    half = args.batch // 2
    model, training = hf_gpt2_run(tmp, args.steps, half)
    first: list[float] = []

    class FirstStep(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            if not first:
                first.append(time.perf_counter())

    data = Tokens(args.batch * args.steps, SEQ, VOCAB)
    common: dict[str, Any] = {"train_dataset": data, "callbacks": [FirstStep()]}
    trainer: Any = (
        UnevenTrainer(model, training, batch_sizes=[half, half], **common)
        if kind == "uneven"
        else transformers.Trainer(model, training, **common)
    )
    dist.barrier()
    start = time.perf_counter()
    profiler = cProfile.Profile() if profile is not None else None
    if profiler is not None:
        profiler.enable()
    trainer.train()
    end = time.perf_counter()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    return [end - start, first[0] - start]


def worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    start_rank(rank, port)
    results: dict[str, list[list[float]]] = {run: [] for run in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("hf", "uneven"):  # warm-up: imports and one-off costs, not counted
            one_run(kind, args, tmp, None)
        for round_ in range(args.rounds):
            for run in RUNS:
                last = round_ == args.rounds - 1 and run == "uneven" and rank == 0
                profile = args.profile if last else None
                kind = "uneven" if run == "uneven" else "hf"
                results[run].append(one_run(kind, args, tmp, profile))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    evendp.finish_distributed()


def table(results: dict[str, list[list[float]]]) -> str:
    lines = [
        "| row | train() s | added s (per round) | first step, added s | the rest, added s |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    control = results["hf"]
    for row, name in (
        ("A/A: Trainer again vs Trainer", "hf_again"),
        ("UnevenTrainer vs Trainer", "uneven"),
    ):
        runs = results[name]
        added = [r[0] - c[0] for r, c in zip(runs, control, strict=True)]
        first = [r[1] - c[1] for r, c in zip(runs, control, strict=True)]
        rest = [(r[0] - r[1]) - (c[0] - c[1]) for r, c in zip(runs, control, strict=True)]
        per_round = " ".join(f"{a:+.2f}" for a in added)
        lines.append(
            f"| {row} | {statistics.median(r[0] for r in runs):.2f} | "
            f"{statistics.median(added):+.2f} ({per_round}) | {statistics.median(first):+.2f} | "
            f"{statistics.median(rest):+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (half a rank)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = spawn_two_ranks(worker, args)
    print(
        f"2 gloo ranks, tiny GPT-2, global batch {args.batch} split [{args.batch // 2}, "
        f"{args.batch // 2}], {args.steps} steps, {args.rounds} rounds (medians)\n" + table(results)
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""A mixed box in miniature: two ranks on one GPU (gloo), each process's allocator capped at a
different size, planned by evendp and trained, against the even split and the best split found
by trial.

Rank r's caching allocator is capped at ``--memory``'s r-th entry (default 8 GiB and 4 GiB)
minus a process's CUDA context, measured on rank 0 alone
(``torch.cuda.set_per_process_memory_fraction``), so the two processes are a large and a
small device. GPT-2 124M from ``transformers`` (sequence 512, bf16 autocast, AdamW) trains
with ``evendp.Trainer`` (the default OOM-safe DDP):

* planned: each rank plans its own memory (the public ``evendp.plan``, ``mode="ddp"``: the
  most samples it holds, as ``batch_sizes="auto"`` does) and the Trainer trains those shares
  for 3 steps; they ran if no rank hit an OOM (no re-split);
* best by trial: each rank's largest share that trains (grow, then bisect to 2%, both ranks
  in lockstep, 2 steps a trial), their sum the best global batch;
* even: every rank the same share, so the small rank's largest, twice.

Target: the planned split trains, at a global batch of at least 0.9 of the best by trial.

    python benchmarks/mixed_box.py [--memory 8GiB,4GiB] [--json F]
    python benchmarks/mixed_box.py --smoke   # CPU: tiny GPT-2, no cap, --memory 24MiB,12MiB
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import Tokens, save_figures, spawn_two_ranks, start_rank
from capped_batch import context_bytes

import evendp
from evendp._core._units import parse_bytes

SEQ = 512
#: --memory's default: the GPU's, and --smoke's on the CPU (at 8 GiB the tiny GPT-2 plans
#: 61933 rows, more than the 4096 of its data: the Trainer refuses them).
MEMORY, SMOKE_MEMORY = "8GiB,4GiB", "24MiB,12MiB"


def _config(smoke: bool) -> Any:
    from transformers import GPT2Config

    if smoke:
        return GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    return GPT2Config()  # 124M


def _gather(value: int) -> list[int]:
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([value]))
    return [int(p) for p in parts]


class Box:
    """One rank of the box: its device, its model's config and data."""

    def __init__(self, rank: int, smoke: bool) -> None:
        self.rank, self.smoke = rank, smoke
        self.device = torch.device("cpu") if smoke else torch.device("cuda", 0)
        self.config = _config(smoke)
        self.seq = 32 if smoke else SEQ
        self.data = Tokens(4096, self.seq, self.config.vocab_size)

    def make(self) -> torch.nn.Module:
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(self.config)

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.config.vocab_size, (n, self.seq))
        return {"input_ids": ids, "labels": ids}

    def trains(self, sizes: list[int], steps: int, global_batch: int) -> bool:
        """Whether this rank's share trained ``steps`` steps with no OOM (no re-split)."""
        from evendp import TrainConfig, Trainer

        torch.manual_seed(0)
        with torch.device(self.device):
            model = self.make()
        cfg = TrainConfig(
            steps=steps, batch_size=global_batch, batch_sizes=sizes, lr=1e-4, progress=False,
            amp="none" if self.smoke else "bf16", log_every=10**6,
        )  # fmt: skip
        trainer = Trainer(model, self.data, cfg)
        trainer.fit()
        ok = trainer.guard.resplits == 0
        del trainer, model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return ok


def _best_by_trial(box: Box, start: int, rounds: int) -> tuple[int, int]:
    """This rank's largest share that trains (to 2%), searched in lockstep with the other
    rank (every round both train once together); and the rounds run."""
    lo, hi, n = 0, None, max(1, start)
    for done_rounds in range(rounds):
        done = hi is not None and hi - lo <= max(1, lo // 50)
        if sum(_gather(int(done))) == dist.get_world_size():
            return lo, done_rounds
        mine = lo if done else (n if hi is None else (lo + hi) // 2)
        sizes = _gather(mine)
        ok = box.trains(sizes, 2, sum(sizes))
        if done:
            continue
        if ok:
            lo = mine
            n = max(mine + 1, int(mine * 1.25))
        else:
            hi = mine
    return lo, rounds


def worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    start_rank(rank, port)
    box = Box(rank, args.smoke)
    memories = [parse_bytes(m) for m in args.memory.split(",")]
    context = 0
    if not args.smoke:
        # Measured on rank 0 while rank 1 has not touched CUDA (free memory is the GPU's, both
        # processes' together); the two processes load the same libraries.
        if rank == 0:
            context = context_bytes()
        context = _gather(context)[0]
        torch.cuda.set_device(0)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((memories[rank] - context) / total, 0)
    began = time.perf_counter()
    mine = evendp.plan(
        box.make, box.batch, [memories[rank]], mode="ddp",
        amp=None if args.smoke else "bf16", **({"cuda_context": 0} if args.smoke else {}),
    ).devices[0].max_batch_alone  # fmt: skip
    planned = _gather(int(mine))
    planned_ran = box.trains(planned, 3, sum(planned))
    ran_everywhere = sum(_gather(int(planned_ran))) == dist.get_world_size()
    largest, rounds = _best_by_trial(box, int(mine), 2 if args.smoke else args.rounds)
    best = _gather(largest)
    if rank == 0:
        even = 2 * min(best)
        figures = {
            "memory": args.memory, "context_bytes": context, "planned": planned,
            "planned_global": sum(planned), "planned_ran": ran_everywhere, "best": best,
            "best_global": sum(best), "ratio": sum(planned) / sum(best) if sum(best) else None,
            "even_best_global": even, "even_ratio": even / sum(best) if sum(best) else None,
            "even_split_of_planned_fits": all(sum(planned) / 2 <= b for b in best),
            "rounds": rounds, "seconds": round(time.perf_counter() - began, 1),
        }  # fmt: skip
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.barrier()
    evendp.finish_distributed()


def main(argv: list[str] | None = None) -> Any:
    """Run the box as the command line ``argv`` asks; rank 0's figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--memory", help=f"rank 0's and rank 1's device ({MEMORY}; --smoke: {SMOKE_MEMORY})"
    )
    parser.add_argument("--rounds", type=int, default=12, help="at most this many trials")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny GPT-2, no cap")
    args = parser.parse_args(argv)
    args.memory = args.memory or (SMOKE_MEMORY if args.smoke else MEMORY)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("mixed_box.py needs a CUDA device (or --smoke)")
    figures = spawn_two_ranks(worker, args)
    print(json.dumps(figures))
    save_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()

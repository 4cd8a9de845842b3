"""A planned batch under a real memory cap: does the batch ``evendp.plan`` chooses for a device
of M bytes train on a GPU whose caching allocator may use what such a device leaves it, and
how close is it to the largest batch that really trains there?

A device of M: the allocator is capped (``torch.cuda.set_per_process_memory_fraction``) at M
minus this process's CUDA context, measured (device memory in use that the allocator does not
hold, after cuBLAS and cuDNN have started). Per model and M: the plan's batch (the public
``evendp.plan``, whatever it models; ``gradient_as_bucket_view=True``, since the run is a
plain loop with no DDP buckets), whether two full training steps (forward, backward, AdamW;
the second holds the optimizer state) run at it, the largest batch that runs them found by
trial (grow, then bisect to 0.5%), and their ratio. Target: the planned batch runs, ratio at
least 0.9. Models: GPT-2 124M from ``transformers`` (sequence 512, bf16 autocast) and the
conv net of ``planner_gpu.py`` (32x32 images, fp32).

    python benchmarks/capped_batch.py [--models gpt2,conv] [--memory 8GiB,20GiB] [--json F]
    python benchmarks/capped_batch.py --smoke   # CPU: tiny models, plan and one run, no cap
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import save_figures
from planner_gpu import ConvNet
from torch import nn

import evendp
from evendp._core._units import parse_bytes


@dataclass(frozen=True)
class Workload:
    make: Callable[[], nn.Module]
    batch: Callable[[int], Any]  # n samples: (inputs, targets), or a dict with labels
    criterion: Callable[..., torch.Tensor] | None
    amp: str | None


def _gpt2(smoke: bool) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    if smoke:
        config, seq = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2), 32
    else:
        config, seq = GPT2Config(), 512  # 124M: 12 x 768, vocabulary 50257

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return Workload(lambda: GPT2LMHeadModel(config), batch, None, "bf16")


def _conv(smoke: bool) -> Workload:
    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    return Workload(ConvNet, batch, F.cross_entropy, None)


WORKLOADS: dict[str, Callable[[bool], Workload]] = {"gpt2": _gpt2, "conv": _conv}


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def _loss(work: Workload, model: nn.Module, batch: Any) -> torch.Tensor:
    if work.criterion is None:
        return model(**batch).loss  # type: ignore[no-any-return]
    x, y = batch
    return work.criterion(model(x), y)


def train_two_steps(work: Workload, n: int, device: torch.device) -> None:
    """Build the model on ``device`` and run two full steps at batch ``n``."""
    with torch.device(device):
        model = work.make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _to(work.batch(n), device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(work.amp or "")
    for _ in range(2):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = _loss(work, model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def capped(cap: int) -> Iterator[None]:
    """The caching allocator limited to ``cap`` bytes, from empty, for the block."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def runs(work: Workload, n: int, cap: int) -> bool:
    """Whether two steps at batch ``n`` train with the allocator capped at ``cap``."""
    try:
        with capped(cap):
            train_two_steps(work, n, torch.device("cuda", 0))
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as exc:  # a library's own allocation (cuBLAS, cuDNN) that failed
        if "ALLOC_FAILED" in str(exc) or "out of memory" in str(exc):
            return False
        raise


def largest_that_runs(work: Workload, start: int, cap: int) -> tuple[int, int]:
    """The largest batch that runs under ``cap`` (to 0.5%), searched from ``start``; and how
    many trials it took."""
    trials = 0
    lo, hi = 0, None  # lo runs; hi does not
    n = max(1, start)
    while hi is None:  # grow until a batch fails
        trials += 1
        if runs(work, n, cap):
            lo, n = n, max(n + 1, int(n * 1.25))
        else:
            hi = n
    while hi - lo > max(1, lo // 200):
        mid = (lo + hi) // 2
        trials += 1
        if runs(work, mid, cap):
            lo = mid
        else:
            hi = mid
    return lo, trials


def context_bytes() -> int:
    """This process's device memory outside the caching allocator, once cuBLAS and cuDNN have
    started (their handles): what a device of M leaves short of M for the allocator."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    F.conv2d(torch.randn(1, 3, 8, 8, device="cuda"), torch.randn(4, 3, 3, 3, device="cuda"))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    return int(total - free - torch.cuda.memory_reserved(0))


def plan_batch(work: Workload, memory: int) -> tuple[int, str | None]:
    """The plan's batch for a device of ``memory``, and the allocator setting it modelled
    (read from ``PYTORCH_CUDA_ALLOC_CONF``, the one the capped run's allocator reads too)."""
    planned = evendp.plan(
        work.make, work.batch, [memory], mode="ddp", criterion=work.criterion, amp=work.amp,
        gradient_as_bucket_view=True,
    )  # fmt: skip
    return int(planned.devices[0].max_batch_alone), planned.options.get("allocator")


def measure(name: str, memory: int, context: int) -> dict[str, Any]:
    work = WORKLOADS[name](False)
    start = time.perf_counter()
    planned, allocator = plan_batch(work, memory)
    cap = memory - context
    planned_ran = runs(work, planned, cap)
    largest, trials = largest_that_runs(work, planned, cap)
    return {
        "model": name, "memory_gib": memory / 2**30, "cap_bytes": cap, "planned": planned,
        "allocator": allocator,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "planned_ran": planned_ran, "largest": largest,
        "ratio": planned / largest if largest else None, "trials": trials,
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip


def smoke() -> list[dict[str, Any]]:
    """CPU: each model's plan for 1 GiB and two steps at (at most 8 of) the planned batch."""
    rows = []
    for name, build in WORKLOADS.items():
        work = build(True)
        planned, _ = plan_batch(work, 1 << 30)
        train_two_steps(work, min(planned, 8), torch.device("cpu"))
        rows.append({"model": name, "memory_gib": 1.0, "planned": planned, "smoke": True})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,conv")
    parser.add_argument("--memory", default="8GiB,20GiB")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny models, no cap")
    args = parser.parse_args()
    if args.smoke:
        rows = smoke()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("capped_batch.py needs a CUDA device (or --smoke)")
        context = context_bytes()
        print(f"CUDA context outside the allocator: {context / 2**20:.0f} MiB")
        rows = [
            {**measure(name, parse_bytes(m), context), "context_bytes": context}
            for name in args.models.split(",")
            for m in args.memory.split(",")
        ]
    for row in rows:
        print(json.dumps(row))
    save_figures(rows, args.json)


if __name__ == "__main__":
    main()

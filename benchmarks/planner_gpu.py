"""Planner accuracy: predicted memory against measured, per model.

CPU part (always): activation bytes per sample and the forward+backward peak predicted on
fake tensors, against ``MemTracker`` on real tensors; and the forward-only peak under
``torch.no_grad`` (``plan(..., no_grad=True)``) against a real ``no_grad`` forward.
GPU part (when CUDA is present): plan one device at a fixed batch, run real training steps
at that batch, and compare the predicted tensor peak (the plan's peak minus its CUDA context
allowance) with what the planner models:
``torch.cuda.max_memory_allocated`` over the steady state (one warm-up step first, so optimizer
state and library workspaces exist; the bytes held before the model was built subtracted).
``max_memory_reserved`` (the same baseline subtracted) is shown beside it: it adds allocator
rounding, cached free blocks and fragmentation, which the planner's safety margin covers.
Target: allocated within 5%, never more than 2% under the prediction.

    python benchmarks/planner_gpu.py [--models mlp,gpt] [--skip-cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from evendp import plan
from evendp._planning._measure import profile_step
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.lm_head import LMHead, lm_loss


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _gpt_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 96, (n, 64)), torch.randint(0, 96, (n, 64))


# name: (factory, batch(n), criterion, GPU batch)
MODELS = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 10)),
        lambda n: (torch.randn(n, 512), torch.randint(0, 10, (n,))),
        nn.functional.cross_entropy,
        4096,
    ),
    "conv": (
        ConvNet,
        lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        nn.functional.cross_entropy,
        512,
    ),
    "gpt": (lambda: GPT(GPTConfig()), _gpt_batch, None, 256),
    "lm-head": (
        lambda: LMHead(40_000, 250),
        lambda n: (torch.randint(0, 40_000, (n, 250)),) * 2,
        lm_loss,
        8,
    ),
}


def _step(model: nn.Module, batch: object, criterion: object, opt: torch.optim.Optimizer) -> None:
    if criterion is None:
        out = model(*batch)  # type: ignore[misc]
        loss = out[1]
    else:
        x, y = batch  # type: ignore[misc]
        out = model(x)
        loss = criterion(out, y)  # type: ignore[operator]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _real_cpu(name: str, sizes: tuple[int, int]) -> tuple[float, list[int]]:
    make, batch, criterion, _ = MODELS[name]
    held, peaks = [], []
    for n in sizes:
        model = make()
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            b = batch(n)
            inputs = b if criterion is None else b[0]
            out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            snap = tracker.get_tracker_snapshot()
            total = sum(v["Total"] for v in snap.values())
            par = sum(
                v.get(k, 0)
                for v in snap.values()
                for k in v
                if getattr(k, "name", "") in ("PARAM", "BUFFER")
            )
            held.append(total - par)
            loss = out[1] if criterion is None else criterion(out, b[1])
            loss.backward()
            peaks.append(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
    return (held[1] - held[0]) / (sizes[1] - sizes[0]), peaks


def cpu_table() -> None:
    sizes = (8, 16)
    print(f"CPU: fake-tensor prediction vs MemTracker on real tensors (batch sizes {sizes})")
    print(
        f"{'model':8} {'act B/sample pred':>18} {'real':>12} {'ratio':>7} "
        f"{'peak@16 pred':>13} {'real':>12} {'ratio':>7}"
    )
    for name, (make, batch, criterion, _) in MODELS.items():
        if name == "lm-head":
            continue  # 40k x 250 logits are too big for a quick real CPU run
        prof = profile_step(make, batch, sizes, criterion=criterion, optimizer=None)
        pred = (prof["forward_bytes"][1] - prof["forward_bytes"][0]) / (sizes[1] - sizes[0])
        real, peaks = _real_cpu(name, sizes)
        pp = prof["peak_bytes"][1]
        print(
            f"{name:8} {pred:18.0f} {real:12.0f} {pred / real:7.3f} "
            f"{pp:13.0f} {peaks[1]:12.0f} {pp / peaks[1]:7.3f}"
        )


def _real_no_grad_peak(name: str, n: int) -> int:
    make, batch, criterion, _ = MODELS[name]
    model = make().eval()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        b = batch(n)
        inputs = b if criterion is None else b[0]
        with torch.no_grad():
            out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        del out
        return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def cpu_no_grad_table() -> None:
    n = 16
    print(f"CPU, forward only: fake-tensor no_grad peak vs MemTracker on real tensors (batch {n})")
    print(f"{'model':8} {'peak pred':>12} {'real':>12} {'ratio':>7}")
    for name, (make, batch, criterion, _) in MODELS.items():
        if name == "lm-head":
            continue

        def inputs(k: int, b: Any = batch, c: Any = criterion) -> Any:
            return b(k) if c is None else b(k)[0]  # the model's inputs only

        prof = profile_step(make, inputs, (n,), optimizer=None, no_grad=True)
        real = _real_no_grad_peak(name, n)
        pp = prof["peak_bytes"][0]
        print(f"{name:8} {pp:12.0f} {real:12.0f} {pp / real:7.3f}")


def gpu_table(names: list[str]) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device)")
        return []
    # --- GPU-only part below. ---
    context = 512 << 20
    print(
        "GPU: predicted tensor peak vs torch.cuda.max_memory_allocated (what the planner "
        "models) and max_memory_reserved, steady state after one warm-up step, one device"
    )
    print(
        f"{'model':8} {'batch':>6} {'predicted GiB':>14} {'allocated GiB':>14} {'ratio':>7} "
        f"{'reserved GiB':>13} {'ratio':>7}"
    )
    rows = []
    for name in names:
        make, batch, criterion, n = MODELS[name]
        torch.cuda.empty_cache()  # return the last model's cached blocks before reading free
        free, _ = torch.cuda.mem_get_info()
        # The real run below is one plain process (no DDP wrapper, so no gradient buckets):
        # plan DDP's per-rank layout with bucket views on, which plans zero bucket bytes.
        p = plan(
            make,
            batch,
            [free],
            mode="ddp",
            criterion=criterion,
            batch_size=n,
            cuda_context=context,
            safety_margin=0.0,
            gradient_as_bucket_view=True,
        )
        predicted = p.devices[0].peak - context
        base_allocated = torch.cuda.memory_allocated()
        base_reserved = torch.cuda.memory_reserved()
        model = make().cuda()
        opt = torch.optim.AdamW(model.parameters())
        b = tuple(t.cuda() for t in batch(n))
        _step(model, b, criterion, opt)  # warm-up: optimizer state, cuBLAS/cuDNN workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            b = tuple(t.cuda() for t in batch(n))
            _step(model, b, criterion, opt)
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated() - base_allocated
        reserved = torch.cuda.max_memory_reserved() - base_reserved
        print(
            f"{name:8} {n:6d} {predicted / 2**30:14.3f} {allocated / 2**30:14.3f} "
            f"{predicted / allocated:7.3f} {reserved / 2**30:13.3f} {predicted / reserved:7.3f}"
        )
        rows.append(
            {
                "model": name,
                "batch": n,
                "predicted_bytes": int(predicted),
                "allocated_bytes": int(allocated),
                "reserved_bytes": int(reserved),
                "ratio_allocated": predicted / allocated,
                "ratio_reserved": predicted / reserved,
            }
        )
        del model, opt, b
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--skip-cpu", action="store_true", help="only the GPU table")
    parser.add_argument("--json", default=None, help="write the GPU rows to this file")
    args = parser.parse_args()
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if not args.skip_cpu:
        cpu_table()
        cpu_no_grad_table()
    rows = gpu_table(names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

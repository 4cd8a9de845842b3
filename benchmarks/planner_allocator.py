"""The CUDA allocator model (evendp._planning._allocator) against measured reserved memory.

CPU part (always): the four rows of ``benchmarks/planner_gpu.py`` replayed through the
allocator model for an H200 (compute capability 9.0, the allocator's default setting), beside
``torch.cuda.max_memory_reserved`` as the H200 measured it (../shared/gpu-h200-2026-12-04/
README.md); then GPT-2 124M (sequence 512, bf16 autocast, AdamW, DDP) planned at 8 GiB and
20 GiB with and without the allocator model (the H200's largest batches that ran under a cap
of M - 512 MiB: 7 and 25).

GPU part (when CUDA is present; what ``benchmarks/gpu_session.sh`` should run, once as is and
once with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): the same four rows run for
real, ``max_memory_reserved`` against the model's figure for this GPU and the allocator
setting in force (:func:`gpu_rows`), and the calibration line of each (:func:`gpu_calibration`).

    python benchmarks/planner_allocator.py [--skip-gpt2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_gpu import MODELS, _step

import evendp
from evendp._planning._allocator import (
    AllocatorConfig,
    CudaAllocatorModel,
    reserved_peak,
)
from evendp._planning._measure import make_setup, measure_replica
from evendp._planning._on_device import CudaMeasurer, calibrate, calibration_sizes

#: ``max_memory_reserved`` on one H200, torch 2.11.0+cu130 (the shared README's table).
H200_RESERVED = {"mlp": 260_046_848, "conv": 520_093_696, "gpt": 809_500_672,
                 "lm-head": 2_113_929_216}  # fmt: skip
H200_LARGEST_RUN = {8: 7, 20: 25}  # GiB -> the largest GPT-2 124M batch that ran (README)


def _trace(name: str) -> Any:
    make, batch, criterion, n = MODELS[name]
    setup = make_setup(make, batch, criterion, torch.optim.AdamW, None, False)
    return measure_replica(setup, n, "keep").trace


def h200_table() -> list[dict[str, Any]]:
    print("H200 rows: the allocator model (sm90, default setting) vs max_memory_reserved")
    print(f"{'model':8} {'replayed MiB':>13} {'planned MiB':>12} {'H200 MiB':>9} {'ratio':>6}")
    rows = []
    for i, name in enumerate(MODELS):
        # As the benchmark measured them: the first row's cuBLAS workspaces stay allocated
        # and sit in the later rows' subtracted baseline.
        r = reserved_peak(_trace(name), major=9, config=AllocatorConfig(), workspaces_held=i > 0)
        real = H200_RESERVED[name]
        print(
            f"{name:8} {r.reserved / 2**20:13.1f} {r.planned / 2**20:12.1f} "
            f"{real / 2**20:9.1f} {r.planned / real:6.3f}"
        )
        rows.append({"model": name, "replayed": r.reserved, "planned": r.planned, "h200": real})
    return rows


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_positions=1024, n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    return GPT2LMHeadModel(config)


def _gpt2_batch(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50257, (n, 512))
    return {"input_ids": ids, "labels": ids}


def gpt2_table() -> list[dict[str, Any]]:
    print("GPT-2 124M, sequence 512, bf16, AdamW, DDP: planned batch at M (H200: largest run)")
    rows = []
    for gib, runs in H200_LARGEST_RUN.items():
        for label, allocator in (
            ("tensors only", None),
            ("allocator model", CudaAllocatorModel(9, AllocatorConfig())),
        ):
            start = time.perf_counter()
            # The H200's runs were one plain process (no DDP wrapper, so no gradient
            # buckets): plan DDP's per-rank layout with bucket views, which plans no buckets.
            p = evendp.plan(_gpt2, _gpt2_batch, [f"{gib}GiB"], mode="ddp", amp="bf16",
                            allocator=allocator, gradient_as_bucket_view=True)  # fmt: skip
            n = p.split[0]
            print(
                f"  {gib:2d} GiB {label:16} planned {n:3d}, H200 ran {runs:3d} "
                f"(ratio {n / runs:.2f}; {time.perf_counter() - start:.0f} s)"
            )
            rows.append({"gib": gib, "model": label, "planned": n, "h200_largest": runs})
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """Each row run for real on cuda:0: ``max_memory_reserved`` over two steps after a
    warm-up against the model's figure for this GPU and the allocator setting in force, and
    ``max_memory_allocated`` beside the tensors' prediction."""
    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device)")
        return []
    # --- GPU-only part below. ---
    model = CudaAllocatorModel.live(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, model {model}")
    rows = []
    for i, name in enumerate(MODELS):
        make, batch, criterion, n = MODELS[name]
        torch.cuda.empty_cache()  # the last row's cached blocks go back first
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved()  # the first row's cuBLAS workspaces stay in it
        base_allocated = torch.cuda.memory_allocated()
        net = make().cuda()
        opt = torch.optim.AdamW(net.parameters())
        for _ in range(3):
            _step(net, tuple(t.cuda() for t in batch(n)), criterion, opt)
        torch.cuda.synchronize()
        real = torch.cuda.max_memory_reserved() - base
        allocated = torch.cuda.max_memory_allocated() - base_allocated
        r = reserved_peak(_trace(name), major=model.major, config=model.config,
                          workspaces_held=i > 0)  # fmt: skip
        print(f"{name:8} planned {r.planned / 2**20:8.1f} MiB  reserved {real / 2**20:8.1f} MiB"
              f"  ratio {r.planned / real:.3f}")  # fmt: skip
        # The tensors' prediction against what the tensors allocated (kernels' scratch and
        # workspaces beyond it: the H200 measured 0.65 to 0.998), beside the reserved claim.
        rows.append({"model": name, "planned": r.planned, "reserved": real,
                     "tensors": r.tensors, "allocated": allocated})  # fmt: skip
        del net, opt
    return rows


def gpu_calibration() -> list[dict[str, Any]]:
    """Each row's calibration line on cuda:0 (two small sizes) against the model's figure
    at the row's batch."""
    if not torch.cuda.is_available():
        return []
    # --- GPU-only part below. ---
    rows = []
    for name in MODELS:
        make, batch, criterion, n = MODELS[name]
        net = make().cuda()
        opt = torch.optim.AdamW(net.parameters())

        def step(
            k: int, net: Any = net, opt: Any = opt, b: Any = batch, c: Any = criterion
        ) -> None:
            _step(net, tuple(t.cuda() for t in b(k)), c, opt)

        c = calibrate(CudaMeasurer(0, step), calibration_sizes(n))
        print(f"{name:8} line {c.line.fixed / 2**20:.1f} MiB + {c.line.per_sample / 2**20:.3f} "
              f"MiB/sample -> {c.line.at(n) / 2**20:.1f} MiB at {n}; context "
              f"{c.context / 2**20:.0f} MiB")  # fmt: skip
        rows.append({"model": name, "fixed": c.line.fixed, "per_sample": c.line.per_sample,
                     "context": c.context})  # fmt: skip
        del net, opt
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-gpt2", action="store_true", help="not the GPT-2 124M plans")
    parser.add_argument("--json", default=None, help="write every row to this file")
    args = parser.parse_args()
    out: dict[str, Any] = {"h200": h200_table()}
    if not args.skip_gpt2:
        out["gpt2"] = gpt2_table()
    out["gpu"] = gpu_rows()
    out["calibration"] = gpu_calibration()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

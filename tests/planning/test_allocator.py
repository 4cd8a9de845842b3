"""The CUDA caching allocator model against the only real-GPU figures there are, and its rules.

The reference figures are measured data: ``torch.cuda.max_memory_reserved`` on one NVIDIA
H200 (torch 2.11.0+cu130), ``benchmarks/planner_gpu.py`` run by ``benchmarks/gpu_session.sh``
at main 15dd415: ../shared/gpu-h200-2026-12-04/README.md, "The planner against the real
allocator" (and its summary.json, step "planner", ``reserved_bytes``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import evendp
from evendp._planning import _allocator as A
from evendp._planning._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocator,
    CudaAllocatorModel,
    reserved_peak,
)
from evendp._planning._measure import make_setup, measure_replica
from evendp.examples.lm_head import LMHead, lm_loss


def _benchmark_models() -> dict[str, Any]:
    """``benchmarks/planner_gpu.py``'s MODELS, the very ones the H200 ran (loaded from the
    file: the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_gpu.py"
    spec = importlib.util.spec_from_file_location("planner_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.MODELS)


MiB = 1 << 20
MODELS = _benchmark_models()
# Per model, in MODELS' order: the H200's max_memory_reserved in bytes (summary.json) and its
# README figure in MB.
H200_RESERVED = {
    "mlp": (260_046_848, 260.0),
    "conv": (520_093_696, 520.1),
    "gpt": (809_500_672, 809.5),
    "lm-head": (2_113_929_216, 2113.9),
}


@pytest.mark.parametrize("name", list(H200_RESERVED))
def test_the_reserved_plan_covers_the_h200_within_10_percent(name: str) -> None:
    make, batch, criterion, n = MODELS[name]
    reserved, mb = H200_RESERVED[name]
    assert round(reserved / 1e6, 1) == mb  # the two records of the run agree
    setup = make_setup(make, batch, criterion, torch.optim.AdamW, None, False)
    trace = measure_replica(setup, n, "keep").trace
    assert trace is not None
    # The benchmark measured each model after the one before in the same process: the first
    # model's cuBLAS workspaces stayed allocated, inside the later rows' subtracted baseline.
    held = list(MODELS).index(name) > 0
    r = reserved_peak(trace, major=9, config=AllocatorConfig(), workspaces_held=held)
    assert reserved <= r.planned <= 1.10 * reserved, (name, r, reserved)


def test_allocator_rounds_and_packs_small_requests_in_2_mib_segments() -> None:
    a = CachingAllocator(AllocatorConfig())
    blocks = [a.malloc(1000) for _ in range(4096)]  # 4096 x 1024 B = 4 MiB: two segments
    assert a.allocated == 4096 * 1024 and a.reserved == 2 * A.SMALL_BUFFER
    for b in blocks:
        a.free(b)
    assert a.allocated == 0 and a.reserved == 2 * A.SMALL_BUFFER  # cached, not returned
    a.malloc(1000)
    assert a.reserved == 2 * A.SMALL_BUFFER  # reused


def test_a_large_free_block_is_split_and_merged_back() -> None:
    a = CachingAllocator(AllocatorConfig())
    big = a.malloc(64 * MiB)
    a.free(big)
    x, y = a.malloc(30 * MiB), a.malloc(30 * MiB)  # both carved from the cached 64 MiB
    assert a.reserved == 64 * MiB
    a.free(x)
    a.free(y)
    a.malloc(64 * MiB)  # merged back whole: still one segment
    assert a.reserved == 64 * MiB and a.peak_reserved == 64 * MiB


def test_a_growing_request_costs_a_new_segment_that_expandable_segments_avoid() -> None:
    def pattern(config: AllocatorConfig) -> int:
        a = CachingAllocator(config)
        a.free(a.malloc(64 * MiB))  # a layer's activations, then a larger layer's
        a.malloc(80 * MiB)
        return a.peak_reserved

    # Fixed segments: the cached 64 MiB cannot grow, so 64 + 80 MiB. Expandable: the one
    # segment maps 20 MiB pages and grows in place, so 80 MiB in all.
    assert pattern(AllocatorConfig()) == 144 * MiB
    assert pattern(AllocatorConfig(expandable_segments=True)) == 80 * MiB


def test_a_cap_returns_cached_segments_before_it_runs_out() -> None:
    a = CachingAllocator(AllocatorConfig(), cap=100 * MiB)
    a.free(a.malloc(60 * MiB))  # cached: 60 MiB reserved, none used
    a.malloc(80 * MiB)  # 60 + 80 > 100: the cached segment goes back first
    assert a.reserved == 80 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(30 * MiB)


def test_workspace_sizes_follow_the_architecture_and_the_environment() -> None:
    assert A.blas_workspace_bytes(9, {}) == 32 * MiB  # Hopper
    assert A.blas_workspace_bytes(10, {}) == 32 * MiB  # Blackwell
    assert A.blas_workspace_bytes(8, {}) == 4096 * 1024 * 2 + 16 * 1024 * 8  # Ampere
    assert A.blas_workspace_bytes(9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 16 * 1024 * 8
    unified_off = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert A.blas_workspace_bytes(9, unified_off) == 32 * MiB + 4 * MiB  # cuBLASLt's own


def test_a_training_step_holds_one_workspace_per_thread() -> None:
    # Forward on the caller's thread, backward on autograd's: two cuBLAS handles.
    setup = make_setup(
        lambda: nn.Linear(64, 64), lambda n: torch.randn(n, 64), None, None, None, False
    )
    trace = measure_replica(setup, 4, "keep").trace
    assert trace is not None
    with_ws = reserved_peak(trace, major=9, config=AllocatorConfig())
    without = reserved_peak(trace, major=9, config=AllocatorConfig(), workspaces_held=True)
    assert with_ws.reserved - without.reserved == 2 * 32 * MiB


def test_cuda_plans_count_the_allocator_and_cpu_plans_do_not() -> None:
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(1, 64)
    model = CudaAllocatorModel(9, AllocatorConfig())
    gpu = evendp.plan(net, x, "2GiB", mode="ddp", batch_size=64, allocator=model)
    cpu = evendp.plan(net, x, "2GiB", mode="ddp", batch_size=64, cuda_context=0)
    assert gpu.devices[0].breakdown["allocator"] >= 2 * 32 * MiB  # the two workspaces
    assert "allocator" not in cpu.devices[0].breakdown
    assert gpu.options["allocator"] == "cuda sm9x, segments" and cpu.options["allocator"] is None
    with pytest.raises(evendp.InputError, match="allocator must be 'auto', None or"):
        evendp.plan(net, x, "2GiB", allocator="cudnn")  # type: ignore[arg-type]


def test_the_planned_batch_replays_under_its_cap() -> None:
    # The plan's batch, replayed under a cap of its budget less its context, never runs
    # out (as set_per_process_memory_fraction would cap a real allocator).
    net = LMHead(2_000, 32, n_embd=64)
    model = CudaAllocatorModel(9, AllocatorConfig())
    p = evendp.plan(net, net.example_batch(2), "1GiB", mode="ddp", criterion=lm_loss,
                    allocator=model, cuda_context="128MiB")  # fmt: skip
    n = p.split[0]
    setup = make_setup(net, net.example_batch(2), lm_loss, torch.optim.AdamW, None, False)
    trace = measure_replica(setup, n, "keep").trace
    assert trace is not None
    budget = p.devices[0].budget - (128 * MiB)
    reserved_peak(trace, major=9, config=AllocatorConfig(), cap=budget)  # no out of memory
    assert p.devices[0].peak <= p.devices[0].budget


def test_evendp_chooses_expandable_segments_only_when_the_user_did_not() -> None:
    env: dict[str, str] = {}
    assert A.alloc_conf_default(env) == "expandable_segments:True"
    assert AllocatorConfig.parse(env["PYTORCH_CUDA_ALLOC_CONF"]).expandable_segments
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert A.alloc_conf_default(mine) is None and mine["PYTORCH_CUDA_ALLOC_CONF"].endswith("False")


def test_a_forward_only_plan_counts_the_allocator_too() -> None:
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model = CudaAllocatorModel(9, AllocatorConfig())
    p = evendp.plan(net, torch.randn(1, 64), "2GiB", mode="ddp", no_grad=True, allocator=model)
    # One workspace (the forward's thread) and the small pool's segments, at least.
    assert p.devices[0].breakdown["allocator"] >= 32 * MiB
    assert p.safety_margin == 0.0

"""The GPU-only claims, one step at a time, for ``benchmarks/gpu_session.sh``.

Each step checks one claim on ``cuda:0`` and returns figures; with ``--dry-run`` the steps
that can run on the CPU do so on ``cpu`` (what CI runs), the others report "skip". A step
writes ``<out>/steps/<name>.json``: ``{"status": "pass"|"fail"|"skip", "figures", "note"}``.

    python benchmarks/gpu_checks.py run STEP --out DIR [--dry-run]
    python benchmarks/gpu_checks.py summarize --out DIR [--dry-run]   # -> DIR/summary.json
    python benchmarks/gpu_checks.py list
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this working tree's evendp, and tests._helpers
TOL = 1e-5


class Skip(Exception):
    """A step that cannot run here (no GPU in a dry run, a missing package)."""


class Failed(Exception):
    """A claim that did not hold; the message says by how much."""


def _device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Failed("no CUDA device (run with --dry-run on a CPU machine)")
    return torch.device("cuda", 0)


def _gpu_only(dry: bool) -> torch.device:
    if dry:
        raise Skip("GPU only")
    return _device(dry)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(name: str, value: float, limit: float = TOL) -> None:
    if not value <= limit:
        raise Failed(f"{name} = {value:.3g}, above {limit:.0e}")


def _run(cmd: list[str], timeout: float, extra_env: dict[str, str | None] | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for key, value in (extra_env or {}).items():  # None: unset
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    print(proc.stdout[-6000:], proc.stderr[-6000:], sep="\n")
    if proc.returncode != 0:
        raise Failed(f"{' '.join(cmd[:4])}... exited {proc.returncode}")
    return proc.stdout


# --- steps -----------------------------------------------------------------------------------


def step_env(dry: bool) -> dict[str, Any]:
    import evendp

    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "evendp_from": str(Path(evendp.__file__).parent),
    }
    if str(ROOT / "src") not in figures["evendp_from"]:
        raise Failed(f"evendp imported from {figures['evendp_from']}, not this working tree")
    if torch.cuda.is_available():
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["gpu_total_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1
        )
    elif not dry:
        raise Failed("torch sees no CUDA device")
    return figures


def _gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu``: collecting only them keeps the step within its
    limit (collecting the whole suite imports every integration for nothing)."""
    tests = ROOT / "tests"
    return sorted(str(p.relative_to(ROOT)) for p in tests.rglob("test_*.py")
                  if "mark.gpu" in p.read_text())  # fmt: skip


def step_gpu_tests(dry: bool) -> dict[str, Any]:
    # Dry: the same selection, where every gpu-marked test skips; proves the marker collects.
    paths = _gpu_test_files()
    out = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *paths], 240
    )
    return {"files": paths, "pytest": out.strip().splitlines()[-1] if out.strip() else ""}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def step_exact_repeated(dry: bool) -> dict[str, Any]:
    from evendp import BalancedDataParallel

    device = _device(dry)
    figures: dict[str, Any] = {}
    for kind in ("pageable", "pinned"):
        if kind == "pinned" and device.type != "cuda":
            continue
        net, ref = _mlp().to(device), _mlp().to(device)
        x, y = torch.randn(37, 32), torch.randn(37, 8)
        if kind == "pinned":
            x, y = x.pin_memory(), y.pin_memory()
        wrapped = BalancedDataParallel(net, [device, device], weights=[3, 1])
        nn.functional.mse_loss(wrapped(x), y.to(device)).backward()
        nn.functional.mse_loss(ref(x.to(device)), y.to(device)).backward()
        pairs = zip(net.parameters(), ref.parameters(), strict=True)
        err = max(_rel(p.grad, q.grad) for p, q in pairs)  # type: ignore[arg-type]
        figures[f"{kind}_rel_err"] = err
        _check(f"{kind} gradient error", err)
    return figures


class _Probe(nn.Module):
    """Records, inside the replica's thread, the autocast dtype and the current stream."""

    def __init__(self, seen: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.seen = seen
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        stream = torch.cuda.current_stream() if x.is_cuda else None
        self.seen.append((out.dtype, stream, x.device))
        return out


def step_autocast_streams(dry: bool) -> dict[str, Any]:
    from evendp import BalancedDataParallel

    device = _device(dry)
    seen: list[tuple[Any, ...]] = []
    wrapped = BalancedDataParallel(_Probe(seen).to(device), [device, device], weights=[1, 1])
    dtype = torch.bfloat16
    x = torch.randn(8, 16, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.autocast(device.type, dtype=dtype):
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                wrapped(x)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            wrapped(x)
    dtypes = sorted({str(d) for d, _, _ in seen})
    if dtypes != [str(dtype)]:
        raise Failed(f"replica threads ran in {dtypes}, not {dtype}")
    if side is not None and any(s != side for _, s, _ in seen):
        raise Failed("a replica thread ran on another stream than the caller's")
    return {"replicas": len(seen), "dtype": str(dtype), "stream_checked": side is not None}


def step_weights_auto(dry: bool) -> dict[str, Any]:
    from evendp import BalancedDataParallel

    device = _gpu_only(dry)
    net = _mlp().to(device)
    x = torch.randn(64, 32, device=device)
    wrapped = BalancedDataParallel(net, [device, device], weights="auto", example=(x,))
    out = wrapped(x)
    return {"output_shape": list(out.shape), "split": list(getattr(wrapped, "last_sizes", []))}


def step_oom_resplit(dry: bool) -> dict[str, Any]:
    from evendp import OomResplit

    device = _gpu_only(dry)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 2 << 30  # this process may use 2 GiB; one full-batch activation needs ~4 GiB
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        torch.manual_seed(0)
        net = nn.Linear(4096, 4096).to(device)
        x = torch.randn(64, 4096, device=device)

        def chunk_loss(start: int, stop: int) -> torch.Tensor:
            h = net(x[start:stop])  # (n, 4096)
            wide = h.repeat(1, 4096)  # (n, 16M): 64 MiB per sample, kept for backward
            return wide.pow(2).mean()  # the same value as h.pow(2).mean()

        guard = OomResplit()
        loss = guard.run(64, chunk_loss, weight=1 / 64, zero_grad=net.zero_grad)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    if guard.resplits == 0:
        raise Failed("no OOM happened under the cap: the check did not test a re-split")
    if loss is None:
        raise Failed("the step was skipped instead of re-split")
    assert net.weight.grad is not None
    grad = net.weight.grad.clone()
    net.zero_grad()
    exact = net(x).pow(2).mean()
    exact.backward()
    err = _rel(grad, net.weight.grad)
    _check("re-split gradient error", err)
    return {
        "resplits": guard.resplits,
        "micro_batch_size": guard.micro_batch_size,
        "loss_rel_err": abs(float(loss) - float(exact)) / abs(float(exact)),
        "grad_rel_err": err,
    }


def step_cuda_events(dry: bool) -> dict[str, Any]:
    from evendp import SpeedBalancer

    device = _device(dry)
    balancer = SpeedBalancer([4], warmup=1)
    a = torch.randn(2048, 2048, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with balancer.measure(4):
        for _ in range(20 if device.type == "cuda" else 2):
            a = (a @ a).clamp_(-1, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    # What SpeedBalancer.step reads at an exchange: the host clock on CPU, CUDA events on a GPU.
    events = balancer._events
    timed = balancer._seconds + sum(b.elapsed_time(e) for b, e in events) / 1000
    ratio = timed / wall
    if not 0.5 <= ratio <= 1.05:
        raise Failed(f"timed {timed:.4f} s against {wall:.4f} s wall (ratio {ratio:.2f})")
    return {"timed_s": timed, "wall_s": wall, "ratio": ratio}


def step_nvml_vs_cuda(dry: bool) -> dict[str, Any]:
    from evendp import list_devices

    device = _gpu_only(dry)
    torch.cuda.init()
    free_cuda, total_cuda = torch.cuda.mem_get_info(device)
    devices = list_devices()
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", ""))
    match = [d for d in devices if uuid and uuid in d.uuid] or devices[:1]
    free_nvml = match[0].free_memory
    diff = abs(free_nvml - free_cuda) / total_cuda
    if diff > 0.02:
        raise Failed(f"NVML free {free_nvml} vs CUDA free {free_cuda}: {diff:.1%} of total")
    return {"free_nvml": free_nvml, "free_cuda": free_cuda, "diff_of_total": diff}


def step_nccl_one_rank(dry: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from evendp import ddp_loss, finish_distributed, global_count, global_mean, init_distributed
    from evendp._distributed._group import comm_device

    _gpu_only(dry)
    os.environ.setdefault("LOCAL_RANK", "0")
    device = init_distributed("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        figures = {"device": str(device), "comm_device": str(comm_device())}
        x = torch.arange(4.0)  # on the CPU: must be reduced on the GPU and come back
        loss = ddp_loss(x.sum(), 4)
        mean = global_mean(x.sum(), 4)
        count = global_count(4, device="cpu")
        t = torch.ones(3, device=device)
        dist.all_reduce(t)
        if loss.device.type != "cpu" or abs(loss.item() - 1.5) > 1e-6 or count.item() != 4:
            raise Failed(f"ddp_loss {loss} / global_count {count} under NCCL")
        figures.update(loss=loss.item(), mean=mean.item())
    finally:
        finish_distributed()
    return figures


def _gloo_worker(rank: int, port: int, device: str, out: str) -> None:
    import torch.distributed as dist

    from evendp import ddp_loss, finish_distributed, global_mean, init_distributed

    os.environ["LOCAL_RANK"] = str(rank)
    init_distributed("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.arange(3.0, device=device) + rank * 3  # rank 0: 0,1,2; rank 1: 3,4,5
    loss = ddp_loss(x.sum(), 3)
    mean = global_mean(x.sum(), 3)
    t = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(t)
    result = {"loss": loss.item(), "mean": mean.item(), "sum": t.tolist(), "dev": str(t.device)}
    finish_distributed()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def step_gloo_cuda_tensors(dry: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from tests._helpers import free_port

    device = _device(dry)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _gloo_worker, args=(free_port(), str(device), tmp), nprocs=2, start_method="spawn"
        )
        got = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    # Each rank's loss is its sum * 2 / 6; the mean is 15 / 6 everywhere; the sum is 3.
    want = [(0 + 1 + 2) * 2 / 6, (3 + 4 + 5) * 2 / 6]
    for r, g in enumerate(got):
        if abs(g["loss"] - want[r]) > 1e-6 or abs(g["mean"] - 2.5) > 1e-6 or g["sum"] != [3, 3]:
            raise Failed(f"rank {r} got {g}")
    return {"ranks": got}


def _buckets_worker(rank: int, port: int, device: str, out: str) -> None:

    from evendp import finish_distributed, init_distributed
    from evendp._distributed._grad_buckets import GradientBuckets
    from evendp._distributed._group import all_reduce_gradients

    os.environ["LOCAL_RANK"] = str(rank)
    init_distributed("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    x = torch.randn(8, 256, device=device, generator=None) + rank
    buckets = GradientBuckets(model.parameters(), bucket_bytes=300_000)  # 4 buckets
    results: dict[str, Any] = {"buckets": len(buckets.buckets)}
    for attempt in ("overlap", "stale"):
        model.zero_grad()
        if attempt == "stale":  # an attempt that launched, then the step ran again (other
            with buckets.overlapping():  # rows: the launched copies are wrong for it)
                model(2 * x).square().mean().backward()
            model.zero_grad()
        with buckets.overlapping():
            model(x).square().mean().backward()
        local = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        results[f"{attempt}_launched"] = len(buckets._launched)
        flags = torch.tensor([float(buckets.stale)], device=device)
        buckets.finish(flags)
        (buckets.reduce_again if flags.item() else buckets.apply)()
        got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        for p, g in zip(model.parameters(), local, strict=True):
            p.grad = g
        all_reduce_gradients(model.parameters())
        results[f"{attempt}_err"] = max(
            _rel(a, p.grad)  # type: ignore[arg-type]
            for a, p in zip(got, model.parameters(), strict=True)
        )
        results[f"{attempt}_device"] = str(got[0].device)
    finish_distributed()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


def step_grad_buckets(dry: bool) -> dict[str, Any]:
    """OOM-safe DDP's gradient buckets with CUDA gradients (their buffers are fresh each step
    on a GPU, kept on the CPU), two gloo ranks on one device: launched during backward, equal
    to the plain bucketed all-reduce, and reduced again when a launched copy went stale."""
    import torch.multiprocessing as mp

    from tests._helpers import free_port

    device = _device(dry)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _buckets_worker, args=(free_port(), str(device), tmp), nprocs=2, start_method="spawn"
        )
        got = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    for r, g in enumerate(got):
        launched_early = 0 < g["overlap_launched"] < g["buckets"]
        if not launched_early or g["overlap_err"] > TOL or g["stale_err"] > TOL:
            raise Failed(f"rank {r} got {g}")
    return {"ranks": got}


def step_overhead(dry: bool) -> dict[str, Any]:
    _gpu_only(dry)
    out = _run(
        [sys.executable, "benchmarks/overhead.py", "--device", "cuda:0", "--rounds", "5"], 240
    )
    return {"table": out.strip().splitlines()[-3:]}


def step_demo(dry: bool) -> dict[str, Any]:
    import contextlib
    import io

    from evendp.cli import main as cli

    devices, steps = (["cpu,cpu", "--no-plan"], "3") if dry else (["0,0"], "100")
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["train", "--steps", steps, "--devices", *devices, "--weights", "2,1", "--out",
                tmp, "--no-progress", "--n-layer", "1", "--n-embd", "32", "--block-size", "32",
                "--max-chars", "200000"]  # fmt: skip
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            code = cli(argv)
    out = text.getvalue()
    print(out)
    if code != 0:
        raise Failed(f"evendp train exited {code}")
    check = [line for line in out.splitlines() if "exactness check" in line]
    if not check:
        raise Failed("the demo printed no exactness check")
    err = float(check[0].rsplit(" ", 1)[1])
    _check("demo exactness", err)
    return {"exactness": err}


def step_integration(dry: bool) -> dict[str, Any]:
    """A tiny transformers GPT-2 with padding and -100 labels on two virtual devices."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise Skip(f"transformers missing: {exc}") from None
    from evendp import BalancedDataParallel

    device = _device(dry)
    cfg = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    net = GPT2LMHeadModel(cfg).to(device)
    ref = GPT2LMHeadModel(cfg).to(device)
    ref.load_state_dict(net.state_dict())
    ids = torch.randint(0, 64, (7, 16), device=device)
    mask = torch.ones_like(ids)
    mask[:, 12:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=-100
        )

    wrapped = BalancedDataParallel(net, [device, device], weights=[5, 2])
    loss_of(wrapped(input_ids=ids, attention_mask=mask).logits).backward()
    loss_of(ref(input_ids=ids, attention_mask=mask).logits).backward()
    err = max(
        _rel(p.grad, q.grad)  # type: ignore[arg-type]
        for p, q in zip(net.parameters(), ref.parameters(), strict=True)
        if q.grad is not None and q.grad.norm() > 0
    )
    _check("GPT-2 gradient error", err, 1e-4 if device.type == "cuda" else TOL)
    return {"rel_err": err}


def _script(
    name: str,
    dry: bool,
    *argv: str,
    timeout: float = 240,
    env: dict[str, str | None] | None = None,
    smoke: bool = False,
) -> Any:
    """Run ``benchmarks/NAME`` with ``--json`` and return what it wrote (``env``: variables
    set for it). Dry: the script is imported here (no torch start-up of its own); with
    ``smoke``, its ``main`` runs ``--smoke`` on the CPU, else the step is a skip: its figures
    need the GPU."""
    if dry:
        import importlib

        script = importlib.import_module(name.removesuffix(".py"))  # benchmarks/: sys.path[0]
        if smoke:
            return script.main([*argv, "--smoke"])
        raise Skip("GPU only (the script imports)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "figures.json")
        _run([sys.executable, f"benchmarks/{name}", *argv, "--json", str(out)], timeout, env)
        return json.loads(out.read_text())


#: The allocator setting evendp's entry points choose when the user set none
#: (``evendp._planning._allocator.alloc_conf_default``); a session's own setting wins.
ALLOC_CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _allocator_rows(dry: bool, conf: str | None) -> dict[str, Any]:
    """``planner_allocator.py --skip-gpt2`` under ``PYTORCH_CUDA_ALLOC_CONF=conf`` (``None``:
    the allocator's default setting): every real row's ``max_memory_reserved`` must be at
    most the plan's reserved figure, and that at most 1.1 times it."""
    env: dict[str, str | None] = {"PYTORCH_CUDA_ALLOC_CONF": conf}  # None: unset, defaults
    figures = _script("planner_allocator.py", dry, "--skip-gpt2", timeout=120, env=env)
    rows = figures.get("gpu") or []
    if not rows:
        raise Failed("planner_allocator.py measured no GPU row")
    bad = [r for r in rows if not r["reserved"] <= r["planned"] <= 1.1 * r["reserved"]]
    for r in rows:
        r["ratio"] = round(r["planned"] / r["reserved"], 3)
        r["ratio_allocated"] = round(r["tensors"] / r["allocated"], 3)  # figures, no threshold
    if bad:
        raise Failed(
            f"planned reserved outside [real, 1.1 x real] ({conf or 'default setting'}): "
            + "; ".join(f"{r['model']} planned {r['planned']} real {r['reserved']}" for r in bad)
        )
    return {"alloc_conf": conf, "rows": rows, "calibration": figures.get("calibration")}


def step_planner_allocator(dry: bool) -> dict[str, Any]:
    """The allocator model against the real allocator, its default setting (segments)."""
    return _allocator_rows(dry, None)


def step_planner_allocator_expandable(dry: bool) -> dict[str, Any]:
    """The same with expandable segments, the setting evendp's entry points choose."""
    return _allocator_rows(dry, "expandable_segments:True")


def step_capped_batch(dry: bool) -> dict[str, Any]:
    """A planned batch under a real cap (GPT-2 124M bf16 and the conv net, 8 and 20 GiB):
    the planned batch must train and be at least 0.9 of the largest that does. The plan
    and the capped training run in one process under one ``PYTORCH_CUDA_ALLOC_CONF``
    (:data:`ALLOC_CONF`), and each row says which setting its plan modelled."""
    rows = _script("capped_batch.py", dry, env={"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF})
    figures = {"rows": rows, "alloc_conf": ALLOC_CONF}
    expandable = "expandable_segments:true" in ALLOC_CONF.replace(" ", "").lower()
    unlike = [r for r in rows if ("expandable" in str(r.get("allocator"))) != expandable]
    if unlike:
        raise Failed(f"the plan modelled another allocator setting than {ALLOC_CONF}: {unlike}")
    bad = [r for r in rows if not r["planned_ran"] or (r["ratio"] or 0) < 0.9]
    if bad:
        raise Failed(
            "planned/largest under the cap: "
            + "; ".join(
                f"{r['model']} {r['memory_gib']:g} GiB planned {r['planned']}, largest "
                f"{r['largest']}, ran {r['planned_ran']}"
                for r in bad
            )
        )
    return figures


def step_mixed_box(dry: bool) -> dict[str, Any]:
    """Two gloo ranks on the GPU capped at 8 and 4 GiB: the planned split trains, at a global
    batch of at least 0.9 of the best split found by trial. Dry: the script's ``--smoke``
    on the CPU (a tiny GPT-2 at its CPU-sized memory, no cap): the planned split trains."""
    figures = _script("mixed_box.py", dry, smoke=True)
    if not figures["planned_ran"] or (not dry and (figures["ratio"] or 0) < 0.9):
        raise Failed(
            f"planned {figures['planned']} (ran {figures['planned_ran']}) against the best "
            f"by trial {figures['best']}: ratio {figures['ratio']}"
        )
    return figures


def step_step_costs(dry: bool) -> dict[str, Any]:
    """GPT-2 124M bf16 steady steps: the Trainer against a plain loop, UnevenTrainer against
    the HF Trainer (ratios, no threshold), and host syncs per step counted by CUDA; fails when
    UnevenTrainer syncs more often than the HF Trainer it extends."""
    figures = _script("step_costs.py", dry)
    runs = figures["runs"]
    if (runs["uneven"]["syncs_per_step"] or 0) > (runs["hf"]["syncs_per_step"] or 0):
        raise Failed(
            f"UnevenTrainer {runs['uneven']['syncs_per_step']} host syncs per step against the "
            f"HF Trainer's {runs['hf']['syncs_per_step']}"
        )
    return figures


STEPS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "env": step_env,
    "gpu-tests": step_gpu_tests,
    "capped-batch": step_capped_batch,
    "mixed-box": step_mixed_box,
    "step-costs": step_step_costs,
    "planner-allocator": step_planner_allocator,
    "planner-allocator-expandable": step_planner_allocator_expandable,
    "exact-repeated": step_exact_repeated,
    "autocast-streams": step_autocast_streams,
    "weights-auto": step_weights_auto,
    "oom-resplit": step_oom_resplit,
    "cuda-events": step_cuda_events,
    "nvml-vs-cuda": step_nvml_vs_cuda,
    "nccl-one-rank": step_nccl_one_rank,
    "gloo-cuda-tensors": step_gloo_cuda_tensors,
    "grad-buckets": step_grad_buckets,
    "overhead": step_overhead,
    "demo": step_demo,
    "integration": step_integration,
}


def run_step(name: str, out: Path, dry: bool) -> int:
    result: dict[str, Any] = {"status": "pass", "figures": {}, "note": ""}
    start = time.perf_counter()
    try:
        result["figures"] = STEPS[name](dry)
    except Skip as exc:
        result.update(status="skip", note=str(exc))
    except Exception as exc:
        traceback.print_exc()
        result.update(status="fail", note=f"{type(exc).__name__}: {exc}"[:2000])
    result["seconds"] = round(time.perf_counter() - start, 2)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    (out / "steps" / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{name}: {result['status']} {result['note']}")
    return 0 if result["status"] != "fail" else 1


def summarize(out: Path, dry: bool, codes: dict[str, str]) -> int:
    steps: dict[str, Any] = {}
    for name in STEPS:
        path = out / "steps" / f"{name}.json"
        if path.exists():
            steps[name] = json.loads(path.read_text())
        elif name in codes:  # started, but left no result: killed by its time limit
            rc = codes[name]
            status = "timeout" if rc in ("124", "137") else "fail"
            steps[name] = {"status": status, "note": f"exit {rc}, no result written"}
        else:
            continue
        steps[name]["log"] = f"logs/{name}.log"
    summary = {
        "dry_run": dry,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "passed": all(s["status"] in ("pass", "skip") for s in steps.values()),
        "steps": steps,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for name, s in steps.items():
        print(f"{name:18} {s['status']:8} {s.get('note', '')[:100]}")
    return 0 if summary["passed"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["run", "summarize", "list"])
    parser.add_argument("step", nargs="?", help="a step, or several comma-separated")
    parser.add_argument("--out", type=Path, default=Path("gpu-session-out"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--codes", default="", help="summarize: name=rc,... from the runner")
    args = parser.parse_args()
    if args.action == "list":
        print(" ".join(STEPS))
        return 0
    unknown = [s for s in (args.step or "").split(",") if s and s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; steps: {' '.join(STEPS)}")
    if args.action == "run":
        if args.step is None:
            parser.error("run needs a STEP (or several, comma-separated)")
        # Several steps in one process save a torch start-up each (the dry run does this).
        return max(run_step(step, args.out, args.dry_run) for step in args.step.split(","))
    codes = dict(p.split("=", 1) for p in args.codes.split(",") if "=" in p)
    return summarize(args.out, args.dry_run, codes)


if __name__ == "__main__":
    sys.exit(main())

"""Cost balance on variable-length data: the sample-count split against the cost-balanced one.

The data are the standard library's own functions (``ast`` finds them in the sorted top-level
modules, as the demo's corpus does), cleaned and tokenized by the demo's character vocabulary
(:class:`evendp.examples.stdlib_text.CharVocab`: one token per character) and truncated to
``--max-len`` tokens, as a language model's block size would. Both arms drive the public API:
:class:`evendp.UnevenBatchSampler` with the same ``batch_sizes`` (the capacities) and so the
same global batch, without ``costs`` (the sample-count split evendp did before) and with
``costs=lengths`` (each rank's padded tokens in proportion to its size).

Per step, with ``cost_i`` the padded cost of rank ``i``'s share (``len * max`` cost) and
``cap_i`` its capacity:

- bottleneck = ``max_i(cost_i / cap_i) / (sum_i cost_i / sum_i cap_i)``: 1.0 is a perfect
  balance of what the split itself runs (target <= 1.05 at the median step);
- padding = ``sum_i cost_i / sum of the samples' own costs`` (target <= 1.10);
- step time = ``max_i(cost_i / cap_i) / (real cost / sum_i cap_i)``: the slowest device's
  time against a padding-free, perfectly balanced step (both effects together; the ratio of
  the two arms is the speed-up the model predicts).

Costs are ``tokens`` (len) or ``attention`` (``len + len**2 / 256``: attention without a
fused kernel). Then wall time per epoch on 2 gloo ranks: rank 1 computes every sample twice
(a device at half speed, as ``hetero_speed.py --slow twice`` does), so the capacities are
2:1 and ``batch_sizes`` is 2:1 in both arms; each rank pads its share to its longest row, as
a collate function does; ranks are pinned to their own core with ``taskset`` when it exists.
Rounds interleave count split, cost balance and a second count split (the A/A control row:
its ratio to the first shows the noise). The loss is the count-weighted token mean
(``ddp_loss`` with the non-ignored tokens), so both arms compute the same gradient.

Run: ``python benchmarks/cost_balance.py`` (a few minutes); ``--quick`` (under a minute on 2
cores). The last line reads ``bottleneck <count> -> <cost>, padding <count> -> <cost>``
(the median step of the first configuration, token costs).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from evendp import (
    UnevenBatchSampler,
    ddp_loss,
    finish_distributed,
    init_distributed,
    padded_cost,
)
from evendp.examples.stdlib_text import CharVocab

VOCAB = CharVocab()
ATTENTION_K = 256


# --------------------------------------------------------------------------------------------
# Data: the standard library's functions as token sequences


def clean(text: str) -> str:
    """The demo corpus' cleaning: tabs to four spaces, only characters in the vocabulary."""
    allowed = VOCAB.stoi.keys()
    return "".join(ch for ch in text.replace("\t", "    ") if ch in allowed)


def stdlib_functions(max_files: int, max_len: int) -> list[torch.Tensor]:
    """Token ids of every function in the first ``max_files`` stdlib modules, truncated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: list[torch.Tensor] = []
    for path in sorted(root.glob("*.py"))[:max_files]:
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError):
            continue  # an unreadable module is skipped; the order of the rest stays fixed
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                text = clean(textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])))
                if len(text) >= 2:  # a next-token loss needs two tokens
                    rows.append(VOCAB.encode(text[:max_len]))
    return rows


# --------------------------------------------------------------------------------------------
# Part 1: the split's arithmetic, step by step


def epoch_plan(
    n: int, sizes: list[int], costs: list[float] | None, group_steps: int, seed: int
) -> list[list[list[int]]]:
    """Per step, every rank's indices, each rank from its own sampler (as on real ranks)."""
    per_rank = [
        list(UnevenBatchSampler(n, sizes, rank=r, seed=seed, costs=costs, group_steps=group_steps))
        for r in range(len(sizes))
    ]
    return [list(step) for step in zip(*per_rank, strict=True)]


def step_figures(
    step: list[list[int]], costs: list[float], capacities: list[int]
) -> tuple[float, float, float]:
    """(bottleneck, padding, step time) of one step, as the module docstring defines them."""
    padded = [padded_cost([costs[i] for i in share]) for share in step]
    real = sum(costs[i] for share in step for i in share)
    slowest = max(p / c for p, c in zip(padded, capacities, strict=True) if c > 0)
    total_cap = sum(capacities)
    return slowest / (sum(padded) / total_cap), sum(padded) / real, slowest / (real / total_cap)


def compare(
    lengths: list[int],
    capacities: list[int],
    cost_of: Callable[[int], float],
    group_steps: int,
    seed: int,
) -> dict[str, tuple[float, float, float]]:
    """Median (bottleneck, padding, step time) over the epoch's full steps, for each arm."""
    costs = [cost_of(length) for length in lengths]
    out = {}
    arms = (("count", None, 1), ("cost", costs, 1), ("grouped", costs, group_steps))
    for arm, arm_costs, group in arms:
        steps = epoch_plan(len(costs), capacities, arm_costs, group, seed)
        full = [s for s in steps if sum(map(len, s)) == sum(capacities)]
        figures = [step_figures(s, costs, capacities) for s in full]
        out[arm] = tuple(statistics.median(f[k] for f in figures) for k in range(3))
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Part 2: wall time per epoch on 2 gloo ranks, rank 1 at half speed

WIDTH = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # Per-token work, so a rank's time follows the padded tokens it holds.
    return nn.Sequential(
        nn.Embedding(VOCAB.size, WIDTH),
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.GELU(),
        nn.Linear(4 * WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, VOCAB.size),
    )


def pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of shape (n, longest): right padding, -100 labels on pads."""
    width = max((len(r) for r in rows), default=1)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = row
        labels[k, : len(row) - 1] = row[1:]  # next token; the last position has none
    return ids, labels


def token_loss_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)  # (n, T, V)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def run_epoch(
    ddp: nn.Module,
    shadow: nn.Module,
    opt: torch.optim.Optimizer,
    rows: list[torch.Tensor],
    sampler: UnevenBatchSampler,
    slow: bool,
) -> float:
    dist.barrier()
    start = time.perf_counter()
    for idx in sampler:
        ids, labels = pad([rows[i] for i in idx])
        local = token_loss_sum(ddp, ids, labels)
        if slow:  # a device at half speed: every sample's forward and backward twice
            local = local + 0 * token_loss_sum(shadow, ids, labels)
        count = int((labels != -100).sum())
        opt.zero_grad()
        ddp_loss(local, count).backward()  # count-weighted: the same gradient in both arms
        opt.step()
    dist.barrier()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = args.rank
    init_distributed("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    rows = stdlib_functions(args.files, args.max_len)[: args.samples]
    lengths = [len(r) for r in rows]
    ddp = nn.parallel.DistributedDataParallel(make_model())
    shadow = make_model()
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    sizes = [2 * args.batch // 3, args.batch - 2 * args.batch // 3]  # capacities 2:1
    samplers = {
        "count": UnevenBatchSampler(rows, sizes, rank=rank, seed=1),
        "cost": UnevenBatchSampler(rows, sizes, rank=rank, seed=1, costs=lengths),
        "grouped": UnevenBatchSampler(
            rows, sizes, rank=rank, seed=1, costs=lengths, group_steps=args.group_steps
        ),
    }
    arms = [("count", "count"), ("cost", "cost"), ("grouped", "grouped"), ("count (A/A)", "count")]
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    run_epoch(ddp, shadow, opt, rows, samplers["count"], rank == 1)  # warm-up
    for round_ in range(args.rounds):
        for name, kind in arms if round_ % 2 == 0 else arms[::-1]:
            times[name].append(run_epoch(ddp, shadow, opt, rows, samplers[kind], rank == 1))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "sizes": sizes}))
    finish_distributed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wall_time(args: argparse.Namespace) -> tuple[dict[str, list[float]], list[int], str]:
    allowed = sorted(os.sched_getaffinity(0))
    pinned = bool(shutil.which("taskset")) and len(allowed) >= 2
    note = f"ranks pinned to cores {allowed[:2]}" if pinned else "ranks NOT pinned"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        procs = []
        for rank in range(2):
            pin = ["taskset", "-c", str(allowed[rank])] if pinned else []
            cmd = [
                *pin, sys.executable, __file__, "--worker", "--rank", str(rank),
                "--port", str(port), "--out", str(out), "--files", str(args.files),
                "--max-len", str(args.max_len), "--samples", str(args.samples),
                "--batch", str(args.batch), "--rounds", str(args.rounds),
                "--group-steps", str(args.group_steps),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd))
        codes = [p.wait() for p in procs]
        if any(codes) or not out.exists():
            raise SystemExit(f"gloo workers failed with exit codes {codes}")
        result = json.loads(out.read_text())
    return result["times"], result["sizes"], note


# --------------------------------------------------------------------------------------------
# Driver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller data and fewer rounds (< 1 min)")
    p.add_argument("--files", type=int, default=None, help="stdlib modules read (default 120)")
    p.add_argument("--max-len", type=int, default=512, help="tokens per function, at most")
    p.add_argument("--batch", type=int, default=48, help="global batch in samples per step")
    p.add_argument("--samples", type=int, default=None, help="samples in the timed epoch")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (median)")
    p.add_argument(
        "--group-steps", type=int, default=16, help="group_steps of the grouped arm (16)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.files = args.files or (40 if args.quick else 120)
    args.samples = args.samples or (240 if args.quick else 960)
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.worker:
        worker(args)
        return

    lengths = [len(r) for r in stdlib_functions(args.files, args.max_len)]
    print(
        f"cost_balance: {len(lengths)} stdlib functions from {args.files} modules, tokens "
        f"(chars) truncated at {args.max_len}: median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.0f}; global batch {args.batch}",
        flush=True,
    )
    configs = [[24, 12, 12], [24, 24], [18, 12, 12, 6]]  # capacities 2:1:1, 1:1, 3:2:2:1
    costs: dict[str, Callable[[int], float]] = {
        "tokens": float,
        f"attn len+len^2/{ATTENTION_K}": lambda n: n + n * n / ATTENTION_K,
    }
    g = args.group_steps
    print(f"arms: count = sample-count split; cost = costs=lengths; grouped = costs=lengths, "
          f"group_steps={g}. Median step of an epoch.")  # fmt: skip
    head = "count/cost/grouped"
    print(f"\n{'capacities':10s} {'cost':25s} {'bottleneck':>20s} {'padding':>20s} "
          f"{'step time':>20s} {'speed-up':>14s}")  # fmt: skip
    print(f"{'':10s} {'':25s} {head:>20s} {head:>20s} {head:>20s} {'cost/grouped':>14s}")
    headline = None
    for caps in configs:
        scaled = [round(c * args.batch / sum(caps)) for c in caps]
        scaled[0] += args.batch - sum(scaled)  # the same global batch in every configuration
        ratio = ":".join(str(c // min(caps)) if c % min(caps) == 0 else str(c) for c in caps)
        for name, cost_of in costs.items():
            fig = compare(lengths, scaled, cost_of, g, seed=0)
            a, b, c = fig["count"], fig["cost"], fig["grouped"]
            cells = " ".join(f"{a[k]:6.3f} {b[k]:6.3f} {c[k]:6.3f}" for k in range(3))
            print(f"{ratio:10s} {name:25s} {cells} {a[2] / b[2]:6.2f}x {a[2] / c[2]:6.2f}x")
            if headline is None:
                headline = (a[0], c[0], a[1], c[1])

    times, sizes, note = wall_time(args)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\nwall time per epoch, 2 gloo ranks, rank 1 at half speed, batch_sizes {sizes} in "
          f"both arms, {args.samples} samples, {args.rounds} rounds; {note}")  # fmt: skip
    print(f"{'arm':28s} {'s/epoch':>8s} {'vs count':>9s}  per round")
    for name, ts in times.items():
        each = " ".join(f"{t:.2f}" for t in ts)
        label = {
            "count": "sample-count split",
            "cost": "cost-balanced",
            "grouped": f"cost-balanced, group_steps={g}",
        }.get(name, name)
        print(f"{label:28s} {med[name]:8.2f} {med['count'] / med[name]:8.2f}x  {each}")
    print(f"speed-up over the sample-count split: cost-balanced {med['count'] / med['cost']:.2f}x, "
          f"grouped {med['count'] / med['grouped']:.2f}x "
          f"(A/A control {med['count'] / med['count (A/A)']:.2f}x)")  # fmt: skip
    print(
        f"last line: median step, capacities 2:1:1, token costs, count -> grouped (group_steps={g})"
    )
    assert headline is not None
    print(
        f"bottleneck {headline[0]:.3f} -> {headline[1]:.3f}, "
        f"padding {headline[2]:.3f} -> {headline[3]:.3f}"
    )


if __name__ == "__main__":
    main()

"""eta_speed on mixed-speed ranks: plain DDP with an even split against evendp's speed balance.

Two gloo ranks, each pinned with ``taskset`` to its own core; a busy process shares the second
core, so rank 1 runs at about half speed. We measure:

1. standalone samples/s of one process on each core (core 1 with and without the busy process);
2. plain PyTorch DDP, equal batches (the even split is capped by the slow rank);
3. evendp: UnevenBatchSampler + SpeedBalancer + ddp_loss, same global batch;
4. evendp with the slowdown starting mid-run (busy process started at a step), steps to recover.

``--slow busy`` is that setup. The scheduler makes it noisy: a rank that waits in an
all-reduce gets scheduler credit against the busy loop, so in DDP the slow rank runs faster
than its standalone figure. ``--slow twice`` instead makes rank 1 compute every sample twice
(forward and backward of a shadow copy: a device at half speed, repeatable), and
``--slow both`` (the default) runs both setups.
Standalone rates are measured with both pinned processes running at once, right before and
right after each DDP run (their mean is that run's reference), so load from other programs on
the machine hits both sides of the ratio alike; ``--rounds`` (3) repeats the whole measurement
and the table gives the median and every round.

eta_speed = global samples/s / (sum of the two standalone samples/s). Target: >= 0.90 with
speed balance and recovery within 20 steps. Run: ``python benchmarks/hetero_speed.py``
(about 13 minutes: 4.5 for ``--slow twice``, 9 for ``--slow busy``); ``--steps 12 --batch 8
--rounds 1`` for a smoke run. The first row, plain DDP with no rank slowed, is the ceiling
this machine allows: communication, synchronization (a step waits for the slower rank's
jitter) and process overhead, which no split can recover; the "of ceiling" column divides
by it. The default batch (128 samples a rank) keeps compute well
above the all-reduce, as in real training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from evendp import (
    SpeedBalancer,
    UnevenBatchSampler,
    ddp_loss,
    finish_distributed,
    init_distributed,
)
from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500

SEQ, WIDTH, POOL = 32, 128, 256


def make_model() -> nn.Module:
    # A per-token MLP then mean-pool: compute grows with samples x tokens while the gradient
    # all-reduce stays small, like real models where compute dominates communication.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.GELU()
    )


def forward_sum(
    model: nn.Module, head: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    h = model(x).mean(dim=1)  # (n, SEQ, WIDTH) -> (n, WIDTH)
    return F.cross_entropy(h @ head, y, reduction="sum")


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(POOL, SEQ, WIDTH, generator=g), torch.randint(0, 10, (POOL,), generator=g)


def start_busy(core: int | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", "while True: pass"]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    return subprocess.Popen(cmd)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.kill()  # only the busy loop this script started
        proc.wait()


# --------------------------------------------------------------------------------------------
# Workers (run in their own pinned processes)


def standalone(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    model, shadow, (x, y) = make_model(), make_model(), make_data()
    head = torch.randn(WIDTH, 10, requires_grad=True)
    opt = torch.optim.SGD([*model.parameters(), head], lr=1e-3)
    n, times = args.batch // 2, []
    for step in range(args.steps):
        idx = [(step * n + i) % POOL for i in range(n)]
        opt.zero_grad()
        loss = forward_sum(model, head, x[idx], y[idx]) / n
        for _ in range(args.extra):  # an emulated slower device (0 unless --slow twice)
            loss = loss + 0 * forward_sum(shadow, head, x[idx], y[idx])
        loss.backward()
        opt.step()
        times.append(time.perf_counter())
    warm = min(3, args.steps // 3)
    return {"samples_per_s": n * (args.steps - 1 - warm) / (times[-1] - times[warm])}


def ddp_run(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(1)
    rank = args.rank
    init_distributed("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    model, shadow, (x, y) = make_model(), make_model(), make_data()
    head = torch.randn(WIDTH, 10, generator=torch.Generator().manual_seed(2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    half = args.batch // 2
    sampler = UnevenBatchSampler(args.steps * args.batch, [half, half], rank=rank, shuffle=False)
    balancer = None if args.worker == "even" else SpeedBalancer(sampler.batch_sizes, warmup=3)
    busy, times, sizes = None, [], []
    for step, idx in enumerate(sampler):
        slowed = args.worker != "midrun" or step >= args.slow_at
        if (
            args.worker == "midrun"
            and rank == 0
            and step == args.slow_at
            and args.busy_core is not None
        ):
            busy = start_busy(args.busy_core)
        extra = args.extra if rank == 1 and slowed else 0
        rows = [i % POOL for i in idx]
        if balancer is None:
            # Plain PyTorch: equal batches, the ordinary mean loss.
            loss = forward_sum(ddp, head, x[rows], y[rows]) / len(rows)
            for _ in range(extra):  # the shadow's backward runs in loss.backward()
                loss = loss + 0 * forward_sum(shadow, head, x[rows], y[rows])
        else:
            # Time only the local forward; backward waits in DDP's all-reduce.
            with balancer.measure(len(rows)):
                local_sum = forward_sum(ddp, head, x[rows], y[rows])
                for _ in range(extra):
                    local_sum = local_sum + 0 * forward_sum(shadow, head, x[rows], y[rows])
            # The step's own global count: right on a short last step and after a re-split.
            loss = ddp_loss(local_sum, len(rows), sampler.samples_in_step(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if balancer is not None and balancer.step():
            sampler.set_batch_sizes(balancer.batch_sizes)
        times.append(time.perf_counter())
        sizes.append(len(rows))
    stop(busy)
    out: list[list[int]] = [[], []]
    dist.all_gather_object(out, sizes)
    result = {"times": times, "sizes": [list(p) for p in zip(*out, strict=True)]}
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    finish_distributed()
    return result


# --------------------------------------------------------------------------------------------
# Driver


def pinned(core: int | None) -> list[str]:
    return [] if core is None else ["taskset", "-c", str(core)]


def worker_cmd(args: argparse.Namespace, mode: str, out: Path, extra: list[str]) -> list[str]:
    # A standalone rate settles in fewer steps than a DDP run with a re-split in it.
    steps = max(8, args.steps // 2) if mode == "standalone" else args.steps
    return [
        sys.executable, __file__, "--worker", mode, "--out", str(out),
        "--steps", str(steps), "--batch", str(args.batch), *extra,
    ]  # fmt: skip


def run_standalone(
    args: argparse.Namespace, cores: list[int | None], extras: list[int], tmp: Path, tag: str
) -> list[float]:
    """Both cores' standalone samples/s, measured at the same time."""
    outs = [tmp / f"standalone-{tag}-{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [*pinned(core), *worker_cmd(args, "standalone", out, ["--extra", str(extra)])]
        )
        for core, out, extra in zip(cores, outs, extras, strict=True)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a standalone worker failed")
    return [float(json.loads(o.read_text())["samples_per_s"]) for o in outs]


def run_ddp(
    args: argparse.Namespace,
    mode: str,
    cores: list[int | None],
    tmp: Path,
    slow_extra: int,
    busy_core: int | None = -1,
) -> dict:  # type: ignore[type-arg]
    """One 2-rank run; ``busy_core=-1``: the mid-run busy process goes on ``cores[1]``."""
    port, outs, procs = _free_port(), [], []
    busy_core = cores[1] if busy_core == -1 else busy_core
    for rank in range(2):
        out = tmp / f"{mode}-{rank}.json"
        extra = ["--rank", str(rank), "--port", str(port), "--slow-at", str(args.slow_at)]
        extra += ["--extra", str(slow_extra)]
        if slow_extra == 0 and busy_core is not None:
            extra += ["--busy-core", str(busy_core)]
        procs.append(subprocess.Popen([*pinned(cores[rank]), *worker_cmd(args, mode, out, extra)]))
        outs.append(out)
    codes = [p.wait() for p in procs]
    if any(codes):
        if not outs[0].exists():
            raise SystemExit(f"{mode} workers failed with exit codes {codes}")
        print(f"warning: {mode} workers exited with {codes} after finishing all steps")
    result: dict = json.loads(outs[0].read_text())  # type: ignore[type-arg]
    return result


def throughput(times: list[float], batch: int, first: int, last: int) -> float:
    return batch * (last - first) / (times[last] - times[first])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="steps per DDP run")
    p.add_argument("--batch", type=int, default=256, help="global batch (even split: half each)")
    p.add_argument(
        "--slow-at", type=int, default=-1, help="mid-run slowdown step (default steps/3)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--slow", choices=["busy", "twice", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3, help="measurement rounds (median)")
    p.add_argument("--busy-core", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--extra", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.slow_at < 0:
        args.slow_at = args.steps // 3
    if args.worker:
        result = standalone(args) if args.worker == "standalone" else ddp_run(args)
        if args.worker == "standalone":
            Path(args.out).write_text(json.dumps(result))
        return

    allowed = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") and len(allowed) >= 2:
        cores: list[int | None] = allowed[:2]
        note = f"ranks pinned to cores {cores[0]} and {cores[1]}"
    else:
        cores = [None, None]
        note = "no taskset or < 2 cores: processes NOT pinned, figures are rough"
    print(f"hetero_speed: {note}; global batch {args.batch}, {args.steps} steps", flush=True)
    for setup in ["busy", "twice"] if args.slow == "both" else [args.slow]:
        run_setup(args, setup, cores)


def measure_round(
    args: argparse.Namespace, setup: str, cores: list[int | None], tmp: Path
) -> dict[str, float]:
    """One round: eta of the ceiling, the even split and speed balance, each against
    standalone rates measured right before and right after it (their mean), so that load
    drifting on the machine between phases hits both sides of each ratio alike."""
    warm, last = max(3, args.steps // 4), args.steps - 1
    slow_extra = 1 if setup == "twice" else 0  # twice: rank 1 computes every sample twice

    def eta(run: dict, rates_before: list[float], rates_after: list[float]) -> float:  # type: ignore[type-arg]
        ideal = (sum(rates_before) + sum(rates_after)) / 2
        return throughput(run["times"], args.batch, warm, last) / ideal

    free = run_standalone(args, cores, [0, 0], tmp, "free")
    ceiling = run_ddp(args, "even", cores, tmp, 0, busy_core=None)
    free_after = run_standalone(args, cores, [0, 0], tmp, "free")
    busy = start_busy(cores[1]) if setup == "busy" else None
    try:
        slow = run_standalone(args, cores, [0, slow_extra], tmp, "slow")
        even = run_ddp(args, "even", cores, tmp, slow_extra)
        mid = run_standalone(args, cores, [0, slow_extra], tmp, "slow")
        balanced = run_ddp(args, "balanced", cores, tmp, slow_extra)
        slow_after = run_standalone(args, cores, [0, slow_extra], tmp, "slow")
    finally:
        stop(busy)
    return {
        "ceiling": eta(ceiling, free, free_after),
        "even": eta(even, slow, mid),
        "balanced": eta(balanced, mid, slow_after),
        "rank0": (slow[0] + slow_after[0]) / 2,
        "rank1": (slow[1] + slow_after[1]) / 2,
        "sizes": balanced["sizes"][-1],  # type: ignore[dict-item]
    }


def run_setup(args: argparse.Namespace, setup: str, cores: list[int | None]) -> None:
    """Rounds of ceiling / even / balanced figures, then the mid-run slowdown, for one setup."""
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        rounds = [measure_round(args, setup, cores, tmp) for _ in range(args.rounds)]
        free = run_standalone(args, cores, [0, 0], tmp, "free")
        midrun = run_ddp(args, "midrun", cores, tmp, 1 if setup == "twice" else 0)
        busy = start_busy(cores[1]) if setup == "busy" else None
        try:
            slow = run_standalone(args, cores, [0, 1 if setup == "twice" else 0], tmp, "slow")
        finally:
            stop(busy)

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in rounds)  # type: ignore[arg-type]

    print(f"\n== slow rank 1 by: {setup} ({args.rounds} rounds; median, then each round) ==")
    print(f"standalone samples/s while slowed: rank 0 {median('rank0'):.0f}, rank 1 "
          f"{median('rank1'):.0f}")  # fmt: skip
    print(f"{'run':28s} {'eta_speed':>10s} {'of ceiling':>10s}  per round")
    names = [("ceiling", "plain DDP, no rank slowed"), ("even", "plain DDP, even split"),
             ("balanced", "evendp speed balance")]  # fmt: skip
    for key, name in names:
        each = " ".join(f"{float(r[key]):.3f}" for r in rounds)  # type: ignore[arg-type]
        print(f"{name:28s} {median(key):10.3f} {median(key) / median('ceiling'):10.3f}  {each}")
    print(f"speed balance / even split: {median('balanced') / median('even'):.2f}x; "
          f"final sizes {[r['sizes'] for r in rounds]}")  # fmt: skip

    # Mid-run: the slowdown starts at step k; recovered when a 5-step window is back to 0.90
    # of the slowed standalone sum.
    t, k, last, window = midrun["times"], args.slow_at, args.steps - 1, 5
    warm = max(3, args.steps // 4)
    ideal = sum(slow)
    before = throughput(t, args.batch, warm, max(warm + 1, k - 1)) / sum(free)
    recovered = next(
        (
            j - k
            for j in range(k, last - window + 1)
            if throughput(t, args.batch, j, j + window) / ideal >= 0.90
        ),
        None,
    )
    after = throughput(t, args.batch, min(k + 20, last - 1), last) / ideal
    print(
        f"mid-run slowdown at step {k}: eta before {before:.3f}, recovered to >= 0.90 after "
        f"{'never' if recovered is None else recovered} step(s), eta from step {k + 20}: "
        f"{after:.3f}, sizes {midrun['sizes'][k - 1]} -> {midrun['sizes'][-1]}",
        flush=True,
    )


if __name__ == "__main__":
    main()

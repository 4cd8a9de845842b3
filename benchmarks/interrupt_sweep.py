"""A longer sweep of interrupts under `evendp train --mode ddp` (gloo, CPU), beyond the CI's three.

For each seeded moment and each target (rank 0, rank 1, the launcher) and signal (SIGINT,
SIGTERM), one run is interrupted at that moment, resumed to the end, and its final weights
compared with an uninterrupted run's. Prints one line per case and a summary; exits 1 when a
case fails (wrong exit code, ranks left running, inconsistent checkpoint, different weights).

    PYTHONPATH=src python benchmarks/interrupt_sweep.py --moments 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.cli.test_train_faults import _start, _step, _wait_for, _weights, _workers

TARGETS = [
    ("rank0", signal.SIGINT),
    ("rank1", signal.SIGINT),
    ("launcher", signal.SIGINT),
    ("rank0", signal.SIGTERM),
    ("rank1", signal.SIGTERM),
    ("launcher", signal.SIGTERM),
]


def _case(out: Path, target: str, signum: int, moment: float, reference: Path) -> str:
    proc = _start(out)
    _wait_for(lambda: _step(out / "ckpt.pt") is not None, 300, "the first checkpoint")
    time.sleep(moment)
    workers = _workers(out)
    pid = {"launcher": proc.pid, "rank0": workers.get(0), "rank1": workers.get(1)}[target]
    if pid is None:
        proc.wait()
        return "run ended before the signal (moment too late)"
    sent = time.monotonic()
    os.kill(pid, signum)
    proc.communicate(timeout=120)
    took = time.monotonic() - sent
    problems = []
    if proc.returncode != 128 + signum:
        problems.append(f"exit {proc.returncode}")
    if _workers(out):
        time.sleep(5)
        if _workers(out):
            problems.append("ranks still running")
    saved, rng1 = _step(out / "ckpt.pt"), _step(out / "ckpt.rng1.pt")
    steps = json.loads((out / "report.json").read_text())["steps"]
    if not saved == rng1 == steps:
        problems.append(f"checkpoint {saved}, rank 1 RNG {rng1}, report {steps}")
    resumed = _start(out, "--resume")
    if resumed.wait(timeout=300) != 0:
        problems.append(f"resume exit {resumed.returncode}")
    ours, theirs = _weights(out / "ckpt.pt"), _weights(reference / "ckpt.pt")
    worst = max(
        float((ours[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in theirs.items()
    )
    if worst > 1e-5:
        problems.append(f"weights differ (relative {worst:.1e})")
    status = "ok" if not problems else "FAIL: " + "; ".join(problems)
    return f"stopped at step {saved}, all exited {took:.1f} s after the signal: {status}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moments", type=int, default=3, help="seeded moments per target")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="evendp-sweep-"))
    reference = root / "straight"
    if _start(reference).wait(timeout=300) != 0:
        print("the uninterrupted run failed")
        return 1
    failures = 0
    for i in range(args.moments):
        for target, signum in TARGETS:
            moment = rng.uniform(0.0, 1.5)
            out = root / f"case{i}-{target}-{signum}"
            line = _case(out, target, int(signum), moment, reference)
            failures += "FAIL" in line
            print(f"{target:8} {signal.Signals(signum).name:7} +{moment:.2f} s: {line}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    print(f"{args.moments * len(TARGETS)} cases, {failures} failed (torch {torch.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

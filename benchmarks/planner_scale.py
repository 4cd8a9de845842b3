"""How the planner's time grows with the device count: 8, 1,000 and 1,000,000 devices.

Each row plans the same model for N copies of one card (``"Nx1GiB"``) and for a mix of three
cards in thirds (``1GiB``, ``512MiB``, ``256MiB``), DP and DDP, and reports the wall time of
``evendp.plan``, the solver's calls of the cost model (``MemoryModel.peak``) and the model runs
on fake tensors (``measure_replica``). Work is per distinct device (budget and role), so the
calls stay flat in N; the time left growing with N is building the per-device ``split`` lists.
The first row (``A/A``) plans 8 devices twice: the spread of two equal runs on this machine.
Main at d8c3d3f took about 38 ms per device (1,000 devices: 38 s), per issue 22.

    PYTHONPATH=src python benchmarks/planner_scale.py          # a table
    PYTHONPATH=src python benchmarks/planner_scale.py --json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from torch import nn

from evendp import plan
from evendp._planning import _planner
from evendp._planning._solve import MemoryModel

COUNTS = (8, 1_000, 1_000_000)


def _spec(n: int, mix: bool) -> str:
    if not mix:
        return f"{n}x1GiB"
    third, rest = divmod(n, 3)
    parts = [f"{third + (rest > 0)}x1GiB", f"{third + (rest > 1)}x512MiB", f"{third}x256MiB"]
    return ",".join(p for p in parts if not p.startswith("0x"))


def _counted(fn: Any, calls: list[int]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def run(n: int, mix: bool, mode: str) -> dict[str, Any]:
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    peaks, measures = [0], [0]
    peak, measure = MemoryModel.peak, _planner.measure_replica
    MemoryModel.peak = _counted(peak, peaks)  # type: ignore[method-assign]
    _planner.measure_replica = _counted(measure, measures)
    try:
        start = time.perf_counter()
        result = plan(net, torch.randn(1, 64), _spec(n, mix), mode=mode, cuda_context=0)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
    finally:
        MemoryModel.peak = peak  # type: ignore[method-assign]
        _planner.measure_replica = measure
    return {
        "devices": n,
        "spec": "mix of 3" if mix else "one card",
        "mode": mode,
        "seconds": seconds,
        "peak_calls": peaks[0],
        "model_runs": measures[0],
        "global_batch": result.global_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(8, False, "dp")  # warm-up: imports, fake-tensor mode's first use
    rows = [{**run(8, False, "dp"), "spec": "A/A: one card"}]
    rows += [run(n, mix, mode) for mode in ("dp", "ddp") for mix in (False, True) for n in COUNTS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'devices':>9} {'spec':<14} {'mode':<4} {'seconds':>8} {'peak calls':>10} {'runs':>5}")
    for r in rows:
        print(
            f"{r['devices']:>9} {r['spec']:<14} {r['mode']:<4} {r['seconds']:>8.3f} "
            f"{r['peak_calls']:>10} {r['model_runs']:>5}"
        )


if __name__ == "__main__":
    main()

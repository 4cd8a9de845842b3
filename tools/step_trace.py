"""Count what one steady training step of ``evendp.Trainer`` calls inside evendp (issue 52).

One gloo rank in this process, ``strategy="ddp"`` (the OOM-safe default), a tiny MLP: the
profile hook (``sys.setprofile``) is on from the end of step 3 to the end of step 4, so it sees
one whole steady step and the loop around it. It prints the calls into evendp's own files, the
distinct functions, the files, and how often consecutive calls change file:

    PYTHONPATH=src python tools/step_trace.py [--strategy ddp] [--list]

Issue 52's figures on main 15dd415: 202 calls, 106 distinct functions, 22 files, 90 changes.
Before issue 52 item 1 (train_step): 191 calls, 103 distinct functions, 24 files, 85 changes;
after: 67 calls, 50 distinct functions, 9 files, 23 changes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

import evendp

PACKAGE = Path(evendp.__file__).resolve().parent
TRACED_STEP = 3  # the hook turns on after this step and off after the next


class StepTrace:
    """A Trainer callback that records evendp's calls during one steady step."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (file relative to the package, qualname)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            self.calls.append((str(path.relative_to(PACKAGE)), frame.f_code.co_qualname))

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == TRACED_STEP:
            sys.setprofile(self._hook)
        elif step == TRACED_STEP + 1:
            sys.setprofile(None)


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator)
    )


def trace(strategy: str) -> StepTrace:
    """Train five steps on one gloo rank and return the trace of step 4."""
    recorder = StepTrace()
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1
        )
        try:
            layers = (torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
            model = torch.nn.Sequential(*layers)
            config = evendp.TrainConfig(
                steps=TRACED_STEP + 2, batch_size=8, strategy=strategy, progress=False
            )

            def loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
                return torch.nn.functional.mse_loss(module(batch[0]), batch[1])

            evendp.Trainer(model, _data(), config, loss_fn=loss, callbacks=[recorder]).fit()
        finally:
            dist.destroy_process_group()
    return recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--list", action="store_true", help="print every distinct function")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    calls = trace(args.strategy).calls
    files = [file for file, _ in calls]
    changes = sum(1 for a, b in itertools.pairwise(files) if a != b)
    distinct = Counter(calls)
    print(
        f"one steady {args.strategy} step: {len(calls)} calls, {len(distinct)} distinct "
        f"functions, {len(set(files))} files, {changes} changes of file"
    )
    if args.list:
        for (file, name), count in sorted(distinct.items()):
            print(f"{count:4d}  {file}:{name}")


if __name__ == "__main__":
    main()

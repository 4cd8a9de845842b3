"""The one-process demo's checks: an even split tried on budgeted devices and the split
gradient compared with one device's before training; planned figures in the report after."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import torch

from .._core._errors import EvendpError
from .._core._oom_errors import is_oom_error
from .._core._split import split_even

__all__ = ["BUDGET_NOTE", "format_memory", "run_checks", "with_figures"]

Figures = dict[str, Any]  # DeviceStat fields by name


def run_checks(args: argparse.Namespace, trainer: Any, budgets: Any) -> Any:
    """Before training: the even-split probe (per device: even share, measured forward peak,
    ran out; ``None`` without budgets) and the exactness check, then the peaks reset."""
    from .._training._rehearse import probe_even_split

    trainer.sampler.set_epoch(0)  # the first batch exactly as fit will draw it
    first = trainer.collate(list(next(iter(trainer.sampler))))
    even = None
    if budgets is not None:
        even, line = probe_even_split(trainer, budgets, first)
        print(f"evendp train: {line}")
    if args.amp == "none" and not (args.resume or args.resume_or_start):
        _print_exactness_check(trainer, first)
    if budgets is not None:
        budgets.reset_peaks()
    return even


def with_figures(
    args: argparse.Namespace,
    config: Any,
    devices: list[Any],
    memory: list[int] | None,
    even: Any,
    planned: Any,
) -> list[Any]:
    """The report's ``DeviceStat``s with the budgets, the even probe and the planned peaks."""
    figures: list[Figures] = [{} for _ in devices]
    for i, f in enumerate(figures):
        if memory is not None:
            f["budget_bytes"] = memory[i]
        if even is not None:
            f["even_samples"], f["even_forward_peak_bytes"], f["even_oom"] = even[i]
    ours = [round(d.samples_per_step) for d in devices]
    for f, p in zip(figures, _planned_figures(args, config, ours, planned), strict=True):
        f.update(p)
    return [replace(d, **f) for d, f in zip(devices, figures, strict=True)]


def _planned_figures(
    args: argparse.Namespace, config: Any, ours: list[int], planned: Any
) -> list[Figures]:
    """Planned peaks for our shares and an even split (from the plan when it priced them)."""
    even_shares = split_even(args.batch, len(ours))
    if planned is not None and planned.split == ours and planned.even_split == even_shares:
        return [
            {
                "planned_bytes": p.peak,
                "even_planned_bytes": p.even_peak,
                "even_samples": p.even_samples,
            }
            for p in planned.devices
        ]
    if args.no_plan:
        return [{} for _ in ours]
    try:
        mine, theirs = _planned_peaks(config, args, ours)
    except EvendpError as exc:  # the report is still useful without planned figures
        print(f"evendp train: planned memory unavailable: {exc}", file=sys.stderr)
        return [{} for _ in ours]
    return [
        {"planned_bytes": a, "even_planned_bytes": b, "even_samples": n}
        for a, b, n in zip(mine, theirs, even_shares, strict=True)
    ]


def _planned_peaks(config: Any, args: argparse.Namespace, ours: list[int]) -> tuple[Any, Any]:
    """Planned peak per device, for our shares and for an even split (``profile_step``, not
    ``evendp.plan``: the shares may come from ``--weights``)."""
    from .._planning._plan import profile_step
    from ..examples.gpt import GPT
    from ._model_spec import gpt_batch

    even = split_even(args.batch, len(ours))
    sizes = sorted({n for n in [*ours, *even] if n > 0})
    prof = profile_step(
        lambda: GPT(config),
        gpt_batch(config),
        sizes,
        amp=args.amp,
        checkpointing=args.checkpointing,
    )
    peak = dict(zip(prof["sizes"], prof["peak_bytes"], strict=True))
    # Device 0 also holds the optimizer state (DP keeps one optimizer, on the home device).
    extra = [int(prof["optimizer"]) if i == 0 else 0 for i in range(len(ours))]
    mine = [int(peak.get(n, 0)) + extra[i] for i, n in enumerate(ours)]
    theirs = [int(peak.get(n, 0)) + extra[i] for i, n in enumerate(even)]
    return mine, theirs


def _print_exactness_check(trainer: Any, batch: Any) -> None:
    try:
        diff, count = _gradient_difference(trainer, batch)
    except (RuntimeError, ValueError) as exc:
        if not is_oom_error(exc):
            raise
        # The whole batch may not fit one device: that is why it is split.
        trainer.optimizer.zero_grad(set_to_none=True)
        print("evendp train: exactness check skipped: the whole batch does not fit one device")
        return
    print(
        f"evendp train: exactness check on the first (shuffled) batch: gradient over the split "
        f"{trainer.wrapped.last_sizes} vs one device on all {len(batch[0])} samples "
        f"({count} real characters, padding ignored): relative difference {diff:.1e}",
        flush=True,
    )


def _gradient_difference(trainer: Any, batch: Any) -> tuple[float, int]:
    """``||g_balanced - g_one|| / ||g_one||`` on a batch, the run's split against the model's
    own loss on the home device; the gradients are cleared again afterwards."""
    from .._parallel._scatter import map_tensors
    from ..examples.stdlib_text import CodeParagraphs

    home = trainer.wrapped.device_ids[0]
    batch = map_tensors(batch, lambda t: t.to(home))
    count = int(CodeParagraphs.count_tokens(batch))
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def gradient(loss: Any) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss().backward()
        return torch.cat([p.grad.flatten() for p in params if p.grad is not None])

    # The Trainer's own split loss: the mean over every real character of the batch.
    # A check of the arithmetic, not of memory: the budgets (if any) stay out of it.
    hook = trainer.wrapped.replica_context
    trainer.wrapped.set_replica_context(None)
    try:
        balanced = gradient(lambda: trainer.batch_loss(batch))
    finally:
        trainer.wrapped.set_replica_context(hook)
    one_device = gradient(lambda: trainer.model(*batch)[1])
    for p in params:
        p.grad = None
    return float((balanced - one_device).norm() / one_device.norm()), count


BUDGET_NOTE = (
    "Budgets on CPU virtual devices count each replica's forward allocations (activations "
    "kept for backward, temporaries, outputs) plus its parameters, and on the first device "
    "the gradients and optimizer state; backward's transient allocations run in the autograd "
    "engine's thread and are not counted (measured = forward peak; planned = the planner's "
    "forward+backward peak)."
)


def format_memory(memory: list[int]) -> str:
    from .._training._report import format_bytes

    return ",".join(format_bytes(m).replace(" ", "") for m in memory)

"""``evendp train --mode dp``: one process, ``BalancedDataParallel`` over the devices, with the
demo's checks: an even split tried on budgeted devices and the split gradient compared with one
device's before training, planned figures in the report after."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import torch

from .._core._errors import EvendpError
from .._core._oom_errors import is_oom_error
from .._core._split import split_even
from ._train_args import (
    DEMO_MEMORY,
    all_cpu,
    device_memory,
    parse_devices,
    parse_weights,
    train_config,
)
from ._train_common import (
    BUDGET_NOTE,
    build_demo,
    demo_model_name,
    metric_logger,
    print_report,
    share_cpu_threads,
)

__all__ = ["run_local"]


def run_local(args: argparse.Namespace) -> int:
    """Train in this process and write the report; the exit code (130/143 after a signal)."""
    from .._distributed._interrupt import exit_code
    from .._training._rehearse import attach_budgets
    from .._training._trainer import Trainer
    from ..examples.stdlib_text import CodeParagraphs

    if args.model is not None:  # the user's own model: a rehearsal on budgeted CPU devices
        from ._train_user import run_user_model

        return run_user_model(args)
    devices = parse_devices(args.devices)
    memory = device_memory(args, devices)
    weights = parse_weights(args.weights, devices)
    share_cpu_threads(devices)
    model, data, config = build_demo(args)
    planned, weights = _split(args, config, devices, memory, weights)
    logger = metric_logger(args)
    home = devices[0]
    model = model.to(torch.device("cuda", home) if isinstance(home, int) else torch.device(home))
    trainer: Any = Trainer(  # its strategy's wrapped module: BalancedDataParallel here
        model, data, train_config(args, every_step=logger is not None), device_ids=list(devices),
        weights=weights, count_fn=CodeParagraphs.count_tokens,
        callbacks=None if logger is None else [logger[0]],
    )  # fmt: skip
    budgets = attach_budgets(trainer, memory) if memory is not None and all_cpu(devices) else None
    print(
        f"evendp train: {len(devices)} device(s) {trainer.device_names}, global batch "
        f"{args.batch}, samples per device per step {trainer.wrapped.split(args.batch)}"
        + _split_source(args, memory, planned),
        flush=True,
    )
    even = run_checks(args, trainer, budgets)
    report = trainer.fit()
    report.model = demo_model_name(args)
    report.devices = with_figures(args, config, report.devices, memory, even, planned)
    print_report(report, args.out, logger)
    if budgets is not None:
        print(BUDGET_NOTE)
    from ._train_ddp import say_how_to_resume

    return say_how_to_resume(exit_code(report.signal), args.argv)


def _split(
    args: argparse.Namespace,
    config: Any,
    devices: list[str | int],
    memory: list[int] | None,
    weights: list[float] | None,
) -> tuple[Any, list[float] | None]:
    """(the plan when the planner chose the split, else ``None``; the split weights)."""
    if args.weights is None and memory is not None:
        # The split that fits the memory; a CPU has no CUDA context to allow for.
        planned = _planner_weights(config, args, memory, cpu=all_cpu(devices))
        return planned, [float(n) for n in planned.split]
    on_gpus = all(isinstance(d, int) for d in devices)
    if args.devices is None and args.weights is None and len(devices) > 1 and on_gpus:
        # All GPUs, no weights given: the planner's split (device 0 also holds the optimizer
        # and the gathered outputs), else free memory when the planner cannot place the batch.
        try:
            return None, [float(n) for n in _planner_weights(config, args).split]
        except EvendpError as exc:
            print(f"evendp train: planner split unavailable ({exc}); using free memory")
    return None, weights


def _split_source(args: argparse.Namespace, memory: list[int] | None, planned: Any) -> str:
    """Where the split came from, in the words the user typed (or the demo's defaults).

    >>> ns = argparse.Namespace(weights="3,1", memory=None)
    >>> _split_source(ns, [2**20, 2**20], None)
    ' (--weights 3,1, on budgets of 1.0MiB,1.0MiB)'
    """
    from .._training._report import format_bytes

    budgets = "" if memory is None else ",".join(format_bytes(m).replace(" ", "") for m in memory)
    given = f"the demo's budgets {budgets}" if args.memory is None else f"--memory {args.memory}"
    if args.weights is not None:
        on = "" if memory is None else f", on budgets of {budgets}"
        return f" (--weights {args.weights}{on})"
    if planned is not None:
        return f" (the planner's split for {given})"
    return ""


def _planner_weights(
    config: Any, args: argparse.Namespace, spec: str | list[int] | None = None, cpu: bool = False
) -> Any:
    """The planner's :class:`Plan` for ``args.batch`` (``spec=None``: the live GPUs; ``cpu``:
    no CUDA context to allow for)."""
    from .._core._errors import PlanError
    from .._planning._planner import plan
    from ..examples.gpt import GPT
    from ._model_spec import gpt_batch

    options: dict[str, Any] = {"cuda_context": 0} if cpu else {}
    try:
        p = plan(
            lambda: GPT(config), gpt_batch(config), spec, mode="dp", batch_size=args.batch,
            amp=args.amp, checkpointing=args.checkpointing, **options,
        )  # fmt: skip
    except PlanError as exc:
        if not isinstance(spec, list):
            raise
        given = f"--memory {args.memory or DEMO_MEMORY}"
        given += "" if args.memory else " (the demo's budgets)"
        raise EvendpError(
            f"--batch {args.batch} on {given}: {exc} (or shrink the model: --n-layer, "
            "--n-embd, --block-size; or raise --memory)"
        ) from None
    return p


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
    figures: list[dict[str, Any]] = [{} for _ in devices]  # DeviceStat fields by name
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
) -> list[dict[str, Any]]:
    """Planned peaks for our shares and an even split (from the plan when it priced them; else
    ``profile_step``, not ``evendp.plan``: the shares may come from ``--weights``)."""
    from .._planning._measure import profile_step
    from ..examples.gpt import GPT
    from ._model_spec import gpt_batch

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
        prof = profile_step(
            lambda: GPT(config),
            gpt_batch(config),
            sorted({n for n in [*ours, *even_shares] if n > 0}),
            amp=args.amp,
            checkpointing=args.checkpointing,
        )
    except EvendpError as exc:  # the report is still useful without planned figures
        print(f"evendp train: planned memory unavailable: {exc}", file=sys.stderr)
        return [{} for _ in ours]
    peak = dict(zip(prof["sizes"], prof["peak_bytes"], strict=True))
    # Device 0 also holds the optimizer state (DP keeps one optimizer, on the home device).
    extra = [int(prof["optimizer"]) if i == 0 else 0 for i in range(len(ours))]
    return [
        {
            "planned_bytes": int(peak.get(a, 0)) + x,
            "even_planned_bytes": int(peak.get(b, 0)) + x,
            "even_samples": b,
        }
        for a, b, x in zip(ours, even_shares, extra, strict=True)
    ]


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

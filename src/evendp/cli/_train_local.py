"""``evendp train --mode dp``: one process, ``BalancedDataParallel`` over the devices."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .._core._errors import EvendpError
from ._demo import BUDGET_NOTE, format_memory, run_checks, with_figures
from ._train_args import (
    DEMO_MEMORY,
    all_cpu,
    device_memory,
    parse_devices,
    parse_weights,
    train_config,
)
from ._train_common import (
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
    from .._training._report import write_report

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
    trainer = _trainer(args, model, data, devices, weights, logger)
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
    paths = write_report(report, args.out)
    if logger is not None:
        paths["metrics"] = logger[1]
    print_report(report, paths)
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


def _trainer(
    args: argparse.Namespace,
    model: Any,
    data: Any,
    devices: list[str | int],
    weights: list[float] | None,
    logger: tuple[Any, Any] | None = None,
) -> Any:
    from .._training._trainer import Trainer
    from ..examples.stdlib_text import CodeParagraphs

    home = devices[0]
    model = model.to(torch.device("cuda", home) if isinstance(home, int) else torch.device(home))
    cfg = train_config(args, every_step=logger is not None)
    return Trainer(
        model, data, cfg, device_ids=list(devices), weights=weights,
        count_fn=CodeParagraphs.count_tokens, callbacks=None if logger is None else [logger[0]],
    )  # fmt: skip


def _split_source(args: argparse.Namespace, memory: list[int] | None, planned: Any) -> str:
    """Where the split came from, in the words the user typed (or the demo's defaults).

    >>> ns = argparse.Namespace(weights="3,1", memory=None)
    >>> _split_source(ns, [2**20, 2**20], None)
    ' (--weights 3,1, on budgets of 1.0MiB,1.0MiB)'
    """
    budgets = "" if memory is None else format_memory(memory)
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
    from .._planning._plan import plan
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

"""``evendp train --model module:factory --memory ...``: the user's ``(model, dataset[,
loss_fn])`` rehearsed on CPU virtual devices that enforce the memory (:func:`evendp.rehearse`)."""

from __future__ import annotations

import argparse
from typing import Any

from .._core._errors import EvendpError
from ._model_spec import load_module, memory_specs, raised_at
from ._train_args import parse_devices, parse_weights, train_config
from ._train_common import BUDGET_NOTE, metric_logger, print_report

__all__ = ["run_user_model"]


def run_user_model(args: argparse.Namespace) -> int:
    """Rehearse the user's model and write the report; the exit code."""
    from .._distributed._interrupt import exit_code
    from .._training._rehearse import rehearse
    from .._training._trainer import default_loss
    from ._train_common import share_cpu_threads
    from ._train_ddp import say_how_to_resume

    if args.memory is None:
        raise EvendpError(
            f"--model {args.model!r} rehearses on CPU virtual devices with memory budgets; "
            "give one per device, e.g. --memory 24MiB,12MiB"
        )
    memory = [m.free for m in memory_specs(args.memory)]
    devices = _devices(args, len(memory))
    weights = parse_weights(args.weights, devices)
    share_cpu_threads(devices)
    model, data, loss_fn = load_training_factory(args.model)
    if args.batch > len(data):
        raise EvendpError(
            f"--batch {args.batch} is more than the {len(data)} samples of --model "
            f"{args.model!r}'s dataset; lower --batch"
        )
    logger = metric_logger(args)
    cfg = train_config(args, every_step=logger is not None)
    report = rehearse(
        model, data, cfg, memory=memory, weights="auto" if weights is None else weights,
        loss_fn=loss_fn or default_loss, callbacks=None if logger is None else [logger[0]],
        say=lambda line: print(f"evendp train: {line}", flush=True),
    )  # fmt: skip
    report.model = args.model
    print_report(report, args.out, logger)  # with the model's name in the title
    print(BUDGET_NOTE)
    return say_how_to_resume(exit_code(report.signal), args.argv)


def _devices(args: argparse.Namespace, count: int) -> list[str | int]:
    """One CPU virtual device per --memory entry, or --devices (all cpu, one per entry)."""
    if args.devices is None:
        return ["cpu"] * count
    devices = parse_devices(args.devices, check_gpus=False)
    if any(d != "cpu" for d in devices):
        raise EvendpError(
            f"--model rehearses on CPU virtual devices, but --devices {args.devices!r} names "
            "a GPU; drop --devices (one cpu per --memory entry), or train on GPUs with "
            "evendp.Trainer(device_ids=...) in Python"
        )
    if len(devices) != count:
        raise EvendpError(
            f"--devices {args.devices!r} has {len(devices)} devices but --memory "
            f"{args.memory!r} {count} budgets; give one budget per device"
        )
    return devices


def load_training_factory(spec: str) -> tuple[Any, Any, Any]:
    """``(model, dataset, loss_fn or None)`` from ``module:factory`` or ``file.py:factory``."""
    import torch

    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise EvendpError(
            f"--model {spec!r} is not 'package.module:factory' or 'path/file.py:factory'; "
            "e.g. --model mymodels:make, where make() returns (model, dataset)"
        )
    try:
        module = load_module(spec, target)
    except ImportError as exc:
        raise EvendpError(
            f"cannot load --model {spec!r}: {exc}; give an importable module (package.module, "
            "run from the folder that holds it) or a path ending in .py"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EvendpError(f"--model {spec!r}: {target} has no function {attr!r}; check the name")
    try:
        made = factory()
    except Exception as exc:  # the user's factory can raise anything
        raise EvendpError(
            f"--model {spec!r}: {attr}() failed{raised_at(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    ok = (
        isinstance(made, tuple)
        and len(made) in (2, 3)
        and isinstance(made[0], torch.nn.Module)
        and hasattr(made[1], "__len__")
        and hasattr(made[1], "__getitem__")
        and (len(made) == 2 or callable(made[2]))
    )
    if not ok:
        got = type(made).__name__ + (f" of {len(made)}" if isinstance(made, tuple) else "")
        other = ""
        if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[1]):
            other = "; (model, batch_fn), what it returned, is what plan and launch --model take"
        raise EvendpError(
            f"--model {spec!r}: {attr}() returned a {got}; evendp train needs (model, dataset) "
            f"or (model, dataset, loss_fn), the dataset map-style (len and [i]){other}"
        )
    return made[0], made[1], made[2] if len(made) == 3 else None

"""``evendp plan``: what every device will hold for a step, and the split that fills them.

Runs on any machine (no GPU needed): the model runs on fake tensors. Exit code 2 on bad input
(an unreadable device spec, a model factory that fails, a batch that fits nowhere).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .._errors import EvendpError
from .._plan import plan

_AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer] | None] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "none": None,
}


def add_parser(subparsers: Any) -> None:
    """Register ``evendp plan``."""
    p = subparsers.add_parser(
        "plan",
        help="predict per-device memory and choose the split (no GPU needed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="gpt",
        help="'gpt' (the demo char GPT), 'lm-head', or 'package.module:factory' where "
        "factory() returns (model, batch_fn) or (model, batch_fn, criterion), or a model "
        "with an example_batch(n) method (default: gpt)",
    )
    p.add_argument("--vocab", type=int, default=40_000, help="lm-head vocabulary size")
    p.add_argument("--seq-len", type=int, default=None, help="lm-head / gpt sequence length")
    p.add_argument(
        "--devices",
        default=None,
        help="free memory per device, e.g. '24GiB,24GiB-10GiB,2x12GiB' (TOTAL-USED means "
        "another job holds USED); default: the live GPUs",
    )
    p.add_argument("--mode", choices=("dp", "ddp"), default="dp")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: largest)")
    p.add_argument("--optimizer", choices=sorted(_OPTIMIZERS), default="adamw")
    p.add_argument("--amp", choices=sorted(_AMP), default="none")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each block")
    p.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view")
    p.add_argument("--margin", type=float, default=0.05, help="safety margin (default 0.05)")
    p.add_argument("--context", default="512MiB", help="CUDA context allowance per device")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write a stacked bar chart")
    p.set_defaults(func=run)


def _builtin(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Any, Any]:
    if args.model == "gpt":
        from ..examples.gpt import GPT, GPTConfig

        config = GPTConfig() if args.seq_len is None else GPTConfig(block_size=args.seq_len)

        def gpt_batch(n: int) -> Any:
            shape = (n, config.block_size)
            return torch.randint(0, config.vocab_size, shape), torch.randint(0, 2, shape)

        return lambda: GPT(config), gpt_batch, None
    from ..examples.lm_head import LMHead, lm_loss

    seq = 250 if args.seq_len is None else args.seq_len
    if args.vocab <= 0 or seq <= 0:
        raise EvendpError(f"--vocab and --seq-len must be positive, got {args.vocab}, {seq}")

    def lm_batch(n: int) -> Any:
        return torch.randint(0, args.vocab, (n, seq)), torch.randint(0, args.vocab, (n, seq))

    return lambda: LMHead(args.vocab, seq), lm_batch, lm_loss


def _user(spec: str) -> tuple[Callable[[], nn.Module], Any, Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EvendpError(
            f"--model {spec!r} is not 'gpt', 'lm-head' or 'package.module:factory'; "
            "e.g. --model mypkg.models:make_model"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EvendpError(f"cannot load --model {spec!r}: {exc}") from exc
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():  # a probe: find out what the factory returns, on fake memory
            made = factory()
    except Exception as exc:  # the user's factory can raise anything
        raise EvendpError(
            f"the model factory {spec!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(made, nn.Module):
        if not hasattr(made, "example_batch"):
            raise EvendpError(
                f"{spec!r} returned a model without example_batch(n); return "
                "(model, batch_fn) or (model, batch_fn, criterion) instead"
            )
        return factory, lambda n: factory_batch(factory, n), None
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        criterion = made[2] if len(made) == 3 else None
        return lambda: factory()[0], made[1], criterion
    raise EvendpError(
        f"{spec!r} returned {type(made).__name__}; expected an nn.Module with example_batch(n), "
        "(model, batch_fn) or (model, batch_fn, criterion)"
    )


def factory_batch(factory: Callable[[], Any], n: int) -> Any:
    """The batch of ``n`` samples from a model's own ``example_batch`` (under fake mode)."""
    return factory().example_batch(n)


def run(args: argparse.Namespace) -> int:
    """Plan and print; 2 on bad input."""
    try:
        if args.model in ("gpt", "lm-head"):
            make, batch, criterion = _builtin(args)
        else:
            make, batch, criterion = _user(args.model)
        result = plan(
            make,
            batch,
            args.devices,
            mode=args.mode,
            criterion=criterion,
            optimizer=_OPTIMIZERS[args.optimizer],
            batch_size=args.batch,
            amp=_AMP[args.amp],
            checkpointing=args.checkpointing,
            gradient_as_bucket_view=args.bucket_view,
            safety_margin=args.margin,
            cuda_context=args.context,
        )
    except EvendpError as exc:
        print(f"evendp plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(result.table())
    if args.plot:
        result.plot(args.plot)
    return 0

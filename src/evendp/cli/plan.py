"""``evendp plan``: what every device will hold for a step, and the split that fills them.

Runs on any machine (no GPU needed): the model runs on fake tensors. Exit code 2 on bad input
(an unreadable device spec, a model factory that fails, a batch that fits nowhere).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from .._core._errors import EvendpError
from .._planning._solve import Mode
from ._args import add_int, memory_text, say_error, say_units
from ._model_spec import add_model_arguments, memory_specs, plan_options, resolve_model


def add_parser(subparsers: Any) -> None:
    """Register ``evendp plan``."""
    p = subparsers.add_parser(
        "plan",
        renamed={"--devices": "--memory"},
        help="predict per-device memory and choose the split (no GPU needed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p, default="gpt")
    p.add_argument(
        "--memory",
        default=None,
        type=memory_text("--memory"),
        help="free memory per device, e.g. '24GiB,24GiB-10GiB,2x12GiB' (TOTAL-USED means "
        "another job holds USED); default: the live GPUs",
    )
    p.add_argument(
        "--mode",
        choices=get_args(Mode),  # the modes the planner models, from the planner
        default="dp",
        help="dp: one process (device 0 holds the optimizer and the gathered outputs); "
        "ddp: one process per device (default dp)",
    )
    fits = "global batch (default: the largest that fits)"
    add_int(p, "--batch", (1, 1_000_000_000, 64), None, fits)
    p.add_argument(
        "--no-grad",
        action="store_true",
        help="plan a forward only (inference, evaluation, feature extraction): no gradients, "
        "optimizer state or saved activations; training's largest batch is shown beside it",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write a stacked bar chart")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan and print; 2 on bad input."""
    try:
        say_units("evendp plan", "--memory", args.memory)
        if args.plot:  # before planning: the picture must be writable
            from ._run_folder import check_out_file

            check_out_file("--plot", args.plot)
        from .._planning._planner import plan  # torch: after the arguments are checked

        spec = resolve_model(args.model, vocab=args.vocab, seq_len=args.seq_len)
        result = plan(
            spec.make,
            spec.batch,
            memory_specs(args.memory),
            mode=args.mode,
            criterion=spec.criterion,
            batch_size=args.batch,
            no_grad=args.no_grad,
            **plan_options(args),
        )
    except EvendpError as exc:
        say_error("evendp plan", exc)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(result.table())
    if args.plot:
        result.plot(args.plot)
    return 0

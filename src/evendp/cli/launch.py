"""``evendp launch``: pick devices and per-rank batch sizes, then run the script with torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .._core import _defaults as defaults
from .._core._errors import EvendpError
from .._core._validate import shown
from .._distributed._first_step import ENV_LAUNCH_OPTIONS, ENV_STRICT
from .._distributed._launch_notes import ENV_BATCH_DEFAULTED
from .._planning._launch import (
    PASSTHROUGH_OPTIONS,
    launch,
    plan_launch,
    torchrun_command,
    validate_passed_numbers,
)
from ._args import add_int, memory_text, say_error, say_units
from ._model_spec import add_model_arguments, plan_options, resolve_model

__all__ = ["add_parser", "run"]


def _gpu_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpus {shown(text)}: write physical GPU ids separated by commas, e.g. 2,3"
        ) from None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``evendp launch``."""
    parser = subparsers.add_parser(
        "launch",
        renamed={"--devices": "--gpus"},
        help="run a script under torchrun with per-rank batch sizes (EVENDP_BATCH_SIZES)",
        description=(
            "Choose GPUs (freest first, or --gpus), compute each rank's batch size "
            "(--batch-sizes; or with --model, the memory planner's DDP split of --batch, or "
            "of the largest batch that fits; or --batch split by free memory, evenly on CPU), "
            "export them as EVENDP_BATCH_SIZES (with, when planned, each rank's memory cap: "
            "'3,5;caps=48,24') and run SCRIPT with python -m torch.distributed.run. "
            "With no NVIDIA driver the ranks are CPU processes (use gloo); --memory declares "
            "each rank's memory there."
        ),
    )
    parser.add_argument(
        "--nproc", default="auto", help="ranks per node: an int or 'auto' (default auto)"
    )
    split = (
        f"global batch, split across ranks for you (default {defaults.BATCH} when no "
        "--batch-sizes or --model is given; with --batch-sizes, their sum)"
    )
    add_int(parser, "--batch", (1, 1_000_000_000, 64), None, split)
    parser.add_argument("--batch-sizes", help="per-rank batch sizes for all ranks, e.g. 3,5")
    parser.add_argument(
        "--gpus", type=_gpu_list, help="physical GPU ids (nvidia-smi order), e.g. 2,3"
    )
    parser.add_argument("--min-free", help="skip GPUs with less free memory, e.g. 8GiB")
    parser.add_argument(
        "--memory",
        type=memory_text("--memory"),
        help="each rank's memory instead of the GPUs' live free memory, e.g. "
        "'24GiB,24GiB-10GiB,12GiB' (one entry per rank; needed for --model on CPU)",
    )
    planning = parser.add_argument_group(
        "memory planner (with --model: per-rank sizes and caps from evendp plan --mode ddp)"
    )
    add_model_arguments(planning, default=None)
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and command, start nothing"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="a script that takes its first optimizer step without reading the batch sizes "
        "is an error (exit 2), not a warning",
    )
    group = parser.add_argument_group("torchrun options passed through unchanged")
    for key in PASSTHROUGH_OPTIONS:
        flag = "--" + key.replace("_", "-")
        group.add_argument(flag, dest=key, default=None, help=f"torchrun's {flag}")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan, print the plan, and run torchrun (exit code 2 for bad input)."""
    passthrough = {key: getattr(args, key) for key in PASSTHROUGH_OPTIONS}
    try:
        validate_passed_numbers(passthrough)
        if not args.dry_run:
            _validate_script(args.script)
        sizes = _validate_texts(args)
        if args.min_free is not None and _no_gpus(args.gpus):
            raise EvendpError(
                f"--min-free {args.min_free} picks GPUs by their free memory, but no NVIDIA "
                "driver was found here (CPU ranks); drop --min-free"
            )
        for flag in ("--memory", "--min-free"):
            say_units("evendp launch", flag, getattr(args, flag[2:].replace("-", "_")))
        batch = args.batch
        if batch is None and args.batch_sizes is None and args.model is None:
            batch = defaults.BATCH  # TrainConfig's and evendp train's
            how = "evenly (CPU ranks)" if _no_gpus(args.gpus) else "by each GPU's free memory"
            print(
                f"evendp launch: no --batch, --batch-sizes or --model: global batch "
                f"{batch} (the default), split {how}",
                file=sys.stderr,
            )
        model = example = options = None
        if args.model is not None:
            spec = resolve_model(args.model, vocab=args.vocab, seq_len=args.seq_len)
            model, example = spec.make, spec.batch
            options = {**plan_options(args), "criterion": spec.criterion}
        plan = plan_launch(
            nproc=args.nproc,
            batch=batch,
            batch_sizes=sizes,
            gpu_ids=args.gpus,
            min_free=args.min_free,
            nnodes=args.nnodes,
            model=model,
            example_batch=example,
            memory=args.memory,
            plan_options=options,
        )
        print(plan.describe(), file=sys.stderr, flush=True)
        if plan.memory_plan is not None:  # what each rank will hold, for the person launching
            from rich.console import Console

            Console(stderr=True).print(plan.memory_plan.table())
        if args.dry_run:
            for key, value in plan.env.items():
                print(f"{key}={value}")
            print(" ".join(torchrun_command(plan, args.script, args.script_args, passthrough)))
            return 0
        env = {**os.environ, ENV_STRICT: "1"} if args.strict else None
        if batch == defaults.BATCH and args.batch is None:  # a script's own sizes win
            env = {**(env or os.environ), ENV_BATCH_DEFAULTED: "1"}
        if str(args.nnodes or 1) != "1":  # several machines: their ranks compare these
            env = {**(env or os.environ), ENV_LAUNCH_OPTIONS: _shared_options(args, sizes)}
        return launch(args.script, args.script_args, plan=plan, passthrough=passthrough, env=env)
    except EvendpError as exc:
        say_error("evendp launch", exc)
        return 2


#: What every machine of a run must be started with (what the launcher plans from, and what
#: decides how the ranks run); the rest (--node-rank, --nproc, --gpus...) is each machine's.
_SHARED = ("batch", "batch_sizes", "strict", "nnodes", "max_restarts")


def _shared_options(args: argparse.Namespace, sizes: list[int] | None) -> str:
    """The options the ranks of every machine compare (JSON), sizes as read.

    >>> ns = argparse.Namespace(batch=None, batch_sizes=" 1, 3", strict=False, nnodes="2",
    ...                         max_restarts=None)
    >>> _shared_options(ns, [1, 3])
    '{"batch": null, "batch_sizes": "1,3", "strict": false, "nnodes": "2", "max_restarts": null}'
    """
    shared = {key: getattr(args, key) for key in _SHARED}
    if sizes is not None:
        shared["batch_sizes"] = ",".join(map(str, sizes))
    return json.dumps(shared)


def _validate_script(script: str) -> None:
    """A missing script, or one that is not Python (README.md, a shell script), fails here in
    one line, not in every rank after torchrun starts."""
    if not Path(script).is_file():
        raise EvendpError(
            f"script {shown(script)} does not exist (looked in {str(Path.cwd())!r}); give the path "
            "of a Python file, e.g. evendp launch --nproc 2 examples/ddp_uneven.py"
        )
    try:
        compile(Path(script).read_bytes(), script, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        where = f" (line {exc.lineno}: {exc.msg})" if isinstance(exc, SyntaxError) else ""
        raise EvendpError(
            f"script {shown(script)} is not a Python file{where}; give the training script, e.g. "
            "evendp launch --nproc 2 examples/ddp_uneven.py (a program that is not Python: "
            "start it with torchrun --no-python)"
        ) from None


def _no_gpus(gpu_ids: list[int] | None) -> bool:
    from . import has_gpu

    return not gpu_ids and not has_gpu()


def _validate_texts(args: argparse.Namespace) -> list[int] | None:
    """Free-text options, read now so a bad one is named by its flag even where unused; the
    per-rank sizes of ``--batch-sizes`` (read here, once), if given."""
    from .._core._units import parse_bytes
    from .._distributed._batch_plan import parse_batch_sizes
    from .._planning._memory import DEFAULT_CONTEXT, parse_memory

    checks: list[tuple[str, str | None, Callable[[str], object], str]] = [
        ("--batch-sizes", args.batch_sizes, parse_batch_sizes, "3,5"),
        ("--memory", args.memory, parse_memory, "24GiB,24GiB,12GiB"),
        ("--min-free", args.min_free, parse_bytes, "8GiB"),
        ("--context", args.context, parse_bytes, f"{DEFAULT_CONTEXT >> 20}MiB"),
    ]
    read: dict[str, object] = {}
    for flag, text, parse, example in checks:
        if text is None:
            continue
        try:
            read[flag] = parse(text)
        except EvendpError as exc:
            raise EvendpError(f"{flag} {shown(text)}: {exc}; e.g. {flag} {example}") from None
    return read.get("--batch-sizes")  # type: ignore[return-value]

"""What both ``evendp train`` runs share: the model and its data, the printed report, the
metrics file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .._core._errors import EvendpError
from .._core._validate import shown

__all__ = [
    "BUDGET_NOTE",
    "build_demo",
    "demo_model_name",
    "metric_logger",
    "print_report",
    "share_cpu_threads",
]


def build_demo(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model, the variable-length training paragraphs and the GPT config."""
    import torch

    from ..examples.gpt import GPT, GPTConfig
    from ..examples.stdlib_text import stdlib_paragraphs

    train, _val, vocab = stdlib_paragraphs(block_size=args.block_size, max_chars=args.max_chars)
    if args.batch > len(train):
        raise EvendpError(
            f"--batch {args.batch} is more than the {len(train)} paragraphs in "
            f"--max-chars {args.max_chars}; lower --batch or raise --max-chars"
        )
    config = GPTConfig(
        vocab_size=vocab.size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=4,
        n_embd=args.n_embd,
    )
    torch.manual_seed(args.seed)
    return GPT(config), train, config


def demo_model_name(args: argparse.Namespace) -> str:
    size = f"{args.n_layer}x{args.n_embd}"
    return f"char GPT {size} on stdlib paragraphs (<= {args.block_size} chars, padded)"


def print_report(report: Any, out: str, logger: tuple[Any, Path] | None) -> None:
    """Write the report in ``out`` and print it, with where its files are."""
    from rich.console import Console

    from .._training._report import write_report

    paths = write_report(report, out)
    if logger is not None:
        paths["metrics"] = logger[1]

    console = Console()
    if not console.is_terminal:  # a log file or pipe: wide enough for every column
        console = Console(width=130)
    console.print(report.table())
    console.print(report.summary())
    console.print("report: " + ", ".join(str(p) for p in paths.values()))


def metric_logger(args: argparse.Namespace) -> tuple[Any, Path] | None:
    """``--log-to``: the logger (a Trainer callback) and where it writes, or ``None``."""
    from .._training._loggers import CSVLogger, TensorBoardLogger

    out = Path(args.out)
    if args.log_to == "csv":
        return CSVLogger(out / "metrics.csv"), out / "metrics.csv"
    if args.log_to == "tensorboard":
        folder = out / "tensorboard"
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            what = "a link" if folder.is_symlink() else "not a folder"
            raise EvendpError(
                f"--log-to tensorboard: {shown(str(folder))} is {what}; the event files would "
                "go there: remove it if it is yours, or pass another --out"
            )
        return TensorBoardLogger(folder), folder
    return None


def share_cpu_threads(devices: list[str | int]) -> None:
    import torch

    from ._train_args import all_cpu

    if all_cpu(devices) and len(devices) > 1:
        # Virtual devices are threads: one intra-op thread each keeps 2 cores from thrashing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))


BUDGET_NOTE = (
    "Budgets on CPU virtual devices count each replica's forward allocations (activations "
    "kept for backward, temporaries, outputs) plus its parameters, and on the first device "
    "the gradients and optimizer state; backward's transient allocations run in the autograd "
    "engine's thread and are not counted (measured = forward peak; planned = the planner's "
    "forward+backward peak)."
)

"""``evendp train``: train the built-in char-level GPT on the Python standard library's source
(the demo), or rehearse the user's own model (``--model module:factory``) on CPU devices.

The data is variable-length: one paragraph of stdlib code per sample, padded to the longest in
the batch with -100 labels on the padding, and the loss is the exact mean over real
characters however the batch is split (count_fn counts them).

With no arguments it uses every GPU (split by the planner on their free memory), or, with
none, three CPU virtual devices that enforce memory budgets of 48MiB,48MiB,24MiB (the same as
--devices cpu,cpu,cpu --memory 48MiB,48MiB,24MiB): the planner splits the batch to fit them,
an even split (what nn.DataParallel runs) is tried first and runs out of memory on the small
device, and the report (table, JSON, PNG in runs/demo) shows both against the budgets.
A budget counts each replica's forward allocations plus its parameters (and, on the first
device, gradients and optimizer state); backward's transient allocations are not counted.

Every --mode but dp starts one process per device under torchrun (through evendp launch's
planning). Exit code 2 on bad input, 1 when a run fails (a NaN loss that stays, a full disk,
a stalled rank), 130 after SIGINT (Ctrl-C) and 143 after SIGTERM: the step in
progress finishes on every rank, a checkpoint is saved, and --resume continues.
--max-restarts N (a mode with ranks) lets torchrun restart the ranks after one dies; the
restarted ranks resume from the last checkpoint.
"""

from __future__ import annotations

# Absolute imports: under --mode ddp this file is also torchrun's script.
import argparse
import gc
import os
import signal
import sys
from typing import Any


class _EarlyStop:
    """A rank's SIGINT/SIGTERM before torch is imported, kept for the command line's stop flag
    (evendp.cli._fast.EarlyStop, which importing evendp would load torch to reach)."""

    signum: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum


if __name__ == "__main__":  # torchrun's rank: from the first instant
    _early = _EarlyStop()
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _early._handle)
    # Start-up (torch, the libraries, the model) allocates for seconds, and each automatic
    # full collection walks all of it again: off until run_rank has built the run, which
    # then freezes what it built and turns collection back on. A 2-step CPU run of 2 ranks:
    # 14.9 -> 11.3 s of CPU, 10.6 -> 8.5 s of wall time (3 runs each, interleaved).
    gc.disable()

from evendp.cli._args import say_units  # noqa: E402 (after the early handlers)
from evendp.cli._train_args import add_options  # noqa: E402

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Register ``evendp train``."""
    p = subparsers.add_parser(
        "train",
        help="train the built-in char GPT on the stdlib source, using every device fully",
        description=__doc__,  # plain text: CleanParser.format_help drops the markup
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train and write the report; exit code 0, 2 for bad input, 130/143 after SIGINT/SIGTERM."""
    claimed: list[Any] = []  # what undoes this run's claim of --out (fresh_start_check)
    code = _checked(args, claimed)
    if code == 2 and claimed:  # refused, here or by the ranks, before anything was written:
        claimed[0]()  # no folder left holding only evendp's marker
    return code


def _checked(args: argparse.Namespace, claimed: list[Any]) -> int:
    """The run, every refusal and fault one line with its exit code."""
    from evendp._core._errors import EvendpError
    from evendp.cli._train_args import (
        fresh_start_check,
        is_launched_rank,
        options_from_env,
        resume_check,
        validate_args,
    )

    try:
        args = options_from_env(args)  # a rank of --mode ddp|fsdp2: the launcher's options
        validate_args(args)
        done = resume_check(args)
        if done is not None:
            from evendp.cli._train_ddp import told_nothing_to_train

            return told_nothing_to_train(args, done)
        undo = fresh_start_check(args)
        if undo is not None:
            claimed.append(undo)
        if not is_launched_rank():  # the launcher said it once
            say_units("evendp train", "--memory", args.memory)
        return _run(args)
    except EvendpError as exc:
        from evendp.cli._train_ddp import report_error, told_the_other_nodes

        # once, not per rank; 2: bad input, 1: a fault
        return report_error(told_the_other_nodes(args, exc))
    except (RuntimeError, ValueError) as exc:
        from evendp._core._oom_errors import is_oom_error
        from evendp._distributed._stalled import peer_lost

        why = peer_lost(exc)
        if is_launched_rank() and why is not None:  # a victim: torchrun names the cause
            rank = os.environ.get("RANK", "?")
            print(
                f"evendp train: error: rank {rank} lost its connection to another rank "
                f"({why}): that rank stopped or died",
                file=sys.stderr,
            )
            return 1
        if not is_oom_error(exc):
            raise
        print(
            f"evendp train: error: out of memory ({str(exc).splitlines()[0]}); lower --batch, "
            "shrink the model (--n-layer, --n-embd, --block-size), or declare --memory so the "
            "planner splits the batch to fit",
            file=sys.stderr,
        )
        return 2


def _run(args: argparse.Namespace) -> int:
    """One process (``--mode dp``), a rank under torchrun, or the launcher of the ranks."""
    if args.mode == "dp":
        from evendp._distributed._run_lock import hold_run_dir
        from evendp.cli._train_local import run_local

        with hold_run_dir(args.out):  # one writer: refused while another live run has --out
            return run_local(args)
    from evendp.cli._train_ddp import launch_ranks, run_rank

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args)
    return launch_ranks(args)


if __name__ == "__main__":  # torchrun runs this file as the script of each rank
    from evendp.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))

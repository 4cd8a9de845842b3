"""The ``evendp`` command line: one module per subcommand, each with ``add_parser(subparsers)``
(which sets ``func``) and ``run(args) -> int``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from ._args import CleanParser, say_error

__all__ = ["KEEP_SIGNALS", "build_parser", "has_gpu", "is_light", "main", "version"]

# Subcommands in the order `evendp --help` lists them.
_SUBCOMMANDS: tuple[str, ...] = ("devices", "plan", "launch", "train")
# Their help, for `evendp --help` without torch (a test keeps it equal to the modules').
_HELP: dict[str, str] = {
    "devices": "list GPUs with free memory, utilization and processes (NVML, no CUDA init)",
    "plan": "predict per-device memory and choose the split (no GPU needed)",
    "launch": "run a script under torchrun with per-rank batch sizes (EVENDP_BATCH_SIZES)",
    "train": "train the built-in char GPT on the stdlib source, using every device fully",
}


def is_light(argv: list[str]) -> bool:
    """Whether ``argv`` (after the program name) is answered without torch nor a subcommand.

    >>> is_light(["--version"]), is_light(["train", "--help"])
    (True, False)
    """
    return list(argv) in (["--version"], ["--help"], ["-h"])


def version() -> str:
    """The installed distribution's version (one source of truth: ``pyproject.toml``).

    >>> version().count(".") >= 1
    True
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("evendp")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "unknown (not installed; pip install -e .)"


def build_parser(light: bool = False) -> CleanParser:
    """The top-level parser; ``light``: the subcommands by name and help only (their modules,
    and torch, are not imported)."""
    parser = CleanParser(
        prog="evendp",
        description="Balanced data-parallel training with exact gradients.",
    )
    parser.add_argument(
        "--version", action="version", version=f"evendp {version()}", help="print the version"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        if light:
            subparsers.add_parser(name, help=_HELP[name])
        else:
            importlib.import_module(f"evendp.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``evendp`` command; the exit code (2: bad input, 130/143 after a signal, which
    ``train`` and ``launch`` catch from the start to stop at a step boundary, saved)."""
    from .._distributed._interrupt import StopFlag, exit_code

    early = StopFlag()
    try:
        with early:
            return _main(argv, early)
    except KeyboardInterrupt:  # a second Ctrl-C, or Ctrl-C in another command
        print("evendp: interrupted", file=sys.stderr)
        return exit_code(2)


def _main(argv: Sequence[str] | None, early: Any) -> int:
    from .._core._errors import EvendpError
    from .._distributed._interrupt import exit_code

    parser = build_parser(light=is_light(sys.argv[1:] if argv is None else list(argv)))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) and bad arguments (2)
        return int(exit_.code or 0)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.command not in KEEP_SIGNALS:  # no run to stop cleanly: the usual Ctrl-C
        early.__exit__(None, None, None)
        if early.signum is not None:
            return exit_code(early.signum)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command
    if args.command in _CUDA_COMMANDS:
        _choose_allocator_setting()
    try:
        code: int = args.func(args)
    except EvendpError as exc:  # a subcommand's own check missed it: still one clean line
        say_error(f"evendp {args.command}", exc)
        return exc.exit_code  # 2 for bad input, 1 for a fault while training
    return code


# The commands that run training (or launch it): a signal stops them at a step boundary.
KEEP_SIGNALS = ("train", "launch")

# The commands that plan or run on GPUs: they choose the CUDA allocator's setting first.
_CUDA_COMMANDS = ("train", "launch", "plan")


def _choose_allocator_setting() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` on a machine with a GPU, unless the
    user set it: at the start, as the allocator reads it once when CUDA initialises, and the
    processes ``launch`` and ``train`` start inherit it (the planner models it). Said once."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or not has_gpu():
        return
    from .._planning._allocator import alloc_conf_default

    chosen = alloc_conf_default()
    print(
        f"evendp: PYTORCH_CUDA_ALLOC_CONF={chosen} (set by evendp, so the allocator reserves "
        "close to what tensors use; set PYTORCH_CUDA_ALLOC_CONF to choose another)",
        file=sys.stderr,
    )


def has_gpu() -> bool:
    """Whether NVML sees a GPU here (no CUDA context, no torch); no NVML: no driver, no GPU."""
    from .._planning._devices import list_devices

    try:
        return bool(list_devices())
    except Exception:  # NVML ships with the driver: without it there is no CUDA device
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

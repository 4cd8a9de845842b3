"""The ``evendp`` command line: one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (which registers its parser and
sets ``func``) and the function it points to, ``run(args) -> int``. Bad input exits with code
2 and one line on stderr naming the value, what was expected and the fix.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ._args import CleanParser

__all__ = ["build_parser", "main", "version"]

# Subcommands in the order `evendp --help` lists them.
_SUBCOMMANDS: tuple[str, ...] = ("devices", "plan", "launch", "train")


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


def build_parser() -> CleanParser:
    """The top-level parser with every subcommand registered."""
    parser = CleanParser(
        prog="evendp",
        description="Balanced data-parallel training with exact gradients.",
    )
    parser.add_argument(
        "--version", action="version", version=f"evendp {version()}", help="print the version"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"evendp.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``evendp`` command; returns the exit code (2 for bad input, 130/143 after a
    signal).

    SIGINT/SIGTERM are caught from the start: one arriving while the command starts up is
    kept, and a training run stops at its first step boundary, saved, never a traceback.
    """
    from .._interrupt import StopFlag, exit_code

    try:
        with StopFlag():
            code = _main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C: the user will not wait
        print("evendp: interrupted (SIGINT twice)", file=sys.stderr)
        return exit_code(2)
    return code


def _main(argv: Sequence[str] | None) -> int:
    from .._errors import EvendpError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) and bad arguments (2)
        return int(exit_.code or 0)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command
    try:
        code: int = args.func(args)
    except EvendpError as exc:  # a subcommand's own check missed it: still one clean line
        print(f"evendp {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code  # 2 for bad input, 1 for a fault while training
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``evendp`` command line: one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (which registers its parser and
sets ``func``) and the function it points to, ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Subcommands in the order `evendp --help` lists them.
_SUBCOMMANDS: tuple[str, ...] = ("devices", "plan", "launch", "train")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="evendp",
        description="Balanced data-parallel training with exact gradients.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"evendp.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``evendp`` command; returns the exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

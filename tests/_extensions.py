"""The folder of compiled torch extensions the suite uses (DeepSpeed's CPU comm op), and
``python -m tests._extensions``, which builds that op ahead of the tests (``make test``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["EXTENSIONS_DIR", "build"]

#: Git-ignored, per checkout: never ~/.cache, where a killed build's lock stalls later ones.
EXTENSIONS_DIR = Path(__file__).resolve().parents[1] / "build" / "torch_extensions"


def build() -> None:
    """Compile DeepSpeed's shared-memory comm op where it is installed (about a minute on 2
    cores, once per checkout); nothing to do without DeepSpeed."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load(verbose=False)


if __name__ == "__main__":
    build()

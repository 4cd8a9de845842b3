"""Collecting the suite imports nothing optional: what a machine without the dev extras (the
lent GPU machine's ``pytest -m gpu``: torch, evendp and pytest) still collects.

A module (a test module, or one collected for its doctests) that imports a dev extra which is
not installed is skipped, saying which, instead of failing collection; a Markdown file whose
code blocks need Sybil is one skipped item. Only a package of :data:`DEV_EXTRAS` that is
really absent turns an import error into a skip: any other import error still fails.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["DEV_EXTRAS", "missing_extra", "skip_when_an_extra_is_missing", "unread_markdown"]

#: The import names of the packages the suite uses beyond torch, evendp's own dependencies
#: and pytest (pyproject.toml's extras ``hf``, ``lightning``, ``deepspeed``, ``trl``,
#: ``tensorboard`` and ``dev``).
DEV_EXTRAS = frozenset(
    {
        "hypothesis", "sybil", "transformers", "accelerate", "lightning", "pytorch_lightning",
        "lightning_fabric", "deepspeed", "trl", "tensorboard", "mlflow", "xdist", "pytest_cov",
        "pytest_timeout",
    }
)  # fmt: skip


def missing_extra(error: BaseException | None) -> str | None:
    """The dev extra whose absence caused ``error`` (through its causes), else ``None``.

    >>> missing_extra(ModuleNotFoundError("No module named 'sybil'", name="sybil")) in (
    ...     None, "sybil")  # None where Sybil is installed
    True
    >>> missing_extra(ModuleNotFoundError("No module named 'evendp.gone'", name="evendp.gone"))
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        name = getattr(error, "name", None)
        if isinstance(error, ModuleNotFoundError) and name:
            top = name.split(".")[0]
            if top in DEV_EXTRAS and importlib.util.find_spec(top) is None:
                return top
        error = error.__cause__ or error.__context__
    return None


def skip_when_an_extra_is_missing(collector: pytest.Collector) -> None:
    """Make ``collector`` (a module) skip, naming the extra, when importing it fails for a
    dev extra that is not installed."""
    if not isinstance(collector, pytest.Module):
        return
    collect: Callable[[], Any] = collector.collect

    def collect_or_skip() -> list[Any]:
        try:
            return list(collect())  # a generator may import on its first item
        except Exception as exc:
            extra = missing_extra(exc)
            if extra is None:
                raise
            pytest.skip(f"needs {extra} (a dev extra), not installed here")

    collector.collect = collect_or_skip  # type: ignore[method-assign]


class _UnreadMarkdown(pytest.File):
    """A Markdown file whose code blocks cannot run here: one skipped item says why."""

    def collect(self) -> list[pytest.Item]:
        return [_NeedsSybil.from_parent(self, name="code blocks")]


class _NeedsSybil(pytest.Item):
    def runtest(self) -> None:
        pytest.skip("needs sybil (a dev extra) to run the code blocks of Markdown files")


def unread_markdown(file_path: Path, parent: pytest.Collector) -> pytest.File | None:
    """``pytest_collect_file`` without Sybil: each Markdown file one skipped item (testpaths
    name README.md, which would otherwise be "not found")."""
    if file_path.suffix != ".md":
        return None
    return _UnreadMarkdown.from_parent(parent, path=file_path)  # type: ignore[no-any-return]

"""Build helpers for ``mkdocs build`` (mkdocs.yml): the API reference and the topic pages.

Two parts, both for the site only (the Markdown and the docstrings stay as they are):

- :class:`DocstringsAsMarkdown`, a griffe extension: the docstrings are written for
  ``help()``, doctest and the Sphinx roles (``>>>`` examples, ````literal````,
  ``:class:`Plan```), which Markdown would read as nested quotes and reference links; it
  fences each ``>>>`` example as a ``pycon`` block and turns roles and literals into code.
- :func:`on_page_markdown`, an MkDocs hook: a topic page may link to a file of the
  repository outside ``docs/`` (``../examples/hf_trainer.py``), right on GitHub but not in
  the site. Such a link must name an existing file (else the strict build fails, naming
  it) and becomes its text in the site.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import griffe

__all__ = ["DocstringsAsMarkdown", "fence_doctests", "on_page_markdown"]

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)]*)?\)")
log = logging.getLogger("mkdocs.plugins.evendp")


def fence_doctests(text: str) -> str:
    """``>>>`` examples fenced as ``pycon`` code, roles and double-backtick literals as code.

    An example (``>>>`` and its output, up to a blank line) becomes a fenced ``pycon``
    block at its own indentation (tests/test_reference.py has one).
    """
    out: list[str] = []
    fence: str | None = None  # the indentation of the open fence
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None and stripped.startswith(">>>"):
            fence = line[: len(line) - len(stripped)]
            out.append(f"{fence}```pycon")
        elif fence is not None and not stripped:
            out.append(f"{fence}```")
            fence = None
        if fence is None:
            line = _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", line))
        out.append(line)
    if fence is not None:
        out.append(f"{fence}```")
    return "\n".join(out)


class DocstringsAsMarkdown(griffe.Extension):
    """Every docstring the reference shows, read as Markdown (see the module's docstring)."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None:
            docstring.value = fence_doctests(docstring.value)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links out of ``docs/`` to repository files: checked, then shown as their text."""
    source = Path(page.file.abs_src_path).parent

    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if not (source / target).exists():
            log.warning(f"{page.file.src_path}: link to {target!r}, which does not exist")
        return text

    return _LINK.sub(replace, markdown)

"""The code blocks of README.md and docs/*.md, run by pytest through Sybil (conftest.py).

Policy (the README's Quick start points here):

- ```` ```python ```` blocks run, in order, one namespace per Markdown file (a later block may
  use what an earlier one defined), in a fresh temporary directory (files they write land
  there). ``>>>`` blocks are doctests. Setup a snippet needs but a reader does not (a tiny
  model, a batch) sits right before it in an HTML comment, ``<!-- invisible-code-block: python
  ... -->``, visible in the Markdown source only.
- ```` ```bash ```` and ```` ```console ```` blocks (``$ `` lines are commands, the rest is
  their output) run each ``evendp ...`` command in this process (``evendp.cli.main``), which
  must exit 0. Any other command (``make``, ``pip``, ``torchrun``) cannot run here: such a
  block must be marked compile-only.
- ``<!-- compile-only: REASON -->`` right before a block (REASON says why: needs GPUs, runs
  under torchrun, takes minutes, a fragment) checks it without running it: Python is compiled;
  in a shell block every ``evendp`` command must parse with the real argument parser, every
  ``examples/...`` or ``benchmarks/...`` path it names must exist, and the block must pass
  ``bash -n``. ```` ```diff ```` blocks (old and new lines) are compile-only by nature: the new
  side (``+`` and context lines) is checked the same way.
- Untagged and ```` ```text ```` blocks are program output or pictures: not run, but one that
  holds a command (a ``$ `` or ``evendp `` line, a Python import) fails: tag it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region, Sybil
from sybil.parsers.abstract.lexers import LexerCollection
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer

__all__ = ["markdown_sybil"]

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGUAGES = ("bash", "console", "diff")
_PATH = re.compile(r"(?:^|\s)((?:examples|benchmarks)/[\w./-]+)")


# --- shell blocks -----------------------------------------------------------------------------


def _commands(source: str, language: str) -> list[str]:
    """The block's commands: comments dropped, backslash continuations joined."""
    lines = source.splitlines()
    if language == "console":  # only "$ " lines are commands; the rest is their output
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    elif language == "diff":  # the new side: added and context lines
        lines = [line[1:] for line in lines if line[:1] in ("+", " ")]
    joined, current = [], ""
    for line in lines:
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        command = current.split("  #")[0].split(" # ")[0].strip()
        if command and not command.startswith("#"):
            joined.append(command)
        current = ""
    return joined


def _evendp_argv(command: str) -> list[str] | None:
    words = shlex.split(command)
    return words[1:] if words and words[0] == "evendp" else None


def _parse_only(argv: list[str]) -> None:
    """``argv`` must parse with the real ``evendp`` argument parser (no drift in flags)."""
    from evendp.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            what = f"`evendp {shlex.join(argv)}` does not parse: {err.getvalue()}"
            raise AssertionError(what) from None


def _check_shell(commands: list[str], language: str) -> None:
    for command in commands:
        argv = _evendp_argv(command)
        if argv is not None:
            _parse_only(argv)
        for path in _PATH.findall(command):
            assert (ROOT / path).exists(), f"{command!r} names {path}, which does not exist"
    if language != "diff":
        script = "\n".join(commands)
        done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert done.returncode == 0, f"bash -n: {done.stderr}"


def _run_shell(commands: list[str]) -> None:
    from evendp.cli import main

    for command in commands:
        argv = _evendp_argv(command)
        if argv is None:
            raise AssertionError(
                f"{command!r} cannot run in the docs tests: put "
                "<!-- compile-only: REASON --> before its block"
            )
        code = main(argv)
        assert code == 0, f"`{command}` exited {code}"


def _is_python_diff(source: str) -> bool:
    commands = _commands(source, "diff")
    return not all(c.split()[0] in ("evendp", "torchrun", "python") for c in commands if c)


class ShellParser:
    """```bash, ```console and ```diff blocks: run (evendp commands) or check them."""

    def __init__(self) -> None:
        self.lexers = LexerCollection([FencedCodeBlockLexer(language="bash|console|diff")])

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexers(document):
            language = region.lexemes["language"]
            region.parsed = (language, str(region.lexemes["source"]))
            region.evaluator = self.evaluate
            yield region

    @staticmethod
    def evaluate(example: Example) -> None:
        language, source = example.parsed
        if language == "diff":
            _check_diff(source)
        else:
            _run_shell(_commands(source, language))


def _check_diff(source: str) -> None:
    if _is_python_diff(source):
        new = "\n".join(line[1:] for line in source.splitlines() if line[:1] in ("+", " "))
        compile(new, "<diff: new side>", "exec")
    else:
        _check_shell(_commands(source, "diff"), "diff")


# --- compile-only -----------------------------------------------------------------------------


class CompileOnly:
    """``<!-- compile-only: REASON -->``: the next block is checked, not run."""

    def __init__(self) -> None:
        self.lexers = LexerCollection(
            [DirectiveInHTMLCommentLexer(directive="compile-only", arguments=".+?")]
        )

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexers(document):
            region.parsed = region.lexemes["arguments"].strip()
            region.evaluator = self.evaluate
            yield region

    @staticmethod
    def evaluate(example: Example) -> None:
        assert example.parsed, "compile-only needs a reason: <!-- compile-only: REASON -->"

        def check_next(next_example: Example) -> None:
            example.document.pop_evaluator(check_next)
            parsed = next_example.parsed
            if isinstance(parsed, tuple):  # a shell block
                language, source = parsed
                if language == "diff":
                    _check_diff(source)
                else:
                    _check_shell(_commands(source, language), language)
            elif isinstance(parsed, str):  # a Python code block
                compile(parsed, f"{next_example.path}:{next_example.line}", "exec")
            else:
                raise AssertionError("compile-only must precede a code block")

        example.document.push_evaluator(check_next)


# --- untagged blocks --------------------------------------------------------------------------

_CODE_LINE = re.compile(
    r"^(\$ |evendp (devices|plan|train|launch)( |$)|torchrun |import \w|from \w[\w.]* import )"
)


class OutputParser:
    """Untagged and ```text blocks are output: none may hide a command."""

    def __init__(self) -> None:
        self.lexers = LexerCollection([FencedCodeBlockLexer(language="(?:text)?")])

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexers(document):
            region.parsed = str(region.lexemes["source"])
            region.evaluator = self.evaluate
            yield region

    @staticmethod
    def evaluate(example: Example) -> None:
        code = [line for line in example.parsed.splitlines() if _CODE_LINE.match(line)]
        assert not code, (
            f"an untagged block holds commands ({code[0]!r}): tag it bash/console/python"
        )


# --- per document: a temporary working directory ----------------------------------------------


@contextlib.contextmanager
def _in_tmp() -> Iterator[Path]:
    before = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="evendp-docs-") as tmp:
        (Path(tmp) / "examples").symlink_to(ROOT / "examples")
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(before)


_OPEN: dict[int, contextlib.ExitStack] = {}


def _setup(namespace: dict[str, Any]) -> None:
    stack = contextlib.ExitStack()
    stack.enter_context(_in_tmp())
    _OPEN[id(namespace)] = stack


def _teardown(namespace: dict[str, Any]) -> None:
    _OPEN.pop(id(namespace)).close()


PARSERS = [PythonCodeBlockParser(), ShellParser(), CompileOnly(), OutputParser()]
markdown_sybil = Sybil(
    parsers=PARSERS,
    patterns=["README.md", "docs/*.md"],
    path=str(ROOT),
    setup=_setup,
    teardown=_teardown,
)

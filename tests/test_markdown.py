"""The docs-blocks plugin (tests/_markdown.py) fails a block that drifts from the code."""

from __future__ import annotations

from pathlib import Path

import pytest
from sybil import Sybil

from tests._markdown import PARSERS

FENCE = "```"


def _evaluate(tmp_path: Path, text: str) -> None:
    """Every example of a Markdown file holding ``text``, evaluated in order."""
    (tmp_path / "page.md").write_text(text)
    document = Sybil(parsers=PARSERS, patterns=["*.md"], path=str(tmp_path)).parse(
        tmp_path / "page.md"
    )
    for example in document:
        example.evaluate()


def test_python_blocks_share_a_namespace_and_run(tmp_path: Path) -> None:
    _evaluate(tmp_path, f"{FENCE}python\nx = 2\n{FENCE}\n\n{FENCE}python\nassert x == 2\n{FENCE}\n")
    with pytest.raises(NameError):
        _evaluate(tmp_path, f"{FENCE}python\nundefined_name\n{FENCE}\n")


def test_a_renamed_flag_fails_even_in_a_compile_only_block(tmp_path: Path) -> None:
    ok = "evendp plan --model gpt --memory 24GiB --json"
    marker = "<!-- compile-only: plans a GPT -->\n"
    _evaluate(tmp_path, f"{marker}{FENCE}bash\n{ok}\n{FENCE}\n")
    with pytest.raises(AssertionError, match="does not parse"):
        _evaluate(tmp_path, f"{marker}{FENCE}bash\nevendp plan --no-such-flag 1\n{FENCE}\n")
    with pytest.raises(AssertionError, match="does not exist"):
        _evaluate(tmp_path, f"{marker}{FENCE}bash\ntorchrun examples/gone.py\n{FENCE}\n")


def test_shell_blocks_run_evendp_and_refuse_other_commands_unmarked(tmp_path: Path) -> None:
    _evaluate(tmp_path, f"{FENCE}console\n$ evendp --version\nevendp 0.1.0\n{FENCE}\n")
    with pytest.raises(AssertionError, match="compile-only"):
        _evaluate(tmp_path, f"{FENCE}bash\nmake demo\n{FENCE}\n")


def test_compile_only_compiles_python_and_needs_a_reason(tmp_path: Path) -> None:
    _evaluate(tmp_path, f"<!-- compile-only: needs GPUs -->\n{FENCE}python\nnot_run()\n{FENCE}\n")
    with pytest.raises(SyntaxError):
        _evaluate(tmp_path, f"<!-- compile-only: needs GPUs -->\n{FENCE}python\ndef (\n{FENCE}\n")


def test_untagged_blocks_may_not_hide_commands(tmp_path: Path) -> None:
    _evaluate(tmp_path, f"{FENCE}\nevendp train: 3 device(s)\nfinished: 100 steps\n{FENCE}\n")
    with pytest.raises(AssertionError, match="tag it"):
        _evaluate(tmp_path, f"{FENCE}\nevendp plan --model gpt\n{FENCE}\n")


def test_diff_blocks_compile_their_new_side(tmp_path: Path) -> None:
    _evaluate(tmp_path, f"{FENCE}diff\n-old = (\n+new = 1\n same = new\n{FENCE}\n")
    with pytest.raises(SyntaxError):
        _evaluate(tmp_path, f"{FENCE}diff\n-old = 1\n+new = (\n{FENCE}\n")

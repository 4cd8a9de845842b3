"""The API reference (docs/reference.md, built by ``make docs``) cannot drift from the code,
and every relative link of README.md and docs/*.md resolves, anchors included (the README is
not part of the MkDocs site, so its strict build does not check it)."""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import evendp

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
DOCUMENTED = re.findall(r"^::: ([\w.]+)$", REFERENCE, flags=re.MULTILINE)


def _integration_names() -> list[str]:
    """``evendp.integrations.M.NAME`` for each public module's ``__all__``, read without
    importing it (the integrations import transformers, accelerate, lightning...)."""
    names = []
    for path in sorted((ROOT / "src" / "evendp" / "integrations").glob("[!_]*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                values = ast.literal_eval(node.value)
                names += [f"evendp.integrations.{path.stem}.{name}" for name in values]
    return names


PUBLIC = [f"evendp.{name}" for name in evendp.__all__] + _integration_names()


def test_every_public_object_is_in_the_reference_once() -> None:
    missing = [name for name in PUBLIC if name not in DOCUMENTED]
    assert not missing, f"add to docs/reference.md: {['::: ' + m for m in missing]}"
    assert len(DOCUMENTED) == len(set(DOCUMENTED)), "a name is documented twice"


def test_the_reference_names_only_public_objects() -> None:
    stale = [name for name in DOCUMENTED if name not in PUBLIC]
    assert not stale, f"not public (any more): {stale}"


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """GitHub's (and MkDocs' toc) anchor for a heading: lower case, punctuation dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.MULTILINE)}


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for match in _LINK.finditer(_FENCE.sub("", page.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file) if file else page
        if not dest.exists():
            broken.append(f"{target} (no file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading for #{anchor})")
    assert not broken, f"{page.name}: {broken}"


def test_slugs_follow_github() -> None:
    assert _slug("Accelerate: `UnevenAccelerator` and `uneven_dataloader`") == (
        "accelerate-unevenaccelerator-and-uneven_dataloader"
    )


# --- the build helpers (tools/docs_build.py) --------------------------------------------------


def _docs_build() -> object:
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "tools" / "docs_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstrings_become_markdown_with_fenced_examples() -> None:
    build = _docs_build()
    text = "Use ``x`` and :class:`~evendp.Plan`:\n\n    >>> f([1, 2])\n    [[1], [2]]\n\nEnd."
    out = build.fence_doctests(text)  # type: ignore[attr-defined]
    assert out == (
        "Use `x` and `evendp.Plan`:\n\n    ```pycon\n    >>> f([1, 2])\n    [[1], [2]]\n"
        "    ```\n\nEnd."
    )


def test_a_link_out_of_docs_must_name_an_existing_file(caplog: pytest.LogCaptureFixture) -> None:
    build = _docs_build()
    file = SimpleNamespace(abs_src_path=str(ROOT / "docs" / "page.md"), src_path="page.md")
    page = SimpleNamespace(file=file)
    markdown = "[examples/ddp_uneven.py](../examples/ddp_uneven.py), [gone](../examples/gone.py)"
    with caplog.at_level(logging.WARNING):
        out = build.on_page_markdown(markdown, page, None, None)  # type: ignore[attr-defined]
    assert out == "examples/ddp_uneven.py, gone"
    assert [r.getMessage() for r in caplog.records] == [
        "page.md: link to '../examples/gone.py', which does not exist"
    ]

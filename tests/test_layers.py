"""The package's layers: every module imports only the layers below it (docs/architecture.md),
and no modules import each other in a circle.

The layers, bottom up, are the subpackages of ``evendp``; a module may import its own
subpackage and any lower layer, never a higher one, and never a sibling layer of the same
rank. Lazy imports inside functions count too: a deferred import is still a dependency.
Imports under ``if TYPE_CHECKING:`` count as well, so type hints cannot hide a cycle.

What crosses a module's edge is public within the package: a module may live under an
underscore path (``evendp._core._exact``), but a name another module imports from it has no
leading underscore and sits in that module's ``__all__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import evendp

SRC = Path(evendp.__file__).parent

# rank of each top-level part of the package, bottom up
LAYERS: dict[str, int] = {
    "_core": 0,  # errors, validation, sizes, the exactness core
    "examples": 1,  # the demo models the CLI trains (import _core only)
    "_distributed": 1,  # process group, counts across ranks, sampler, stop agreement
    "_planning": 2,  # devices, memory, planner, speed, launch plans
    "_parallel": 3,  # one process: scatter, replicas, BalancedDataParallel, predict
    "_training": 4,  # strategies, Trainer, OOM, checkpoints, state, report
    "__init__": 5,  # the public face, evendp/__init__.py
    "__main__": 8,  # python -m evendp
    "integrations": 6,  # adapters over the public face
    "cli": 7,  # the command line
}


def part_of(module: str) -> str:
    """The layer key of a dotted module name inside evendp (``evendp`` alone is the face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _from_imports(path: Path, root: Path) -> list[tuple[ast.ImportFrom, str]]:
    """Every ``from ... import`` in ``path`` with its dotted module, relative ones resolved."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node, target))
    return found


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every evendp import in ``path``, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "evendp"]
    found += [
        (node.lineno, target)
        for node, target in _from_imports(path, root)
        if target.split(".")[0] == "evendp"
    ]
    return sorted(found)


# The one allowed exception: the face's first line answers `evendp --version` and `--help`
# before torch is imported (evendp.cli._fast needs only the standard library).
ALLOWED = {("evendp", "evendp.cli._fast")}


def upward_imports(root: Path) -> list[str]:
    """Every import in the tree under ``root`` that reaches a higher or sibling layer."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        mine = part_of(me)
        for line, target in imported_modules(path, root):
            theirs = part_of(target)
            if theirs == mine or (me, target) in ALLOWED:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{path.relative_to(root.parent)}:{line} ({mine}) imports {target}")
    return bad


def is_module(dotted: str, root: Path) -> bool:
    """Whether ``dotted`` (``evendp.x.y``) names a module or package in the tree at ``root``."""
    where = root.parent.joinpath(*dotted.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def private_name_imports(root: Path) -> tuple[list[str], list[str]]:
    """Imports of an underscore name from another module: ``(across layers, within one)``.

    ``from .._core._exact import weighted_sum`` is fine (the module path is private, the
    name is not); ``from .._training._checkpoint import _read_state_file`` is not. Importing
    a private *module* (``from . import _oom``) is fine too: the module is the unit.
    """
    across, within = [], []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        for node, target in _from_imports(path, root):
            if target.split(".")[0] != "evendp" or target == me:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if is_module(f"{target}.{name}", root):
                    continue
                where = f"{path.relative_to(root.parent)}:{node.lineno} imports {target}.{name}"
                (across if part_of(target) != part_of(me) else within).append(where)
    return across, within


def test_every_module_has_a_layer() -> None:
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    tops = {t for t in tops if t.endswith((".py",)) or not t.startswith(("py.", "__pycache__"))}
    missing = {t for t in tops if t not in LAYERS and t not in {"py", "__pycache__"}}
    assert not missing, f"modules outside every layer: {sorted(missing)}"


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(SRC) == []


def test_the_check_fails_on_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a core module importing training code is reported."""
    root = tmp_path / "evendp"
    for pkg in ("_core", "_training"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "_training" / "_trainer.py").write_text("from .._core._split import split_sizes\n")
    (root / "_core" / "_split.py").write_text("def f():\n    from .._training import _trainer\n")
    assert upward_imports(root) == ["evendp/_core/_split.py:2 (_core) imports evendp._training"]


def _imported_by(path: Path, root: Path) -> set[str]:
    """The evendp modules ``path`` imports: ``from pkg import mod`` is an edge to ``pkg.mod``."""
    me = module_name(path, root)
    found = {t for _, t in imported_modules(path, root) if is_module(t, root)}
    for node, target in _from_imports(path, root):
        found |= {f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}", root)}
    return {t for t in found if t.split(".")[0] == "evendp" and t != me}


def import_cycles(root: Path) -> list[list[str]]:
    """Every circle of modules importing each other (lazy and type-only imports included),
    each as its sorted module names: the strongly connected components of the import graph."""
    graph = {module_name(path, root): _imported_by(path, root) for path in root.rglob("*.py")}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is ~100 modules deep at most
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            part = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert import_cycles(SRC) == []


def test_the_check_fails_on_an_import_cycle(tmp_path: Path) -> None:
    """The checker itself: a circle through a lazy import and a type-only one is found."""
    root = tmp_path / "evendp"
    (root / "_training").mkdir(parents=True)
    for init in (root / "__init__.py", root / "_training" / "__init__.py"):
        init.write_text("")
    (root / "_training" / "_a.py").write_text("def f():\n    from ._b import g\n")
    (root / "_training" / "_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._c import h\n"
    )
    (root / "_training" / "_c.py").write_text("from . import _a\n")
    (root / "_training" / "_d.py").write_text("from ._a import f\n")  # on no circle
    assert import_cycles(root) == [
        ["evendp._training._a", "evendp._training._b", "evendp._training._c"]
    ]


def test_no_module_imports_a_private_name_of_another_layer() -> None:
    across, _ = private_name_imports(SRC)
    assert across == [], "give the name a public spelling in its module's __all__"


def test_no_module_imports_a_private_name_of_a_sibling() -> None:
    _, within = private_name_imports(SRC)
    assert within == [], "give the name a public spelling in its module's __all__"


def test_the_check_fails_on_a_private_name_import(tmp_path: Path) -> None:
    """The checker itself: an underscore name imported across a layer or from a sibling
    module is reported; a private module path or a private module itself is not."""
    root = tmp_path / "evendp"
    for pkg in ("_core", "_training"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "_core" / "_split.py").write_text("def _check(): ...\ndef split(): ...\n")
    (root / "_training" / "_checkpoint.py").write_text("def _read(): ...\n")
    (root / "_training" / "_trainer.py").write_text(
        "from .._core._split import _check, split\n"
        "from .._core import _split\n"
        "from ._checkpoint import _read\n"
        "from . import _checkpoint\n"
        "from .._core._split import __doc__\n"
    )
    assert private_name_imports(root) == (
        ["evendp/_training/_trainer.py:1 imports evendp._core._split._check"],
        ["evendp/_training/_trainer.py:3 imports evendp._training._checkpoint._read"],
    )


@pytest.mark.parametrize("name", evendp.__all__)
def test_public_names_keep_reporting_the_package(name: str) -> None:
    obj = getattr(evendp, name)
    if isinstance(obj, type) or callable(obj):
        assert obj.__module__ == "evendp"


def exactness_imports(root: Path) -> list[str]:
    """Imports of the exactness core (``evendp._core._exact``) by the integrations, and of
    its building blocks (``weighted_sum``, ``zero_weight``) by any module outside ``_core``:
    the weighting is :func:`evendp.share_loss`, called through the face by the adapters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        if part_of(me) == "_core":
            continue
        for node, target in _from_imports(path, root):
            names = {a.name for a in node.names}
            core = target == "evendp._core._exact" or (
                target == "evendp._core" and "_exact" in names
            )
            if not core:
                continue
            if part_of(me) == "integrations" or names & {"weighted_sum", "zero_weight"}:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {target}")
    return found


def test_the_exactness_weighting_is_called_through_one_function() -> None:
    assert exactness_imports(SRC) == []


def test_the_exactness_check_fails_on_an_integration_importing_the_core(tmp_path: Path) -> None:
    root = tmp_path / "evendp"
    for pkg in ("_core", "integrations", "_training"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "_core" / "_exact.py").write_text("def weighted_sum(m, c):\n    return m * c\n")
    (root / "integrations" / "x.py").write_text("from .._core._exact import share_loss\n")
    (root / "_training" / "y.py").write_text("from .._core._exact import weighted_sum\n")
    assert exactness_imports(root) == [
        "evendp/_training/y.py:1 imports evendp._core._exact",
        "evendp/integrations/x.py:1 imports evendp._core._exact",
    ]


def integration_private_imports(root: Path) -> set[str]:
    """Every name an integration imports from a private part of evendp (``evendp._*``, not
    its own ``integrations`` package), as ``"integrations/file.py: evendp._x._y.name"``; a
    bare ``import evendp._x`` as its module."""
    found = set()
    for path in sorted((root / "integrations").rglob("*.py")):
        file = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {f"{file}: {a.name}" for a in node.names if a.name.startswith("evendp._")}
        for node, target in _from_imports(path, root):
            if target.startswith("evendp._"):
                found |= {f"{file}: {target}.{a.name}" for a in node.names}
            elif target == "evendp":  # from evendp import _core
                found |= {f"{file}: evendp.{a.name}" for a in node.names if a.name[0] == "_"}
    return found


def test_the_integrations_use_only_the_public_face() -> None:
    """Issue 52 item 3: "the integrations use only evendp's public face"."""
    assert integration_private_imports(SRC) == set()


def test_the_integration_check_sees_every_way_to_a_private_module(tmp_path: Path) -> None:
    root = tmp_path / "evendp"
    for pkg in ("_core", "integrations"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "integrations" / "x.py").write_text(
        "import evendp\nimport evendp._core._a\nfrom .._core._a import f\n"
        "from evendp._core import _a\nfrom evendp import _core, split_sizes\n"
        "from ._rows import gather_rows\n"
    )
    assert integration_private_imports(root) == {
        "integrations/x.py: evendp._core._a",  # import, and from evendp._core import _a
        "integrations/x.py: evendp._core._a.f",
        "integrations/x.py: evendp._core",
    }

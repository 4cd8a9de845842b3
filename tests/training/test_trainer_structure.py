"""The Trainer module has no mode branch: every decision that differs is a strategy's.

Read from the source (ast), so a new ``self.distributed`` test, ``cast(``, raw collective or
strategy flag in the loop fails here, and the copies of the exactness arithmetic stay in
``evendp/_core/_exact.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import evendp

SRC = Path(evendp.__file__).parent
# What the old strategies exposed as flags for callers to branch on.
FLAGS = {
    "catch_oom", "guard_reduces_total", "losses_local", "min_micro_steps",
    "sharded_checkpoint", "distributed", "stop_source", "agree",
}  # fmt: skip


def _tree(name: str) -> ast.Module:
    return ast.parse((SRC / name).read_text())


def test_the_trainer_module_has_no_mode_branch_cast_or_collective() -> None:
    tree = _tree("_training/_trainer.py")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "dist" not in names and "cast" not in names
    assert "BalancedDataParallel" not in names
    assert not FLAGS & attributes, FLAGS & attributes
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names
    }
    assert not {"cast", "BalancedDataParallel", "comm_device"} & imported


def test_no_strategy_flag_is_read_outside_the_strategies() -> None:
    for path in SRC.rglob("*.py"):
        if "_strategies" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "strategy"
            ):
                assert node.attr not in FLAGS, f"{path.name} reads strategy.{node.attr}"


def _weights_by_count(node: ast.AST) -> bool:
    """``loss * count`` / ``mean * count`` (either order), or ``torch.where(count ...)``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for side, other in ((node.left, node.right), (node.right, node.left)):
            text = ast.unparse(other)
            if ast.unparse(side) == "count" and ("loss" in text or "mean" in text):
                return True
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.where" and node.args:
        return "count" in ast.unparse(node.args[0])
    return False


def test_count_weighting_is_written_once_in_the_exact_core() -> None:
    found = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if any(_weights_by_count(n) for n in ast.walk(ast.parse(path.read_text())))
    )
    assert found == ["_core/_exact.py"], found


def test_the_architecture_page_shows_train_step_as_it_is() -> None:
    """docs/architecture.md shows the real ``train_step``: a change to either fails here."""
    import inspect

    from evendp._training._step import train_step

    page = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    shown = [b for b in blocks if b.startswith("def train_step(")]
    assert shown == [inspect.getsource(train_step)]


def test_train_step_has_no_mode_branch_cast_or_collective() -> None:
    """The step calls the strategy's capabilities; it never tests which strategy runs."""
    (step,) = [
        n
        for n in ast.walk(_tree("_training/_step.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "train_step"
    ]
    names = {n.id for n in ast.walk(step) if isinstance(n, ast.Name)}
    assert not {"dist", "cast", "isinstance", "BalancedDataParallel"} & names


def test_the_base_strategy_has_at_most_15_public_methods() -> None:
    """Issue 52: the capabilities a step calls, not a protocol spread over many methods."""
    from evendp._training._strategies._base import Strategy

    public = [n for n, v in vars(Strategy).items() if callable(v) and not n.startswith("_")]
    assert len(public) <= 15, public
